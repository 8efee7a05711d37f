"""The synthetic task: an endless seeded stream of ``a+b=`` prompts, rewarded by exact match.

It needs no model: it is the task of the fake engines (tests, the simulator, benchmarks), whose
fake policy answers correctly with a probability that rises with its weight version, so a
simulated run visibly learns. The reward is cheap enough to run inline on the event loop.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from pathlib import Path

from tandem.core.records import TaskItem
from tandem.core.task import RewardFunction, TrajectoryKind

__all__ = ["HELD_OUT_SEED", "SyntheticTask", "exact_match", "make_task"]

HELD_OUT_SEED = 2**61 - 1  # the held-out stream's own seed, far from any seed a run would pick


def exact_match(response: str, answer: str | None) -> float:
    """1.0 when the response is exactly the answer."""
    return 1.0 if answer is not None and response == answer else 0.0


class SyntheticTask:
    """Implements :class:`core.task.Task`: prompts ``a+b=`` with token ids ``[a % 50, b % 50]``."""

    name = "synthetic"
    kind: TrajectoryKind = "text"
    model_path: Path | None = None

    def items(self, seed: int, start: int = 0) -> Iterator[TaskItem]:
        rng = random.Random(seed)
        for position in itertools.count():
            a, b = rng.randrange(100), rng.randrange(100)
            if position >= start:
                yield TaskItem(prompt=f"{a}+{b}=", prompt_ids=[a % 50, b % 50], answer=str(a + b))

    def held_out(self, n: int) -> list[TaskItem]:
        return list(itertools.islice(self.items(HELD_OUT_SEED), n))

    def rewards(self) -> list[RewardFunction]:
        return [RewardFunction("exact_match", "tandem.tasks.synthetic:exact_match", runner="inline")]


def make_task() -> SyntheticTask:
    return SyntheticTask()
