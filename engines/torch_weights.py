"""Which tensors make up a model's weights for syncing: one rule shared by trainer and rollout engines.

The weights are the module's ``state_dict`` (parameters and persistent buffers) with each
storage once: a tied weight (e.g. embeddings shared with the LM head) travels under its first
name and, loaded there, is seen through every alias. ``param_sync.module`` uses the same rule.
"""

from __future__ import annotations

import torch

__all__ = ["unique_weights"]


def unique_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The live weight tensors by name, each tied storage once (first name wins), detached."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out[name] = tensor.detach()
    return out
