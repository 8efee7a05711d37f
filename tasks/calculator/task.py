"""The calculator task as a plugin of kind ``episode``: problems, held-out problems, reward, model.

Owns which problem each item is. Item ``i`` of run seed ``s`` is the problem of an environment
seed drawn from ``TRAIN_SEEDS`` by a hash of ``(s, i)`` (any position is reached at once, as a
resume needs); held-out items are the problems of the first ``n`` of ``HELD_OUT_SEEDS``, a
range no training item draws from (short problems still repeat between them: there are only
100 one-digit sums). Every sample of a group solves the same problem; the reward is the
environment's verdict on the final answer (the arithmetic verifier), 0 for an episode that never
gave one.

The model (``MODEL_DIR``) is the arithmetic task's, fine-tuned by ``tasks.calculator.pretrain``
to call the tool. The arithmetic model itself plays this environment too (the transcript is its
scratchpad character for character, and its ``<eos>`` ends a turn), but in one turn: it never
ends a turn on a column's ``=``, so it would never call the calculator and RL would have no tool
use to reinforce. The fine-tuned one imitated an expert that calls the tool for half the columns:
sampled accuracy 0.42 with 1.9 tool calls per episode on the report problems (the arithmetic
model: 0.275, none), and since the tool's sums are always right and its own are not, calling
it more is room for RL.

Option (``task.options``): ``max_turns`` (default ``MAX_TURNS``: a tool call per column of the
longest problem, the answer and three spare turns).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from pathlib import Path

from tandem.core.environment import EnvironmentFactory
from tandem.core.records import TaskItem
from tandem.core.task import HeldOutMeasure, RewardFunction, TrajectoryKind
from tandem.tasks.arithmetic import generate_problems
from tandem.tasks.calculator.environment import MAX_TURNS, CalculatorEnvironment

__all__ = ["HELD_OUT_SEEDS", "MODEL_DIR", "TRAIN_SEEDS", "CalculatorTask", "make_task"]

MODEL_DIR = Path(__file__).resolve().parent / "model"

TRAIN_SEEDS = range(0, 1_000_000_000)
HELD_OUT_SEEDS = range(1_000_000_000, 1_001_000_000)


class CalculatorTask:
    """Implements :class:`core.task.Task` and :class:`core.environment.EnvironmentTask`."""

    name = "calculator"
    kind: TrajectoryKind = "episode"
    model_path = MODEL_DIR
    held_out_measure = HeldOutMeasure("success", component="correct")  # the episode ends on the right answer

    def __init__(self, max_turns: int = MAX_TURNS) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {max_turns}")
        self.max_turns = max_turns

    def environment(self) -> EnvironmentFactory:
        return functools.partial(CalculatorEnvironment, max_turns=self.max_turns)

    def items(self, seed: int, start: int = 0) -> Iterator[TaskItem]:
        for position in itertools.count(start):
            # Python hashes tuples of ints the same in every process (no hash randomisation).
            yield _item(TRAIN_SEEDS[hash((seed, position)) % len(TRAIN_SEEDS)])

    def held_out(self, n: int) -> list[TaskItem]:
        return [_item(seed) for seed in HELD_OUT_SEEDS[:n]]

    def rewards(self) -> list[RewardFunction]:
        # Reading one float off the episode: cheaper inline than a process hop.
        return [RewardFunction("correct", "tandem.tasks.calculator.reward:correct", runner="inline")]


def _item(seed: int) -> TaskItem:
    problem = generate_problems(1, seed)[0]
    return TaskItem(prompt=problem["prompt"], answer=problem["answer"], meta={"seed": seed})


def make_task(max_turns: int = MAX_TURNS) -> CalculatorTask:
    return CalculatorTask(max_turns=max_turns)
