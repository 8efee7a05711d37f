"""The optimizer steps of one train step: what every trainer's loop over its mini-batches shares.

A train step is one version, however many optimizer steps it takes: the train role's plan
(``algorithms.mini_batches``: M mini-batches of whole groups, for E epochs) says which of the
step's trajectories each optimizer step trains. Every trainer (plain torch, the trainer groups of
DDP, FSDP2 and megatron-core ranks, the image trainer, the critic) runs its steps through
:func:`take_optimizer_steps`, over the parts :func:`step_parts` makes of the plan; each
optimizer step itself is the trainer's own (the one micro-batch loss loop,
``engines.trainers.loss_loop``, then clipping, the optimizer and the LR schedule), the same for
the trainers holding their whole model in this process (:class:`InProcessSteps`).

Invariants:
- without a plan a train step is one optimizer step over all its trajectories, as it was before
  mini-batches; with the plan of one mini-batch and one epoch, the very same step;
- each optimizer step is a train step of its own to the loss: its loss is aggregated over its
  own trained tokens or sequences, its gradient clipped on its own, and the LR schedule moves
  once per optimizer step;
- a mini-batch without trained tokens takes no optimizer step (nothing to learn from, and a
  mean over no tokens is undefined); a plan without any trained token raises before any step;
- each optimizer step is told its ``progress``, the share of the train step's optimizer steps
  taken before it (0 at the first): its weights stand at the step's version plus that, in
  version time (``LossInputs.current_version``);
- a failure at the first optimizer step propagates as it is (the weights are untouched); one
  after it raises :class:`~tandem.core.protocols.PartialTrainStep` from it (they are not);
- in one process, the weights lock is held from a train step's first optimizer step until its
  version is published: a reader never sees weights between two of its optimizer steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass

import torch

from tandem.algorithms.metrics import combine_optimizer_steps
from tandem.core.protocols import PartialTrainStep
from tandem.core.records import Trajectory

__all__ = ["Accumulate", "InProcessSteps", "OptimizerStep", "step_parts", "take_optimizer_steps"]

# One optimizer step of a trainer: (the indices it trains, its progress) -> its metrics.
OptimizerStep = Callable[[list[int], float], dict[str, float]]
# A trainer adding one optimizer step's gradient: (the indices, its progress) -> (weighted metric
# sums, micro-batches), as ``loss_loop.accumulate``.
Accumulate = Callable[[list[int], float], tuple[dict[str, float], int]]


def step_parts(samples: Sequence[Trajectory], mini_batches: Sequence[Sequence[int]] | None) -> list[list[int]]:
    """The indices of the trajectories with trained actions that each optimizer step of the plan
    trains (the whole batch as one step without a plan); a mini-batch without any is left out.
    Raises ``ValueError`` on an index outside ``samples``, or when nothing is trained at all."""
    plan = [range(len(samples))] if mini_batches is None else mini_batches
    parts: list[list[int]] = []
    for mini_batch in plan:
        outside = [i for i in mini_batch if not 0 <= i < len(samples)]
        if outside:
            raise ValueError(f"mini-batch indices {outside} outside the step's {len(samples)} trajectories")
        trained = [i for i in mini_batch if samples[i].num_trained > 0]
        if trained:
            parts.append(trained)
    if not parts:
        raise ValueError("train_step on trajectories without trained actions")
    return parts


def take_optimizer_steps(parts: Sequence[list[int]], step: OptimizerStep, *, version: int) -> dict[str, float]:
    """Take ``step`` on each part in order; returns the train step's metrics: its optimizer
    steps' combined (``algorithms.metrics.combine_optimizer_steps``) plus ``optimizer_steps``."""
    metrics: list[dict[str, float]] = []
    for taken, part in enumerate(parts):
        try:
            metrics.append(step(part, taken / len(parts)))
        except Exception as exc:
            if taken == 0:
                raise
            raise PartialTrainStep(version, taken, len(parts)) from exc
    return {**combine_optimizer_steps(metrics), "optimizer_steps": float(len(parts))}


@dataclass(frozen=True, slots=True)
class InProcessSteps:
    """The optimizer steps of a trainer holding its whole model in this process (the plain torch
    trainer, the image trainer): per step, zero the gradient, accumulate, clip, step the optimizer
    and the LR schedule; the trainer's weights lock is held from the first step on (module docstring)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    max_grad_norm: float

    def train(
        self,
        parts: Sequence[list[int]],
        accumulate: Accumulate,
        *,
        weights_lock: AbstractContextManager[object],
        version: int,
        publish: Callable[[], None],
    ) -> dict[str, float]:
        """Take an optimizer step per part, then ``publish`` the new version (still holding
        ``weights_lock``); returns the train step's metrics, with its ``micro_batches`` and
        ``optimizer_steps_total``."""
        micro_batches = 0
        with ExitStack() as moving:

            def optimizer_step(part: list[int], progress: float) -> dict[str, float]:
                nonlocal micro_batches
                lr = self.scheduler.get_last_lr()[0]  # this step's own: the scheduler moves on after it
                self.optimizer.zero_grad(set_to_none=True)
                sums, count = accumulate(part, progress)
                micro_batches += count
                grad_norm = self._clip(version)
                if progress == 0:
                    moving.enter_context(weights_lock)
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                return {**sums, "grad_norm": grad_norm, "lr": lr}

            metrics = take_optimizer_steps(parts, optimizer_step, version=version)
            publish()
        # One schedule step per optimizer step, checkpointed with the schedule.
        return {**metrics, "micro_batches": float(micro_batches), "optimizer_steps_total": float(self.scheduler.last_epoch)}

    def _clip(self, version: int) -> float:
        """Clip the accumulated gradient; returns the pre-clip norm. A non-finite norm drops the
        gradient and raises, stepping nothing."""
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm))
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"non-finite gradient norm {grad_norm} at version {version}")
        return grad_norm
