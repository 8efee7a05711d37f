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

A task may name what its held-out evaluation measures (``held_out_measure``, a
:class:`HeldOutMeasure`: an exact answer, recognition by a judge, an episode's success); the
summary line, ``summary.json``, the validation rows and the dashboard report it by that name. A
task that names none is measured by ``accuracy``, the share of samples with full reward.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from tandem.core.records import TaskItem

if TYPE_CHECKING:
    from tandem.core.protocols import RewardResult

__all__ = ["HeldOutMeasure", "RewardFunction", "Task", "TrajectoryKind", "held_out_measure"]

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


@dataclass(slots=True, frozen=True)
class HeldOutMeasure:
    """What a held-out evaluation reports beside the mean reward: the share of samples whose
    reward reaches ``threshold``, under ``name`` (an identifier: ``exact_answer``, ``recognized``).

    ``component`` names one reward function whose unweighted value is compared instead of the
    weighted sum (a judge's verdict, apart from a shaping term weighed in beside it); when that
    function is the run's only one, the reward carries no components and is its value. A sample
    whose reward failed never meets the measure.
    """

    name: str = "accuracy"
    component: str | None = None
    threshold: float = 1.0

    def met_by(self, result: RewardResult) -> bool:
        if not result.ok:
            return False
        components = result.components
        value = result.reward if self.component is None or components is None else components.get(self.component, 0.0)
        return value >= self.threshold


def held_out_measure(task: Task, reward_names: list[str]) -> HeldOutMeasure:
    """The task's ``held_out_measure`` (``accuracy`` if it names none, or if it reads a reward
    component that the run's rewards, a config's replacing the task's, do not have)."""
    measure = getattr(task, "held_out_measure", None)
    if not isinstance(measure, HeldOutMeasure) or (measure.component is not None and measure.component not in reward_names):
        return HeldOutMeasure()
    return measure


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
