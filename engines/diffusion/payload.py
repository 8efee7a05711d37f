"""What an image trajectory carries for its engines: the denoising chain, step by step.

An image trajectory is one run of the sampler: each denoising step is an action, so the
trajectory's ``behaviour_logprobs``, ``versions`` and ``loss_mask`` have one entry per step.
:class:`ImagePayload` holds what the train engine needs to score each step again under other
weights (the latents before and after it, the schedule, the transition's noise level and
guidance scale) and what rewards read (the decoded image).

Invariants kept by the rollout engine that writes it:
- ``latents`` has ``num_steps + 1`` entries: ``latents[0]`` is the starting noise and
  ``latents[i + 1]`` the sample step ``i`` drew from ``latents[i]``; ``sigmas`` likewise, so
  step ``i`` goes from ``sigmas[i]`` to ``sigmas[i + 1]``;
- ``sde[i]`` is True when step ``i`` was stochastic (Flow-GRPO's SDE step, scored and trained)
  and False for a deterministic Euler (ODE) step, whose recorded log-prob is 0.0 and which is
  never trained (the trajectory's ``loss_mask`` is ``sde`` as 0/1);
- arrays are float32 on the host, whatever device and dtype the engines compute in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tandem.core.records import Trajectory

__all__ = ["ImagePayload", "image_payload"]


@dataclass(slots=True)
class ImagePayload:
    """One denoising run: its prompt, its chain of latents and the image it ended in."""

    prompt: str
    latents: np.ndarray  # [num_steps + 1, C, H, W] float32
    sigmas: list[float]  # num_steps + 1 values, from 1 (noise) down to 0 (data)
    sde: list[bool]  # per step: stochastic (scored, trained) or ODE
    noise_level: float  # Flow-GRPO's a in sigma_t = a * sqrt(t / (1 - t))
    guidance_scale: float  # classifier-free guidance w of the sampled (and trained) policy
    image: np.ndarray  # the decoded image [C, H, W] float32 (the VAE's range, or the final latents without a VAE)

    @property
    def num_steps(self) -> int:
        return len(self.sde)


def image_payload(trajectory: Trajectory) -> ImagePayload:
    """The trajectory's denoising chain; an error names it if it is not an image trajectory."""
    payload = trajectory.payload
    if not isinstance(payload, ImagePayload):
        raise TypeError(
            f"prompt {trajectory.prompt_id} trajectory {trajectory.index}: the diffusion engines train image "
            f"trajectories, got a {type(payload).__name__} payload"
        )
    return payload
