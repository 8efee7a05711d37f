"""The compute a flow drives: the workflow, engines, reward, weight sync and data, as one bundle.

The flow and its state machines see only these protocol-typed handles, so the in-process
fakes, the embedded torch engines, remote (Ray) engines and every workload are interchangeable.
A workload's builder (``engines``) fills the bundle from the config and the task.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tandem.core.protocols import LogProbEngine, Reward, RolloutWorkflow, TrainEngine, ValueEngine, WeightSync
from tandem.core.records import TaskItem
from tandem.core.task import HeldOutMeasure, Task

__all__ = ["Components", "PromptSource", "TaskSetup"]


class PromptSource(Protocol):
    """Yields task items in a deterministic order for a seed, starting at item ``start`` (the
    data position a checkpoint saved: item ``start`` of the same seed's order comes first)."""

    def __call__(self, seed: int, start: int = 0) -> Iterator[TaskItem]: ...


@dataclass(slots=True, frozen=True)
class TaskSetup:
    """What a workload's builder gets besides the config: the task, the items to train on (the
    task's own, or a data file's when the config names one) and the task's reward."""

    task: Task
    items: PromptSource
    reward: Reward


@dataclass(slots=True)
class Components:
    """Everything the roles compute with. ``reference`` and ``teacher`` are None when no role needs them."""

    prompts: PromptSource
    workflow: RolloutWorkflow
    trainer: TrainEngine
    reward: Reward
    weight_sync: WeightSync
    reference: LogProbEngine | None = None
    teacher: LogProbEngine | None = None  # on-policy distillation's teacher, for the teacher_logp stage
    critic: ValueEngine | None = None  # the value model, when the flow has a critic stage (algorithm.advantage: gae)
    close_callbacks: list[Callable[[], None]] = field(default_factory=list)
    # Closers that must run in the run's event loop (an agent session's exit), before close_callbacks.
    aclose_callbacks: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    save_checkpoint: Callable[[Path], Awaitable[None]] | None = None  # final weights, loadable by from_pretrained
    max_prompt_tokens: int | None = None  # longer prompts are dropped at admission (recorded); None: no limit
    held_out: Callable[[int], list[TaskItem]] | None = None  # held_out(n): the same n evaluation items each call
    held_out_measure: HeldOutMeasure = field(default_factory=HeldOutMeasure)  # the task's (set by the builder)

    def close(self) -> None:
        """Release engine threads and resources; safe to call once the flow has stopped."""
        for close in self.close_callbacks:
            close()

    async def aclose(self) -> None:
        """The async closers in order, then :meth:`close`, which runs even if they fail or this
        is cancelled: the engines' threads and server processes never outlive the run."""
        try:
            for aclose in self.aclose_callbacks:
                await aclose()
        finally:
            self.close()
