"""Reference sampler of the digits generator: prompts and noise seeds in, images out.

Owns the task's definition of "sampling at settings (steps, guidance scale)" that the
pretraining stop rule and the shipped-model tests measure: the saved
``FlowMatchEulerDiscreteScheduler``'s schedule and Euler (ODE) steps with classifier-free
guidance ``v = v_uncond + w·(v_cond - v_uncond)``, deterministic given the noise seeds. Each
image draws its starting noise from its own seed, so an image does not depend on what else is
in the batch. (The RL rollout's SDE sampler belongs to the engines and ``algorithms.flow_grpo``,
which tasks do not import.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from tandem.tasks.digits import IMAGE_SIZE, UNCONDITIONAL_INDEX
from tandem.tasks.digits.models import DigitGenerator

__all__ = [
    "predict_velocity",
    "sample_images",
]


def predict_velocity(
    generator: DigitGenerator,
    latents: torch.Tensor,
    timestep: torch.Tensor,
    prompt_indices: torch.Tensor,
    guidance_scale: float,
) -> torch.Tensor:
    """The (guided) velocity at ``timestep`` (``sigma · 1000``); with guidance, one forward over [unconditional; conditional]."""
    guided = guidance_scale != 1.0
    if guided:
        prompt_indices = torch.cat([torch.full_like(prompt_indices, UNCONDITIONAL_INDEX), prompt_indices])
        latents = torch.cat([latents, latents])
    tokens, pooled = generator.prompt_encoder(prompt_indices)
    velocity = generator.transformer(
        hidden_states=latents, encoder_hidden_states=tokens, pooled_projections=pooled, timestep=timestep.expand(latents.shape[0])
    ).sample
    if not guided:
        return velocity
    uncond, cond = velocity.chunk(2)
    return uncond + guidance_scale * (cond - uncond)


@torch.no_grad()
def sample_images(
    generator: DigitGenerator,
    digits: Sequence[int],
    seeds: Sequence[int],
    num_steps: int,
    guidance_scale: float,
) -> torch.Tensor:
    """Images ``[B, 1, 8, 8]`` (float32, unclipped) for ``digits[i]`` from noise seed ``seeds[i]``, by the Euler ODE."""
    if len(digits) != len(seeds):
        raise ValueError(f"one seed per digit: got {len(digits)} digits and {len(seeds)} seeds")
    latents = torch.stack(
        [torch.randn(1, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(seed)) for seed in seeds]
    )
    prompt_indices = torch.tensor(list(digits), dtype=torch.long)
    # A private copy: the scheduler's step counter is state, and the generator's stays untouched.
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(generator.scheduler.config)
    scheduler.set_timesteps(num_steps)
    for timestep in scheduler.timesteps:
        velocity = predict_velocity(generator, latents, timestep, prompt_indices, guidance_scale)
        latents = scheduler.step(velocity, timestep, latents).prev_sample
    return latents
