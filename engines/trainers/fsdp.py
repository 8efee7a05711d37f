"""A torch FSDP2 train rank: any transformers causal LM, its weights, gradients and AdamW state sharded over a trainer group.

What it owns: one rank of an ``engines.trainers.group`` group (``engines.data_parallel: fsdp2``):
``torch.distributed``'s default process group over the group's ranks (gloo on CPU, NCCL on
GPU), a transformers causal LM whose decoder layers (the classes the model lists in
``_no_split_modules``) and root are ``fully_shard``-ed over a 1-D mesh of every rank, and
AdamW with the linear warm-up of ``TorchTrainEngine``. Each rank holds ``1/N`` of every
weight, gradient and moment; a forward or backward all-gathers one layer at a time.

Invariants:
- every rank runs equally many forward and backward passes per call (the all-gathers are
  collectives): a rank with fewer micro-batches than the call's ``passes`` fills up with
  zero-weighted passes over a one-token row, which add nothing to any gradient;
- gradients are summed over ranks, not averaged: FSDP2's division by the world size is off,
  and the reductions are plain sums (gloo has no ``PREMUL_SUM``); the micro-batch weights
  already make the sum the whole step's gradient. Each pass reduce-scatters its gradient into
  the sharded accumulators, so no rank ever holds a whole model's gradient;
- the model stays in ``eval()`` mode, as ``TorchTrainEngine``'s: no dropout in recomputed log-probs;
- checkpoints hold full (unsharded) model and optimizer state dicts keyed by parameter name,
  written by rank 0 and loadable by a group of any size;
- with a LoRA adapter (``RankSpec.lora``) peft wraps the model before it is sharded: frozen base
  and trained adapter share each layer's shards, only the adapter's get gradients and optimizer
  state; gathers, checkpoints and exports carry the adapter's tensors alone (peft's saved names),
  gathered tensor by tensor, so the base never moves whole.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard
from transformers import AutoModelForCausalLM

from tandem.core.protocols import LossObjective
from tandem.core.records import Trajectory
from tandem.engines.shared.lora import adapter_dropout, adapter_tensors, load_adapter, with_adapter
from tandem.engines.shared.microbatch import MicroBatch, response_logprobs
from tandem.engines.shared.probe import probe_logprobs
from tandem.engines.trainers.group import RankSpec, join_rank_group, rank_optimizer
from tandem.engines.trainers.loss_loop import StepTotals, accumulate, score
from tandem.param_sync import unique_weights

__all__ = ["FSDPRank", "shard_model"]



def shard_model(model: torch.nn.Module, mesh: torch.distributed.device_mesh.DeviceMesh) -> int:
    """``fully_shard`` each decoder layer (the classes in ``model._no_split_modules``), then the root
    (embeddings, final norm, head); returns the number of layers sharded on their own. Gradients are
    then summed over the mesh, not averaged."""
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return len(layers)


class FSDPRank:
    """One FSDP2 rank (a ``engines.trainers.group.RankEngine``; an ``AdapterRank`` too)."""

    state_file = "trainer_fsdp2.pt"

    def __init__(self, spec: RankSpec, *, rank: int, world_size: int, init_method: str, device: torch.device) -> None:
        join_rank_group(rank=rank, world_size=world_size, init_method=init_method, device=device)
        self._spec = spec
        self._rank = rank
        self._device = device
        self.version = 0
        model = AutoModelForCausalLM.from_pretrained(spec.model_path, dtype=spec.torch_dtype)
        if spec.lora is not None:
            model = with_adapter(model, spec.lora, seed=spec.seed)
        self._model = model.to(device).eval()
        shard_model(self._model, init_device_mesh(device.type, (world_size,)))
        self._optimizer, self._scheduler = rank_optimizer(spec, self._model)

    @property
    def optimizer_steps(self) -> int:
        return self._scheduler.last_epoch  # one schedule step per optimizer step, checkpointed with it

    def _forward(self, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return response_logprobs(self._model, batch, self._spec.temperature)

    def score(self, samples: list[Trajectory], passes: int) -> tuple[list[list[float]], list[list[float]]]:
        scored = score(
            samples, self._forward, max_tokens=self._spec.max_tokens_per_micro_batch, device=self._device, passes=passes
        )
        # The root keeps its weights unsharded after a forward (a backward usually follows): with
        # no backward here, shard them again, or state dicts would see plain tensors there.
        self._model.reshard()  # type: ignore[operator]
        return scored

    def score_base(self, samples: list[Trajectory], passes: int) -> tuple[list[list[float]], list[list[float]]]:
        with self._model.disable_adapter():  # type: ignore[operator]
            return self.score(samples, passes)

    def probe(self, token_ids: list[int]) -> list[float]:
        logprobs = probe_logprobs(self._model, token_ids)
        self._model.reshard()  # type: ignore[operator]  # as after score's forwards
        return logprobs

    def accumulate(
        self, samples: list[Trajectory], objective: LossObjective, totals: StepTotals, passes: int, progress: float
    ) -> tuple[dict[str, float], int]:
        with adapter_dropout(self._model):  # a no-op without an adapter or its dropout
            return accumulate(
                samples, self._forward, objective, totals,
                max_tokens=self._spec.max_tokens_per_micro_batch, device=self._device, version=self.version,
                progress=progress, passes=passes,
            )  # fmt: skip

    def step(self) -> float:
        # The gradients were reduce-scattered in each backward: the norm is all-reduced from the shards.
        norm = torch.nn.utils.clip_grad_norm_(self._model.parameters(), self._spec.max_grad_norm)
        grad_norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        if not math.isfinite(grad_norm):
            self.drop_gradients()
            raise FloatingPointError(f"non-finite gradient norm {grad_norm} at version {self.version}")
        self._optimizer.step()
        self._scheduler.step()
        self.drop_gradients()
        return grad_norm

    def drop_gradients(self) -> None:
        self._optimizer.zero_grad(set_to_none=True)

    def gather(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._spec.lora is not None:
            yield from self._adapter().items()
            return
        # One all-gather per sharded module (a layer, the root), not one per tensor: gloo pays a
        # round trip per collective. Each module is sharded again before the next is gathered.
        # Parameter names are the model's own (a tied weight once, under its first name).
        modules = [(prefix, m) for prefix, m in self._model.named_modules() if isinstance(m, FSDPModule)]
        for prefix, module in modules:
            nested = tuple(f"{other}." for other, _ in modules if other.startswith(prefix) and other != prefix)
            own = [name for name, _ in module.named_parameters(prefix=prefix) if not name.startswith(nested)]
            module.unshard()
            try:
                unsharded = dict(module.named_parameters(prefix=prefix))
                for name in own:
                    yield name, unsharded[name].detach()
            finally:
                module.reshard()
        params = {name for name, _ in self._model.named_parameters(remove_duplicate=False)}
        for name, tensor in unique_weights(self._model).items():  # persistent buffers: FSDP2 leaves them whole
            if name not in params:
                yield name, tensor

    def save(self, path: Path) -> None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered on rank 0 only
        if self._spec.lora is not None:
            model = {name: t.cpu() for name, t in self._adapter().items()}
        else:
            model = get_model_state_dict(self._model, options=options)
        # Before the first step there is nothing to save, and torch's getter would first take a
        # zero step (Adam's count 1) to create the state: the next real step would be off.
        optimizer = get_optimizer_state_dict(self._model, self._optimizer, options=options) if self._optimizer.state else None
        if self._rank == 0:
            state = {
                "model": model,
                "optimizer": optimizer,
                "scheduler": self._scheduler.state_dict(),
                "version": self.version,
                "rng": torch.get_rng_state(),
            }
            torch.save(state, path)

    def load(self, path: Path) -> None:
        # Every rank reads the full state and keeps its own shard of it.
        state = torch.load(path, map_location="cpu", weights_only=True)
        options = StateDictOptions(full_state_dict=True)
        if self._spec.lora is not None:
            load_adapter(self._model, state["model"])  # refuses a whole model's or another adapter's
        else:
            set_model_state_dict(self._model, state["model"], options=options)
        if state["optimizer"] is not None:
            set_optimizer_state_dict(self._model, self._optimizer, state["optimizer"], options=options)
        else:  # saved before the first step
            self._optimizer.state.clear()
        self._scheduler.load_state_dict(state["scheduler"])
        self.version = state["version"]
        torch.set_rng_state(state["rng"])

    def _adapter(self) -> dict[str, torch.Tensor]:
        """The adapter's whole tensors under peft's saved names, on every rank, from one all-gather of
        the adapter's shards alone (gathering the layers would move the base too).

        Why not ``full_tensor()`` per tensor: gloo pays a round trip per collective, and an adapter
        has two tensors per adapted layer (the shipped model's 56 over 2 ranks: a staged gather took
        68 ms so, 16 ms this way, as long as the whole model's by layers). FSDP2 shards each tensor on
        dim 0 as ``torch.chunk`` does (``ceil(rows / N)`` rows per rank, the last ones shorter):
        each shard travels as bytes, padded to that size, so mixed dtypes share the one buffer unchanged.
        """
        world = dist.get_world_size()
        adapter = adapter_tensors(self._model)
        layout, pieces = [], []
        for name, tensor in adapter.items():
            assert isinstance(tensor, DTensor) and tensor.placements == (Shard(0),), name
            local = tensor.to_local().detach()
            rows = -(-tensor.shape[0] // world)
            padded = local.new_zeros((rows, *tensor.shape[1:]))
            padded[: local.shape[0]] = local
            pieces.append(padded.reshape(-1).view(torch.uint8))
            layout.append((name, tensor, rows, pieces[-1].numel()))
        flat = torch.cat(pieces)
        shards = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(shards, flat)
        whole, offset = {}, 0
        for name, tensor, rows, nbytes in layout:
            parts = [shard[offset : offset + nbytes].view(tensor.dtype).view(rows, *tensor.shape[1:]) for shard in shards]
            whole[name] = torch.cat(parts)[: tensor.shape[0]]
            offset += nbytes
        return whole

    def close(self) -> None:
        dist.destroy_process_group()
