"""The arithmetic task as a plugin: its problem stream, held-out set, verifier and shipped models
(the model RL starts from, and a stronger teacher to distill into it)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

from tandem.core.records import TaskItem
from tandem.core.task import HeldOutMeasure, RewardFunction, TrajectoryKind
from tandem.tasks.arithmetic.problems import REPORT_SEED, generate_problems

__all__ = ["ArithmeticTask", "make_task"]

MODEL_DIR = Path(__file__).resolve().parent / "model"
# A stronger model of the same recipe and tokenizer, trained longer: on-policy distillation's
# teacher for the shipped one (configs/distill_arithmetic.yaml).
TEACHER_DIR = Path(__file__).resolve().parent / "teacher"
_CHUNK = 1024  # problems generated per seed block of the training stream


class ArithmeticTask:
    """Implements :class:`core.task.Task` for column-scratchpad addition."""

    name = "arithmetic"
    kind: TrajectoryKind = "text"
    model_path: Path | None = MODEL_DIR
    held_out_measure = HeldOutMeasure("exact_answer", component="correct")  # the final line is the sum

    def items(self, seed: int, start: int = 0) -> Iterator[TaskItem]:
        first_block, offset = divmod(start, _CHUNK)
        for block in itertools.count(first_block):
            rows = generate_problems(_CHUNK, seed * 1_000_003 + block)
            for row in rows[offset:]:
                yield TaskItem(prompt=row["prompt"], answer=row["answer"])
            offset = 0

    def held_out(self, n: int) -> list[TaskItem]:
        """The problems pretraining reported its accuracy on (the report seed's stream)."""
        return [TaskItem(prompt=row["prompt"], answer=row["answer"]) for row in generate_problems(n, REPORT_SEED)]

    def rewards(self) -> list[RewardFunction]:
        return [RewardFunction("correct", "tandem.tasks.arithmetic.verifier:verify")]


def make_task() -> ArithmeticTask:
    return ArithmeticTask()
