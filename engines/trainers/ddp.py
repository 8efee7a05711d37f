"""Plain torch data parallelism: one replica of the model per rank of a trainer group, gradients
summed over the group before each optimizer step.

What it owns: :class:`DDPRank`, the ``engines.trainers.group`` rank engine of ``engines.train:
torch`` with ``train_world_size > 1`` (the group spawns the ranks, shares the step, checks the
replies and names a failed rank, as for FSDP2 and megatron-core), and the two collectives that
keep replicas equal, which the megatron ranks use too: :func:`all_reduce_gradients` and
:func:`broadcast_parameters`.

Invariants:
- every rank holds the same weights and optimizer state: parameters are broadcast from rank 0 at
  start (as torch DDP does) and after every restore, and every step applies the same summed
  gradient (the group checks the ranks' gradient norms agree);
- a checkpoint is the one-process trainer's (``TorchTrainEngine``: ``trainer.pt``, the same
  keys), written by rank 0, so a run moves between one process and any number of ranks;
- with a LoRA adapter (``RankSpec.lora``) only the adapter trains and is reduced; what syncs and
  fills the checkpoints is the one-process trainer's (``engines.shared.lora.TrainedWeights``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from tandem.core.protocols import LossObjective
from tandem.core.records import Trajectory
from tandem.engines.shared.lora import TrainedWeights, adapter_dropout, with_adapter
from tandem.engines.shared.microbatch import MicroBatch, response_logprobs
from tandem.engines.shared.probe import probe_logprobs
from tandem.engines.trainers.group import RankSpec, join_rank_group, rank_optimizer
from tandem.engines.trainers.loss_loop import StepTotals, accumulate, score
from tandem.engines.trainers.state import TRAINER_STATE_FILE, load_trainer_state, restore_trainer_state, save_trainer_state

__all__ = ["DDPRank", "all_reduce_gradients", "broadcast_parameters"]



class DDPRank:
    """One data-parallel torch rank (a ``engines.trainers.group.RankEngine``; an ``AdapterRank``
    too): the model, AdamW with ``TorchTrainEngine``'s schedule, and the gradient all-reduce."""

    state_file = TRAINER_STATE_FILE

    def __init__(self, spec: RankSpec, *, rank: int, world_size: int, init_method: str, device: torch.device) -> None:
        join_rank_group(rank=rank, world_size=world_size, init_method=init_method, device=device)
        self._spec = spec
        self._rank = rank
        self._device = device
        self._group = dist.distributed_c10d._get_default_group()
        self.version = 0
        model = AutoModelForCausalLM.from_pretrained(spec.model_path, dtype=spec.torch_dtype)
        if spec.lora is not None:
            model = with_adapter(model, spec.lora, seed=spec.seed)
        self._model = model.to(device).eval()
        self._weights = TrainedWeights(self._model, adapted=spec.lora is not None)
        broadcast_parameters(self._model, self._group)
        self._optimizer, self._scheduler = rank_optimizer(spec, self._model)

    @property
    def optimizer_steps(self) -> int:
        return self._scheduler.last_epoch  # one schedule step per optimizer step, checkpointed with it

    def _forward(self, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return response_logprobs(self._model, batch, self._spec.temperature)

    def score(self, samples: list[Trajectory], passes: int) -> tuple[list[list[float]], list[list[float]]]:
        # No collective in a forward: no filler passes needed.
        return score(samples, self._forward, max_tokens=self._spec.max_tokens_per_micro_batch, device=self._device)

    def score_base(self, samples: list[Trajectory], passes: int) -> tuple[list[list[float]], list[list[float]]]:
        with self._model.disable_adapter():  # type: ignore[operator]
            return self.score(samples, passes)

    def probe(self, token_ids: list[int]) -> list[float]:
        return probe_logprobs(self._model, token_ids)

    def accumulate(
        self, samples: list[Trajectory], objective: LossObjective, totals: StepTotals, passes: int, progress: float
    ) -> tuple[dict[str, float], int]:
        with adapter_dropout(self._model):  # a no-op without an adapter or its dropout
            return accumulate(
                samples, self._forward, objective, totals,
                max_tokens=self._spec.max_tokens_per_micro_batch, device=self._device, version=self.version,
                progress=progress,
            )  # fmt: skip

    def step(self) -> float:
        all_reduce_gradients(self._model, self._group)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self._model.parameters(), self._spec.max_grad_norm))
        if not math.isfinite(grad_norm):  # the same summed gradient on every rank: all raise
            self.drop_gradients()
            raise FloatingPointError(f"non-finite gradient norm {grad_norm} at version {self.version}")
        self._optimizer.step()
        self._scheduler.step()
        self.drop_gradients()
        return grad_norm

    def drop_gradients(self) -> None:
        self._optimizer.zero_grad(set_to_none=True)

    def gather(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._rank == 0:  # every replica holds the whole model: rank 0's is enough
            yield from self._weights.synced().items()

    def save(self, path: Path) -> None:
        if self._rank == 0:
            save_trainer_state(path, self._weights.state(), self._optimizer, self._scheduler, self.version)

    def load(self, path: Path) -> None:
        self.version = restore_trainer_state(
            load_trainer_state(path), self._weights.load, self._optimizer, self._scheduler
        )

    def close(self) -> None:
        dist.destroy_process_group()


def all_reduce_gradients(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Sum every rank's gradients into every rank, in one collective over a flat buffer.

    One buffer, not one collective per tensor: gloo pays a round trip per operation. It sums in
    the widest of float32 and the parameters' dtypes (half-precision sums would lose the small
    gradients). A rank with no samples has no gradients; a trailing slot per parameter counts
    the ranks that had one, so a parameter no rank touched keeps ``grad = None`` (and AdamW
    skips it) as in one process.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    total = sum(p.numel() for p in params)
    dtype = functools.reduce(torch.promote_types, (p.dtype for p in params), torch.float32)
    flat = torch.zeros(total + len(params), dtype=dtype, device=params[0].device)
    offset = 0
    for k, p in enumerate(params):
        if p.grad is not None:
            flat[offset : offset + p.numel()].copy_(p.grad.reshape(-1))
            flat[total + k] = 1.0
        offset += p.numel()
    group.allreduce([flat]).wait()
    present = flat[total:].tolist()
    offset = 0
    for k, p in enumerate(params):
        if present[k] == 0.0:
            p.grad = None
        else:
            if p.grad is None:
                p.grad = torch.empty_like(p)
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


def broadcast_parameters(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Overwrite every rank's parameters with rank 0's, in one collective (exact: the buffer's
    dtype is the widest of float32 and the parameters')."""
    params = list(model.parameters())
    dtype = functools.reduce(torch.promote_types, (p.dtype for p in params), torch.float32)
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1).to(dtype) for p in params])
        options = dist.BroadcastOptions()
        options.rootRank = 0
        group.broadcast([flat], options).wait()
        offset = 0
        for p in params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
