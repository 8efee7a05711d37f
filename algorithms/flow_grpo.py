"""Flow-GRPO: the denoising chain of a flow-matching model as a policy, in pure torch functions.

Source: Liu et al. 2025, "Flow-GRPO: Training Flow Matching Models via Online RL"
(arXiv:2505.05470); formulas checked against the authors' reference implementation
(``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py::sde_step_with_logprob`` and the loss in
``scripts/train_sd3.py``).

Conventions, those of diffusers' ``FlowMatchEulerDiscreteScheduler`` (rectified flow):
``x_t = (1 - t) x_0 + t ε`` with the time ``t`` called *sigma*; sigmas run from 1 (pure noise)
to 0 (data); the model predicts the velocity ``v = ε - x_0`` and is fed the timestep
``sigma * num_train_timesteps``. One denoising step goes from ``sigma`` to ``sigma_next <
sigma``, so ``dt = sigma_next - sigma`` is negative.

What the module owns:
- the deterministic Euler (ODE) step and the ODE-to-SDE step with noise level ``a``
  (paper eq. 9 with ``σ_t = a·sqrt(t / (1 - t))``) whose transition is the Gaussian
  ``N(mean, std²)``, ``std = σ_t·sqrt(-dt)``;
- the Gaussian log-prob of a transition and the closed-form KL between two such Gaussians;
- the per-step clipped GRPO objective, classifier-free guidance, the SDE window of
  Flow-GRPO-Fast and the sigma schedule (for "denoising reduction": fewer training steps).

Invariants: transition math runs in float32 whatever the input dtype (the reference does the
same, since bf16 overflows in the mean); per-step log-probs and KLs are *means* over the
non-batch dimensions, as in the reference, not sums (so their scale does not grow with image
size and one clip range fits every resolution); only the velocity (through the mean) carries
gradient into a log-prob, the recorded next sample is always data.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "SdeStep",
    "choose_sde_window",
    "classifier_free_guidance",
    "flow_grpo_loss",
    "flow_match_sigmas",
    "ode_step",
    "sde_step",
    "sde_step_mask",
    "sde_transition",
    "transition_kl",
    "transition_log_prob",
]

_HALF_LOG_TWO_PI = 0.5 * math.log(2.0 * math.pi)


@dataclass(frozen=True, slots=True)
class SdeStep:
    """One stochastic denoising step: the drawn sample and the Gaussian it was drawn from.

    ``mean`` has the sample's shape; ``std`` broadcasts against it (``[B, 1, ...]`` for
    per-sample sigmas, a 0-dim tensor for a shared one); ``log_prob`` is ``[B]``.
    """

    next_sample: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    log_prob: torch.Tensor


def _as_sigma(sigma: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``sigma`` as float32 on ``like``'s device, shaped to broadcast per sample: ``[B, 1, ...]`` or 0-dim."""
    sigma = torch.as_tensor(sigma, dtype=torch.float32, device=like.device)
    if sigma.ndim == 0:
        return sigma
    if sigma.ndim != 1 or sigma.shape[0] != like.shape[0]:
        raise ValueError(f"sigma must be a scalar or one value per sample ({like.shape[0]}), got shape {tuple(sigma.shape)}")
    return sigma.view(-1, *([1] * (like.ndim - 1)))


def _mean_over_sample_dims(x: torch.Tensor) -> torch.Tensor:
    """Mean over every dimension but the batch one: ``[B, ...] -> [B]``."""
    return x.mean(dim=tuple(range(1, x.ndim)))


def ode_step(
    sample: torch.Tensor,
    velocity: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
) -> torch.Tensor:
    """The deterministic Euler step ``x + v·(sigma_next - sigma)`` of the probability-flow ODE.

    Identical to ``FlowMatchEulerDiscreteScheduler.step``; Flow-GRPO-Fast (Liu et al. 2025)
    uses it outside the SDE window, and evaluation uses it everywhere. Computed in float32.
    """
    sample, velocity = sample.float(), velocity.float()
    dt = _as_sigma(sigma_next, sample) - _as_sigma(sigma, sample)
    return sample + velocity * dt


def sde_transition(
    sample: torch.Tensor,
    velocity: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    noise_level: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std of the Gaussian transition of Flow-GRPO's ODE-to-SDE step (Liu et al. 2025, eq. 9).

    With ``σ_t = a·sqrt(t / (1 - t))``, ``t = sigma`` and ``dt = sigma_next - sigma < 0``::

        mean = x·(1 + σ_t²/(2t)·dt) + v·(1 + σ_t²·(1 - t)/(2t))·dt
        std  = σ_t·sqrt(-dt)

    In continuous time the SDE has the ODE's marginals for every ``a``; ``a = 0`` gives the Euler step's mean and
    std 0. At ``t = 1`` the factor ``t / (1 - t)`` is infinite: like the reference (which uses
    the schedule's second sigma there), the denominator takes ``sigma_next`` instead.
    ``sigma`` and ``sigma_next`` are floats or one value per sample (a batch mixing steps).
    """
    sample, velocity = sample.float(), velocity.float()
    t = _as_sigma(sigma, sample)
    t_next = _as_sigma(sigma_next, sample)
    dt = t_next - t
    sigma_t = noise_level * torch.sqrt(t / (1.0 - torch.where(t == 1.0, t_next, t)))
    mean = sample * (1.0 + sigma_t**2 / (2.0 * t) * dt) + velocity * (1.0 + sigma_t**2 * (1.0 - t) / (2.0 * t)) * dt
    return mean, sigma_t * torch.sqrt(-dt)


def transition_log_prob(next_sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Log-density of ``next_sample`` under ``N(mean, std²)``, averaged over the non-batch dims: ``[B]``.

    Per element ``-(x - mean)²/(2 std²) - log std - log sqrt(2π)``, then the mean over the
    sample's dimensions (Liu et al. 2025's reference averages; a sum would be the joint
    density). ``next_sample`` is detached: it is the recorded action, so the gradient reaches
    the policy through ``mean`` only. The train side calls this with the rollout's recorded
    next sample and the mean recomputed under the current weights.
    """
    next_sample, mean, std = next_sample.detach().float(), mean.float(), std.float()
    elementwise = -((next_sample - mean) ** 2) / (2.0 * std**2) - torch.log(std) - _HALF_LOG_TWO_PI
    return _mean_over_sample_dims(elementwise.expand_as(mean))


def sde_step(
    sample: torch.Tensor,
    velocity: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    noise_level: float,
    noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> SdeStep:
    """Draw ``x_next = mean + std·ε`` from Flow-GRPO's SDE transition and score it (Liu et al. 2025).

    ``noise`` (standard normal, the sample's shape) makes the draw reproducible across
    engines; without it ``ε`` comes from ``generator``. The log-prob is
    :func:`transition_log_prob` of the draw: a mean over the non-batch dimensions, as in the
    reference's ``sde_step_with_logprob``.
    """
    if noise_level <= 0.0:
        raise ValueError(f"noise_level must be > 0 for a stochastic step (use ode_step for 0), got {noise_level}")
    mean, std = sde_transition(sample, velocity, sigma, sigma_next, noise_level)
    if noise is None:
        noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
    elif noise.shape != mean.shape:
        raise ValueError(f"noise must have the sample's shape {tuple(mean.shape)}, got {tuple(noise.shape)}")
    next_sample = mean + std * noise.float()
    return SdeStep(next_sample=next_sample, mean=mean, std=std, log_prob=transition_log_prob(next_sample, mean, std))


def transition_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL(N(mean, std²) || N(ref_mean, std²)) per step, averaged over the non-batch dims: ``[B]``.

    Both policies share the SDE's std (it depends on the schedule only), so the KL of the
    transition is the closed form ``||mean - ref_mean||² / (2 std²)`` (Liu et al. 2025,
    sec. 4.3); averaged over elements like :func:`transition_log_prob`, as the reference does.
    Gradient flows through ``mean``; the reference mean is data.
    """
    diff = mean.float() - ref_mean.detach().float()
    return _mean_over_sample_dims((diff**2 / (2.0 * std.float() ** 2)).expand_as(diff))


def flow_grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The per-step clipped GRPO objective of Flow-GRPO (Liu et al. 2025, eq. 8).

    Each (sample, step) pair is one action with ratio ``r = exp(logprobs - old_logprobs)``;
    ``loss = mean(max(-A·r, -A·clip(r, 1 - ε, 1 + ε)))`` over all pairs, as in the reference.
    ``advantages`` is one value per sample (``[B]``, shared by its steps) or the logprobs'
    shape. Only ``logprobs`` carries gradient. Metrics: ``clip_fraction`` is the share of pairs
    with ``|r - 1| > ε`` (the reference's ``clipfrac``), ``ratio_mean`` the mean ratio.
    """
    if clip_range <= 0.0:
        raise ValueError(f"clip_range must be > 0, got {clip_range}")
    advantages = advantages.detach().float()
    if advantages.ndim < logprobs.ndim:
        advantages = advantages.view(*advantages.shape, *([1] * (logprobs.ndim - advantages.ndim)))
    ratio = torch.exp(logprobs.float() - old_logprobs.detach().float())
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped).mean()
    ratio = ratio.detach()
    metrics = {
        "loss": loss.item(),
        "clip_fraction": ((ratio - 1.0).abs() > clip_range).float().mean().item(),
        "ratio_mean": ratio.mean().item(),
    }
    return loss, metrics


def classifier_free_guidance(velocity_uncond: torch.Tensor, velocity_cond: torch.Tensor, scale: float) -> torch.Tensor:
    """``v = v_uncond + w·(v_cond - v_uncond)`` (Ho & Salimans 2022), used by Flow-GRPO in sampling and training.

    ``w = 1`` is the conditional model alone; the policy whose log-probs Flow-GRPO trains is
    the guided one, so rollout and train must use the same ``w``.
    """
    return velocity_uncond + scale * (velocity_cond - velocity_uncond)


def choose_sde_window(
    num_steps: int,
    size: int,
    *,
    start: int | None = None,
    seed: int | None = None,
    latest_start: int | None = None,
) -> range:
    """The steps of Flow-GRPO-Fast's SDE window (Liu et al. 2025, sec. 5): SDE and trained inside, ODE outside.

    Give either a fixed ``start`` or a ``seed`` that draws the start uniformly from
    ``[0, latest_start]`` (default: every start that keeps the window inside the schedule);
    the reference's ``sde_window_range`` bounds it the same way, usually to early steps,
    where the noise matters most. The same seed gives the same window on every process.
    """
    if not 1 <= size <= num_steps:
        raise ValueError(f"window size must be in [1, num_steps={num_steps}], got {size}")
    if (start is None) == (seed is None):
        raise ValueError("give exactly one of start (a fixed window) or seed (a random one)")
    last = num_steps - size if latest_start is None else latest_start
    if not 0 <= last <= num_steps - size:
        raise ValueError(f"latest_start must be in [0, {num_steps - size}], got {latest_start}")
    if start is None:
        start = random.Random(seed).randint(0, last)
    elif not 0 <= start <= last:
        raise ValueError(f"start must be in [0, {last}], got {start}")
    return range(start, start + size)


def sde_step_mask(num_steps: int, window: range) -> list[bool]:
    """For each step index, True when the step is stochastic and trained (inside ``window``), False for ODE."""
    return [step in window for step in range(num_steps)]


def flow_match_sigmas(num_steps: int, shift: float = 1.0, num_train_timesteps: int = 1000) -> torch.Tensor:
    """The ``num_steps + 1`` sigmas (ending in 0) of ``FlowMatchEulerDiscreteScheduler.set_timesteps(num_steps)``.

    Reproduces diffusers' static-shift schedule (no dynamic shifting, no Karras/exponential/
    beta sigmas): ``num_steps`` points evenly spaced from 1 to the scheduler's ``sigma_min``
    (itself shifted at construction), each shifted by ``s·σ / (1 + (s - 1)·σ)``, then 0. The
    model's timestep is ``sigma · num_train_timesteps``. Evaluating with more steps than
    training is Flow-GRPO's "denoising reduction" (Liu et al. 2025, sec. 4.4).
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")

    def shifted(sigmas: np.ndarray) -> np.ndarray:
        return shift * sigmas / (1.0 + (shift - 1.0) * sigmas)

    # Mirrors diffusers' arithmetic so the sigmas agree to the bit: sigma_min is computed in
    # float32 at the scheduler's construction, the schedule in float64 over timestep units.
    sigma_min = shifted(np.float32(1.0) / np.float32(num_train_timesteps))
    timesteps = np.linspace(num_train_timesteps, float(sigma_min) * num_train_timesteps, num_steps)
    sigmas = shifted(timesteps / num_train_timesteps).astype(np.float32)
    return torch.cat([torch.from_numpy(sigmas), torch.zeros(1)])
