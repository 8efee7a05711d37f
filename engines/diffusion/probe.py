"""The image workload's weight probe: a fixed short denoising trajectory, scored the same way by both engines.

Why: the text probe's proof that a sync landed (``engines.shared.probe``: log-probs of a fixed
input under the weights the rollout engine serves, against the trainer's at that version), with
the image policy's actions: Flow-GRPO's per-step log-probs of a recorded denoising trajectory,
the very quantity whose ratio the loss clips, so a gap here is a gap in what training compares.

What it owns: the probe trajectory (:func:`denoising_probe`) and the one computation of its
log-probs both engines run (:func:`probe_logprobs`). The record per version, the check after
each commit and the sync's ``logprob_gap`` are ``engines.shared.probe``'s.

Invariants:
- the trajectory depends on the generator's latent shape and schedule only (never on weights
  or the run): the rectified-flow path ``x_σ = (1 - σ)·x_0 + σ·ε`` between a random "image"
  ``x_0`` and noise ``ε`` of a fixed seed, at the schedule's sigmas. The transformer was trained
  on such points, so each recorded step lies within a few standard deviations of its mean: its
  log-prob is of order one nat, whose float rounding stays far below the probe's bound, while a
  change of any adapted weight moves it (one Flow-GRPO step of a rank-4 adapter on the digits
  model at lr 1e-3 moved it by 0.015 nats, 15 times the float32 bound). Random latents instead
  put the last step thousands of its small std from its mean (log-probs near -1e6, where
  rounding alone is ~0.1 nat);
- the prompt is the unconditional one ``""`` (every prompt encoder encodes it, whatever its
  task's prompts), without guidance: one forward of ``steps`` rows, every step an SDE step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.algorithms.flow_grpo import sde_transition, transition_log_prob
from tandem.engines.diffusion.model import FlowMatchingGenerator, guided_velocity

__all__ = ["PROBE_NOISE_LEVEL", "DenoisingProbe", "denoising_probe", "probe_logprobs"]

# Flow-GRPO's noise level ``a``: any a > 0 makes each step a Gaussian whose mean is the policy's velocity.
PROBE_NOISE_LEVEL = 0.7


@dataclass(frozen=True, slots=True)
class DenoisingProbe:
    """A recorded denoising trajectory: ``latents [steps + 1, C, H, W]`` (float32, host) at ``sigmas``."""

    latents: torch.Tensor
    sigmas: tuple[float, ...]

    @property
    def steps(self) -> int:
        return len(self.sigmas) - 1


def denoising_probe(generator: FlowMatchingGenerator, steps: int = 4, seed: int = 0) -> DenoisingProbe:
    """The probe of ``generator``: ``steps`` steps of its scheduler's schedule along the straight
    path from noise to a random latent, the same on every call."""
    image, noise = torch.randn((2, *generator.latent_shape), generator=torch.Generator().manual_seed(seed))
    sigmas = generator.sigmas(steps)
    sigma = torch.tensor(sigmas).view(-1, *([1] * image.ndim))
    return DenoisingProbe((1 - sigma) * image + sigma * noise, tuple(sigmas))


@torch.no_grad()
def probe_logprobs(generator: FlowMatchingGenerator, probe: DenoisingProbe) -> list[float]:
    """Log-prob of each step of ``probe`` (``latents[i] -> latents[i + 1]``) under the generator's
    transformer as it is now, by Flow-GRPO's SDE transition at :data:`PROBE_NOISE_LEVEL`."""
    device = generator.device
    latents = probe.latents.to(device)
    sigmas = torch.tensor(probe.sigmas, device=device)
    uncond = generator.encode([""])
    rows = torch.zeros(probe.steps, dtype=torch.long, device=device)
    velocity = guided_velocity(
        generator.transformer, latents[:-1], sigmas[:-1], uncond.rows(rows), None, 1.0, generator.num_train_timesteps
    )
    mean, std = sde_transition(latents[:-1], velocity, sigmas[:-1], sigmas[1:], PROBE_NOISE_LEVEL)
    return transition_log_prob(latents[1:], mean, std).tolist()
