"""A one-replica trainer's checkpoint: one format for the plain torch trainer, its DDP ranks and the
image trainer, so a run resumes across them (one process or any number of DDP ranks).

The file holds the model's (or, for a LoRA adapter, the adapter's) and the optimizer's state
dicts, the LR schedule, the version (the optimizer steps taken) and torch's CPU RNG state. It is
read onto the CPU first (the RNG state must stay there); ``load_state_dict`` then copies weights
and moments to the model's device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["TRAINER_STATE_FILE", "load_trainer_state", "restore_trainer_state", "save_trainer_state"]

TRAINER_STATE_FILE = "trainer.pt"  # what a trainer's save_state writes into a checkpoint folder


def save_trainer_state(
    path: Path, model_state: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer, scheduler: Any, version: int
) -> None:
    """Write ``model_state`` (the model's ``state_dict``, or what of it trains: a LoRA adapter's
    tensors) with the optimizer, schedule, version and RNG to ``path``."""
    state = {
        "model": dict(model_state),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "version": version,
        "rng": torch.get_rng_state(),
    }
    torch.save(state, path)


def load_trainer_state(path: Path) -> dict[str, Any]:
    """What :func:`save_trainer_state` wrote, on the CPU."""
    return torch.load(path, map_location="cpu", weights_only=True)


def restore_trainer_state(
    state: dict[str, Any], load_model: Callable[[dict[str, torch.Tensor]], object], optimizer: torch.optim.Optimizer,
    scheduler: Any,
) -> int:  # fmt: skip
    """Load ``state`` into the model (``load_model``: its ``load_state_dict``, or a LoRA adapter's
    load), optimizer and schedule and torch's RNG; returns its version."""
    load_model(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    return int(state["version"])
