"""A flow-matching image generator loaded from a local folder, and the guided velocity it predicts.

What it owns: reading a model folder in diffusers' pipeline layout (``model_index.json``
naming each component as ``[library, class]``, one sub-folder per component) into a
:class:`FlowMatchingGenerator`, and the one function both diffusion engines call to get the
policy's velocity, so rollout and training compute it the same way:

- ``transformer`` (required): a diffusers transformer with SD3's call signature
  (``hidden_states``, ``encoder_hidden_states``, ``pooled_projections``, ``timestep``)
  predicting the rectified-flow velocity ``ε - x_0`` from the timestep ``sigma ·
  num_train_timesteps``: ``SD3Transformer2DModel`` (the SD3 / SD3.5 family) and the digits
  task's tiny one;
- ``scheduler`` (required): a ``FlowMatchEulerDiscreteScheduler`` with a static shift; only
  its sigma schedule is used (the steps are ``algorithms.flow_grpo``'s);
- ``prompt_encoder`` (required): any class with ``from_pretrained(folder)`` and
  ``encode(prompts) -> (encoder_hidden_states [B, L, D], pooled_projections [B, P])`` where
  the empty prompt ``""`` is the unconditional one of classifier-free guidance; its library is
  a module path, imported by name (the digits task ships ``tasks.digits.models``). SD3's own
  three text encoders are not wrapped yet: such a folder needs this entry added;
- ``vae`` (optional): an ``AutoencoderKL`` decoding final latents into the image
  (``latents / scaling_factor + shift_factor``, as SD3's pipeline does); without one the final
  latents are the image.

Latents are ``[in_channels, sample_size, sample_size]`` from the transformer's config. Only
the transformer is ever trained; the other components are frozen.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from tandem.algorithms.flow_grpo import classifier_free_guidance

__all__ = [
    "MODEL_INDEX",
    "Conditioning",
    "FlowMatchingGenerator",
    "PromptEncoder",
    "component_class",
    "guided_velocity",
    "load_component",
    "load_generator",
    "read_model_index",
]

MODEL_INDEX = "model_index.json"
_REQUIRED = ("transformer", "scheduler", "prompt_encoder")


@runtime_checkable
class PromptEncoder(Protocol):
    """Text to the transformer's conditioning; ``""`` encodes the unconditional prompt."""

    def encode(self, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(slots=True)
class Conditioning:
    """Per-row conditioning: ``hidden [B, L, D]`` (encoder hidden states) and ``pooled [B, P]``."""

    hidden: torch.Tensor
    pooled: torch.Tensor

    @staticmethod
    def cat(parts: Sequence[Conditioning]) -> Conditioning:
        return Conditioning(torch.cat([p.hidden for p in parts]), torch.cat([p.pooled for p in parts]))

    def rows(self, index: torch.Tensor) -> Conditioning:
        return Conditioning(self.hidden.index_select(0, index), self.pooled.index_select(0, index))


@dataclass(slots=True)
class FlowMatchingGenerator:
    """The loaded components, on one device; the transformer in the compute dtype, the rest frozen."""

    transformer: nn.Module
    scheduler: FlowMatchEulerDiscreteScheduler
    prompt_encoder: nn.Module
    vae: nn.Module | None
    device: torch.device

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        config = self.transformer.config
        return (config.in_channels, config.sample_size, config.sample_size)

    @property
    def num_train_timesteps(self) -> int:
        return int(self.scheduler.config.num_train_timesteps)

    def sigmas(self, num_steps: int) -> list[float]:
        """The ``num_steps + 1`` sigmas of the scheduler's schedule, ending in 0."""
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler.config)  # set_timesteps mutates
        scheduler.set_timesteps(num_steps)
        return [float(s) for s in scheduler.sigmas]

    @torch.no_grad()
    def encode(self, prompts: Sequence[str]) -> Conditioning:
        hidden, pooled = self.prompt_encoder.encode(list(prompts))  # type: ignore[operator]
        dtype = next(self.transformer.parameters()).dtype
        return Conditioning(hidden.to(self.device, dtype), pooled.to(self.device, dtype))

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Final latents ``[B, C, H, W]`` to images (float32 numpy), through the VAE when there is one."""
        if self.vae is not None:
            config = self.vae.config
            scaled = latents.to(self.vae.dtype) / config.scaling_factor + (config.shift_factor or 0.0)
            latents = self.vae.decode(scaled).sample
        return latents.float().cpu().numpy()


def read_model_index(folder: Path) -> dict[str, tuple[str, str]]:
    """Component name -> (library, class) from the folder's ``model_index.json``."""
    path = folder / MODEL_INDEX
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no {MODEL_INDEX} (a diffusers pipeline folder names its components there)")
    raw = json.loads(path.read_text())
    index = {name: (entry[0], entry[1]) for name, entry in raw.items() if not name.startswith("_") and entry}
    missing = [name for name in _REQUIRED if name not in index]
    if missing:
        raise ValueError(f"{path}: missing components {missing}; the diffusion engines need {list(_REQUIRED)}")
    return index


def component_class(library: str, class_name: str) -> Any:
    """The class a ``model_index.json`` entry ``[library, class_name]`` names."""
    return getattr(importlib.import_module(library), class_name)


def load_component(folder: Path, name: str, library: str, class_name: str, dtype: torch.dtype | None = None) -> Any:
    """``library.class_name.from_pretrained(folder / name)``; diffusers models in ``dtype``."""
    cls = component_class(library, class_name)
    if isinstance(cls, type) and issubclass(cls, ModelMixin):
        # low_cpu_mem_usage=False: the default wants `accelerate`, pointless for the small models loaded here.
        return cls.from_pretrained(folder / name, torch_dtype=dtype, low_cpu_mem_usage=False)
    return cls.from_pretrained(folder / name)


def load_generator(
    folder: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, with_vae: bool = True
) -> FlowMatchingGenerator:
    """The generator in ``folder``, in eval mode with frozen weights (an engine unfreezes what it trains).

    ``with_vae=False`` skips the VAE even if the folder has one (the train engine never decodes).
    """
    folder = Path(folder)
    index = read_model_index(folder)
    device = torch.device(device)
    scheduler = load_component(folder, "scheduler", *index["scheduler"])
    if not isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        raise TypeError(f"{folder}: the scheduler must be a FlowMatchEulerDiscreteScheduler, got {type(scheduler).__name__}")
    if scheduler.config.use_dynamic_shifting:
        raise ValueError(f"{folder}: dynamic shifting (Flux's resolution-dependent schedule) is not supported")

    def model(name: str, model_dtype: torch.dtype | None) -> nn.Module:
        module = load_component(folder, name, *index[name], dtype=model_dtype)
        return module.to(device).eval().requires_grad_(False)

    prompt_encoder = model("prompt_encoder", None)
    if not isinstance(prompt_encoder, PromptEncoder):
        raise TypeError(f"{folder}: the prompt encoder {type(prompt_encoder).__name__} has no encode(prompts)")
    vae = model("vae", dtype) if with_vae and "vae" in index else None
    return FlowMatchingGenerator(model("transformer", dtype), scheduler, prompt_encoder, vae, device)


def guided_velocity(
    transformer: nn.Module,
    latents: torch.Tensor,
    sigmas: torch.Tensor,
    cond: Conditioning,
    uncond: Conditioning | None,
    guidance_scale: float,
    num_train_timesteps: int,
) -> torch.Tensor:
    """The policy's velocity for rows ``latents [B, C, H, W]`` at per-row ``sigmas [B]``, float32.

    With guidance (``guidance_scale != 1``) one forward over ``[unconditional; conditional]``
    and ``v = v_u + w·(v_c - v_u)`` (``algorithms.flow_grpo.classifier_free_guidance``), as
    Flow-GRPO samples and trains; ``uncond`` is then the unconditional conditioning, one row
    or one per row. Gradient flows when enabled by the caller.
    """
    dtype = next(transformer.parameters()).dtype
    rows = latents.shape[0]
    x = latents.to(dtype)
    timestep = (sigmas.float() * num_train_timesteps).to(latents.device)
    guided = guidance_scale != 1.0
    if guided:
        if uncond is None:
            raise ValueError("classifier-free guidance needs the unconditional conditioning")
        if uncond.hidden.shape[0] == 1:
            uncond = Conditioning(uncond.hidden.expand(rows, -1, -1), uncond.pooled.expand(rows, -1))
        cond = Conditioning.cat([uncond, cond])
        x = torch.cat([x, x])
        timestep = torch.cat([timestep, timestep])
    velocity = transformer(
        hidden_states=x, encoder_hidden_states=cond.hidden, pooled_projections=cond.pooled, timestep=timestep
    ).sample.float()
    if not guided:
        return velocity
    v_uncond, v_cond = velocity.chunk(2)
    return classifier_free_guidance(v_uncond, v_cond, guidance_scale)
