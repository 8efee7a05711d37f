"""What a task is to tandem: a source of items, the rewards that score them, held-out evaluation.

A task is a workload's data and judgement; the workload's engines and workflow (chosen by the
task's ``kind``) produce its trajectories. Tasks live in ``tasks/`` (one folder each, found by
name) or anywhere importable (``module:object``): see ``tasks.registry``. A task never imports
the flow, and the flow never names a task.

Reward functions are plain functions, named by dotted path so worker processes can import them:
``fn(response, answer, **context) -> float | RewardResult`` (or an ``async def``), where
``response`` is the workload's rendering of a trajectory (the decoded text for text tasks) and
``context`` holds whichever of ``prompt``, ``meta`` and ``trajectory`` the function declares.
Several functions are combined by weights (``RewardFunction.weight``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from tandem.core.records import TaskItem

__all__ = ["RewardFunction", "Task", "TrajectoryKind"]

# Which workload produces a task's trajectories: single-turn token sequences, multi-turn
# episodes against an environment, or the denoising runs of an image generator.
TrajectoryKind = Literal["text", "episode", "image"]


@dataclass(slots=True, frozen=True)
class RewardFunction:
    """One named reward: ``module:function``, its weight in the sum, and where it runs.

    ``runner``: ``pool`` (the default) runs it in the reward worker processes under the task's
    timeout, so a slow, hanging or crashing function fails only its samples; ``inline`` calls it
    on the event loop, for functions too cheap to be worth a process hop (exact-match checks).
    """

    name: str
    fn: str
    weight: float = 1.0
    runner: Literal["pool", "inline"] = "pool"


@runtime_checkable
class Task(Protocol):
    """A workload's data and rewards. Implementations are small classes in ``tasks/``."""

    @property
    def name(self) -> str: ...

    @property
    def kind(self) -> TrajectoryKind: ...

    @property
    def model_path(self) -> Path | None:
        """The model shipped for this task (``engines.model_path`` overrides it); None: none."""
        ...

    def items(self, seed: int, start: int = 0) -> Iterator[TaskItem]:
        """The training items in a deterministic order for ``seed``, from position ``start``;
        may be endless."""
        ...

    def held_out(self, n: int) -> list[TaskItem]:
        """``n`` evaluation items, never trained on, the same on every call."""
        ...

    def rewards(self) -> list[RewardFunction]:
        """The task's own rewards (a config's ``task.rewards`` replaces them)."""
        ...
