"""The digits task as a plugin: prompts "draw the digit d", scored by the task's OCR, shipped generator.

Items are digits drawn uniformly by a seeded stream (the same order on every machine for a
seed, resumable at any position); the held-out set cycles 0..9 so an evaluation grid with ten
columns shows one digit per column. Each item's ``answer`` is its digit; its ``meta`` carries
``judge_cost_s``, the artificial seconds the judge spends per image (GeRL's slow served VLM
judge, reproduced without one: see :func:`tasks.digits.reward.ocr`).

Rewards: ``ocr`` (the classifier's probability of the prompted digit) with weight 1, plus
``ink`` (the inked share of the canvas) when ``ink_weight`` is not 0; both run where ``judge``
says: ``pool`` (the reward worker processes, under the task's timeout: a crashing or hanging
judge fails only its samples) or ``inline`` (in the flow's own process, on its event loop).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import numpy as np

from tandem.core.records import TaskItem
from tandem.core.task import HeldOutMeasure, RewardFunction, TrajectoryKind
from tandem.tasks.digits import MODEL_DIR, NUM_DIGITS, format_prompt

__all__ = ["DigitsTask", "make_task"]

_CHUNK = 1024  # digits drawn per seeded block of the training stream


class DigitsTask:
    """Implements :class:`core.task.Task` for class-conditional digit generation (kind ``image``)."""

    name = "digits"
    kind: TrajectoryKind = "image"
    model_path: Path | None = MODEL_DIR
    # The judge recognizes the prompted digit: it gives it at least half its probability (so it is
    # the judge's first choice), whatever ink the image spends.
    held_out_measure = HeldOutMeasure("recognized", component="ocr", threshold=0.5)

    def __init__(self, judge_cost_s: float = 0.0, ink_weight: float = 0.0, judge: Literal["pool", "inline"] = "pool") -> None:
        if judge_cost_s < 0:
            raise ValueError(f"judge_cost_s must be >= 0, got {judge_cost_s}")
        if judge not in ("pool", "inline"):
            raise ValueError(f"judge must be 'pool' or 'inline', got {judge!r}")
        self.judge_cost_s = judge_cost_s
        self.ink_weight = ink_weight
        self.judge: Literal["pool", "inline"] = judge

    def _item(self, digit: int) -> TaskItem:
        return TaskItem(prompt=format_prompt(digit), answer=str(digit), meta={"judge_cost_s": self.judge_cost_s})

    def items(self, seed: int, start: int = 0) -> Iterator[TaskItem]:
        first_block, offset = divmod(start, _CHUNK)
        for block in itertools.count(first_block):
            digits = np.random.default_rng([seed, block]).integers(0, NUM_DIGITS, _CHUNK)
            for digit in digits[offset:]:
                yield self._item(int(digit))
            offset = 0

    def held_out(self, n: int) -> list[TaskItem]:
        """Digits 0, 1, ..., 9, 0, 1, ...: ``n`` prompts, the same on every call."""
        return [self._item(i % NUM_DIGITS) for i in range(n)]

    def rewards(self) -> list[RewardFunction]:
        functions = [RewardFunction("ocr", "tandem.tasks.digits.reward:ocr", 1.0, self.judge)]
        if self.ink_weight:
            functions.append(RewardFunction("ink", "tandem.tasks.digits.reward:ink", self.ink_weight, self.judge))
        return functions


def make_task(judge_cost_s: float = 0.0, ink_weight: float = 0.0, judge: Literal["pool", "inline"] = "pool") -> DigitsTask:
    """The digits task; ``task.options`` in a config are these keyword arguments."""
    return DigitsTask(judge_cost_s=judge_cost_s, ink_weight=ink_weight, judge=judge)
