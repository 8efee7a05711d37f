"""The word_math task as a plugin: its problem stream, held-out set, rewards and shipped model."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

from tandem.core.records import TaskItem
from tandem.core.task import HeldOutMeasure, RewardFunction, TrajectoryKind
from tandem.tasks.word_math.problems import REPORT_SEED, Problem, generate_problems, messages

__all__ = ["MAX_RESPONSE_TOKENS", "MODEL_DIR", "WordMathTask", "make_task"]

MODEL_DIR = Path(__file__).resolve().parent / "model"
# The longest reference response ("9.9+9.9=\boxed{19.8}", 20 characters) plus its end of turn.
MAX_RESPONSE_TOKENS = 21
_CHUNK = 1024  # problems generated per seed block of the training stream


def _item(problem: Problem) -> TaskItem:
    return TaskItem(prompt=problem["question"], answer=problem["answer"], messages=messages(problem))


class WordMathTask:
    """Implements :class:`core.task.Task` for chat-format word problems scored by ``math``."""

    name = "word_math"
    kind: TrajectoryKind = "text"
    model_path: Path | None = MODEL_DIR
    held_out_measure = HeldOutMeasure("exact_answer", component="math")  # right whatever the format bonus

    def items(self, seed: int, start: int = 0) -> Iterator[TaskItem]:
        first_block, offset = divmod(start, _CHUNK)
        for block in itertools.count(first_block):
            for problem in generate_problems(_CHUNK, seed * 1_000_003 + block)[offset:]:
                yield _item(problem)
            offset = 0

    def held_out(self, n: int) -> list[TaskItem]:
        """The problems pretraining reported its accuracy on (the report seed's stream)."""
        return [_item(problem) for problem in generate_problems(n, REPORT_SEED)]

    def rewards(self) -> list[RewardFunction]:
        return [
            RewardFunction("math", "tandem.tasks.math_answers:math"),
            RewardFunction("boxed", "tandem.tasks.math_answers:boxed", weight=0.1),
        ]


def make_task() -> WordMathTask:
    return WordMathTask()
