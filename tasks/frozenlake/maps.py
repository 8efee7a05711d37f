"""FrozenLake maps per seed, the moves on them, and the BFS expert that solves them.

Owns the lake's geometry: which map a seed gives (gymnasium's ``generate_random_map``, which only
returns maps with a path from start to goal), the four moves in gymnasium's action order, the seed
ranges that keep training and held-out maps apart, and the shortest path (breadth-first search)
that the pretraining data imitates.

Why 4×4 with hole probability 0.4: the shortest path is then 6 moves (start top-left, goal
bottom-right; it was so on all of 20,000 seeds checked: a small random lake practically never forces
a detour), so with a 10-turn limit an episode takes 1 to 10 turns and fits in 271 tokens, and the
1 M-parameter model learns to play in minutes on one core. Holes are frequent (4.4 per map on
average, up to 9) so that the map matters: at gymnasium's default 0.2, playing blind (right or down
at random: 34 %; down three times then right: 40 %) lands inside the success band the shipped model
is stopped in, so a model that never looks at the lake would pass for one that does. At 0.4 blind
play wins 17-18 %, stepping around the holes next to the agent 87 %, the BFS expert always.

Invariants: everything here is a pure function of its arguments, so a seed gives the same map on
every machine; :func:`shortest_path` returns a path of valid moves that ends on the goal and never
steps on a hole, or None when the goal is unreachable.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Literal

from gymnasium.envs.toy_text.frozen_lake import generate_random_map

__all__ = [
    "ACTIONS",
    "FROZEN_PROBABILITY",
    "HELD_OUT_SEEDS",
    "MAP_SIZE",
    "MOVES",
    "TRAIN_SEEDS",
    "Action",
    "LakeMap",
    "Position",
    "expert_action",
    "generate_map",
    "move",
    "shortest_path",
]

Action = Literal["L", "D", "R", "U"]
# Gymnasium's action ids are the indices: 0 left, 1 down, 2 right, 3 up.
ACTIONS: tuple[Action, ...] = ("L", "D", "R", "U")
MOVES: dict[Action, tuple[int, int]] = {"L": (0, -1), "D": (1, 0), "R": (0, 1), "U": (-1, 0)}

MAP_SIZE = 4
# Gymnasium's ``p``: each tile other than start and goal is frozen with this probability, a hole otherwise.
FROZEN_PROBABILITY = 0.6
# Training items come from TRAIN_SEEDS, evaluation from HELD_OUT_SEEDS (disjoint). On a 4×4 lake
# different seeds often give the same map, so pretraining also skips the maps of its evaluation
# seeds (see tasks.frozenlake.pretrain).
TRAIN_SEEDS = range(0, 1_000_000)
HELD_OUT_SEEDS = range(1_000_000, 2_000_000)

# A map is its rows, gymnasium's letters: S start, F frozen, H hole, G goal.
LakeMap = tuple[str, ...]
Position = tuple[int, int]  # (row, column), (0, 0) top-left


def generate_map(seed: int, size: int = MAP_SIZE, frozen_probability: float = FROZEN_PROBABILITY) -> LakeMap:
    """The map of ``seed``: start top-left, goal bottom-right, always solvable."""
    return tuple(generate_random_map(size=size, p=frozen_probability, seed=seed))


def move(lake_map: Sequence[str], position: Position, action: Action) -> Position:
    """Where ``action`` leads without slipping: one tile over, or nowhere at the lake's edge."""
    dr, dc = MOVES[action]
    row, column = position[0] + dr, position[1] + dc
    if 0 <= row < len(lake_map) and 0 <= column < len(lake_map[0]):
        return row, column
    return position


def shortest_path(lake_map: Sequence[str], start: Position = (0, 0)) -> list[Action] | None:
    """A shortest list of moves from ``start`` to the goal avoiding holes (breadth-first search).

    Ties go to the first move in ``ACTIONS`` order, so the path is deterministic.
    """
    goal = (len(lake_map) - 1, len(lake_map[0]) - 1)
    came_from: dict[Position, tuple[Position, Action] | None] = {start: None}
    frontier = deque([start])
    while frontier:
        position = frontier.popleft()
        if position == goal:
            break
        for action in ACTIONS:
            nxt = move(lake_map, position, action)
            if nxt not in came_from and lake_map[nxt[0]][nxt[1]] != "H":
                came_from[nxt] = (position, action)
                frontier.append(nxt)
    if goal not in came_from:
        return None
    path: list[Action] = []
    step = came_from[goal]
    while step is not None:
        previous, action = step
        path.append(action)
        step = came_from[previous]
    return path[::-1]


def expert_action(lake_map: Sequence[str], position: Position) -> Action:
    """The first move of a shortest path from ``position``: the expert replans every turn, so it
    also acts sensibly after a detour (or a slip on a slippery lake)."""
    path = shortest_path(lake_map, position)
    if not path:
        raise ValueError(f"no path to the goal from {position} on {lake_map}")
    return path[0]
