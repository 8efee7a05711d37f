"""FrozenLake as a task plugin of kind ``episode``: its maps, held-out maps, reward and model.

Owns which map each item plays and keeps training and evaluation apart. Item ``i`` of run seed
``s`` is an episode on the map of an environment seed drawn from ``TRAIN_SEEDS`` by a hash of
``(s, i)`` (so any position is reached at once, as a resume needs); a draw whose map has the layout
of one of the held-out maps is drawn again (a 4×4 lake has few layouts: the first 1,000
held-out seeds give 837 distinct ones, so without this RL would train on "held-out" maps).
Held-out items are the first ``n`` of ``HELD_OUT_SEEDS``: the maps the shipped model's
pretraining reported its success on. Every sample of a group plays the same map (the item's
``meta["seed"]``), from the start tile; only the sampling differs.

Options (``task.options``): ``slippery`` (gymnasium's slippery ice: the intended move happens
with probability 1/3), ``size`` (the lake's side; the shipped model was trained on 4×4) and
``max_turns`` (default: a shortest path's 2·(size−1) moves plus four, 10 on a 4×4 lake).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator

from tandem.core.environment import EnvironmentFactory
from tandem.core.records import TaskItem
from tandem.core.task import HeldOutMeasure, RewardFunction, TrajectoryKind
from tandem.tasks.frozenlake.environment import FrozenLakeEnvironment, render
from tandem.tasks.frozenlake.maps import HELD_OUT_SEEDS, MAP_SIZE, TRAIN_SEEDS, LakeMap, generate_map

__all__ = ["HELD_OUT_MAPS", "FrozenLakeTask", "make_task"]

# held_out(n) serves up to this many maps; training never plays one of their layouts.
HELD_OUT_MAPS = 1000


class FrozenLakeTask:
    """Implements :class:`core.task.Task` and :class:`core.environment.EnvironmentTask`."""

    name = "frozenlake"
    kind: TrajectoryKind = "episode"
    held_out_measure = HeldOutMeasure("success", component="goal")  # the goal reached, however the turns were written

    def __init__(self, slippery: bool = False, size: int = MAP_SIZE, max_turns: int | None = None) -> None:
        if size < 2:
            raise ValueError(f"size must be at least 2, got {size}")
        if max_turns is not None and max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {max_turns}")
        from tandem.tasks.frozenlake import MODEL_DIR  # the package imports this module

        self.model_path = MODEL_DIR
        self.slippery = slippery
        self.size = size
        self.max_turns = max_turns if max_turns is not None else 2 * (size - 1) + 4

    def environment(self) -> EnvironmentFactory:
        return functools.partial(FrozenLakeEnvironment, slippery=self.slippery, max_turns=self.max_turns, size=self.size)

    def items(self, seed: int, start: int = 0) -> Iterator[TaskItem]:
        for position in itertools.count(start):
            yield self._item(self._training_seed(seed, position))

    def held_out(self, n: int) -> list[TaskItem]:
        if n > HELD_OUT_MAPS:
            raise ValueError(f"the held-out set has {HELD_OUT_MAPS} maps, asked for {n}")
        return [self._item(seed) for seed in HELD_OUT_SEEDS[:n]]

    def rewards(self) -> list[RewardFunction]:
        # Reading a few fields off the episode: cheaper inline than a process hop.
        return [
            RewardFunction("goal", "tandem.tasks.frozenlake.reward:reached_goal", runner="inline"),
            RewardFunction("format", "tandem.tasks.frozenlake.reward:malformed_actions", weight=0.1, runner="inline"),
        ]

    def _training_seed(self, seed: int, position: int) -> int:
        for attempt in itertools.count():
            # Python hashes tuples of ints the same in every process (no hash randomisation).
            candidate = TRAIN_SEEDS[hash((seed, position, attempt)) % len(TRAIN_SEEDS)]
            if generate_map(candidate, self.size) not in self._held_out_layouts:
                return candidate
        raise AssertionError("unreachable")

    @functools.cached_property
    def _held_out_layouts(self) -> frozenset[LakeMap]:
        return frozenset(generate_map(seed, self.size) for seed in HELD_OUT_SEEDS[:HELD_OUT_MAPS])

    def _item(self, seed: int) -> TaskItem:
        return TaskItem(prompt=render(generate_map(seed, self.size), (0, 0)), meta={"seed": seed})


def make_task(slippery: bool = False, size: int = MAP_SIZE, max_turns: int | None = None) -> FrozenLakeTask:
    return FrozenLakeTask(slippery=slippery, size=size, max_turns=max_turns)
