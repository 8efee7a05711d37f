"""Environments, a task and a reward with known behaviour (and misbehaviour) for the agentic tests.

Importable by name (this folder is on ``sys.path`` under pytest), so a config can name the task
(``agentic_for_tests:ScriptedTask``) and a child process can build the environments. Every text
is in the tiny model's vocabulary (``tiny_lm.VOCAB``).
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Iterator
from typing import Any

from tandem.core.environment import EnvironmentFactory, StepResult
from tandem.core.records import TaskItem
from tandem.core.task import RewardFunction, TrajectoryKind

HANG_S = 2.0  # how long a hanging step sleeps: past any timeout the tests set, short enough to free its thread


def first_observation(seed: int) -> str:
    return f"{seed % 10}+{seed % 7}="


class ScriptedEnvironment:
    """Terminates after ``turns`` steps; each step pays 1.0 if the turn contains an ``a``; the
    observation after step ``t`` is ``b`` then ``t`` then ``=``. ``max_turns`` truncates first if
    it is smaller. With ``broken`` set, episodes on seeds ending in 1 raise at the second step,
    in 2 hang there, in 3 answer it with something that is not a ``StepResult``."""

    def __init__(self, turns: int = 3, max_turns: int = 8, broken: bool = False) -> None:
        self.turns = turns
        self.max_turns = max_turns
        self.broken = broken
        self.seed = 0
        self.turn = 0

    def reset(self, seed: int) -> str:
        self.seed, self.turn = seed, 0
        return first_observation(seed)

    def step(self, action_text: str) -> Any:
        self.turn += 1
        if self.broken and self.turn == 2:
            if self.seed % 10 == 1:
                raise RuntimeError(f"the lake cracked under seed {self.seed}")
            if self.seed % 10 == 2:
                time.sleep(HANG_S)
            if self.seed % 10 == 3:
                return "not a step result"
        terminated = self.turn >= self.turns
        truncated = not terminated and self.turn >= self.max_turns
        return StepResult(f"b{self.turn}=", float("a" in action_text), terminated, truncated, {"turn": self.turn})


class ScriptedTask:
    """A task of kind ``episode`` over :class:`ScriptedEnvironment`: item ``i`` resets with seed ``i``."""

    name = "scripted"
    kind: TrajectoryKind = "episode"
    model_path = None  # the config names the tiny model

    def __init__(self, turns: int = 3, max_turns: int = 8, broken: bool = False) -> None:
        self.turns, self.max_turns, self.broken = turns, max_turns, broken

    def environment(self) -> EnvironmentFactory:
        return functools.partial(ScriptedEnvironment, turns=self.turns, max_turns=self.max_turns, broken=self.broken)

    def items(self, seed: int, start: int = 0) -> Iterator[TaskItem]:
        for i in itertools.count(start):
            yield TaskItem(prompt=first_observation(i), meta={"seed": i})

    def held_out(self, n: int) -> list[TaskItem]:
        return [TaskItem(prompt=first_observation(10_000 + i), meta={"seed": 10_000 + i}) for i in range(n)]

    def rewards(self) -> list[RewardFunction]:
        return [RewardFunction("return", "agentic_for_tests:env_return", runner="inline")]


def env_return(response: Any, answer: str | None) -> float:
    """The episode's return, as the environment paid it."""
    return float(response.env_return)
