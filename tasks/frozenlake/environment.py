"""FrozenLake as a text environment: gymnasium's ``FrozenLakeEnv`` behind ``core.environment``'s protocol.

Owns the text the model reads and writes. An observation is the lake drawn as a grid, one line per
row, the agent shown as ``@``, then one more line with the four tiles next to the agent in action
order (left, down, right, up), ``#`` beyond the lake's edge; every line ends in a newline::

    .H..        . frozen (the start tile too)
    .@.H        H hole
    ...H        G goal
    H..G        @ the agent
    ...H        left ".", down ".", right ".", up "H"

The grid is the whole state; the neighbour line repeats what matters most for the next move where a
1 M-parameter model finds it without searching the grid for ``@``. Measured with the shipped recipe
(``tasks.frozenlake.pretrain``): with the neighbour line the model starts reading the lake after
about 85 steps; on the grid alone it still played blind after 150 (check success 0.15, where
moving right or down at random scores 0.18). Seeing which neighbour is a hole is not enough to
win: only the grid shows dead ends and the way to the goal.

An action is exactly one letter, ``L``, ``D``, ``R`` or ``U`` (left, down, right, up), the whole
decoded turn without its end-of-turn token: nothing before or after, no whitespace, so that one
token is one decision. Anything else is a malformed action: it counts as a turn, the agent stays
where it is, the reward is 0 and ``info["error"]`` says what was expected. It does not end the
episode (the turn it costs is penalty enough under a 10-turn limit for a 6-move path, and a
policy that recovers can still be rewarded for it).

Reward 1.0 on the step that reaches the goal, else 0.0. The episode terminates on the goal or a
hole and is truncated on the ``max_turns``-th step otherwise. With ``slippery`` on, gymnasium's
dynamics apply: the intended move happens with probability 1/3, each perpendicular one with 1/3;
the slips are drawn from the episode's seed, so a seed replays the same episode for the same actions.

Invariants: ``reset(seed)`` is deterministic (map and slips); every step returns a ``StepResult``
of the protocol's types; ``info`` always holds the agent's ``position`` and, once the episode
has ended, its ``outcome`` (``goal``, ``hole`` or ``turn_limit``).
"""

from __future__ import annotations

from collections.abc import Sequence

from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv

from tandem.core.environment import StepResult
from tandem.tasks.frozenlake.maps import (
    ACTIONS,
    FROZEN_PROBABILITY,
    MAP_SIZE,
    Action,
    LakeMap,
    Position,
    generate_map,
    move,
)

__all__ = ["EDGE", "MAX_TURNS", "TILES", "FrozenLakeEnvironment", "parse_action", "render"]

# A 6-move path plus two detours (a detour costs two moves).
MAX_TURNS = 10
# Gymnasium's map letters as drawn; the start tile is ordinary ice once the agent has left it.
TILES = {"S": ".", "F": ".", "H": "H", "G": "G"}
AGENT = "@"
EDGE = "#"


def render(lake_map: Sequence[str], position: Position) -> str:
    """What the model reads: the grid (agent as ``@``), then the agent's neighbours in ``ACTIONS``
    order, each line ending in a newline."""
    grid = "".join(
        "".join(AGENT if (row, column) == position else TILES[tile] for column, tile in enumerate(line)) + "\n"
        for row, line in enumerate(lake_map)
    )
    neighbours = "".join(
        TILES[lake_map[nxt[0]][nxt[1]]] if (nxt := move(lake_map, position, action)) != position else EDGE for action in ACTIONS
    )
    return grid + neighbours + "\n"


def parse_action(action_text: str) -> Action | None:
    """The action a turn names, or None when the turn is not exactly one of ``L D R U``."""
    return action_text if action_text in ACTIONS else None  # type: ignore[return-value]


class FrozenLakeEnvironment:
    """One FrozenLake lake at a time, a new random map per ``reset(seed)``; implements
    ``core.environment.Environment``."""

    def __init__(
        self,
        slippery: bool = False,
        max_turns: int = MAX_TURNS,
        size: int = MAP_SIZE,
        frozen_probability: float = FROZEN_PROBABILITY,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {max_turns}")
        self.slippery = slippery
        self.max_turns = max_turns
        self._size = size
        self._frozen_probability = frozen_probability
        self._lake: FrozenLakeEnv | None = None
        self.lake_map: LakeMap = ()
        self.position: Position = (0, 0)
        self.turns = 0
        self.ended = False

    def reset(self, seed: int) -> str:
        """A fresh episode on the map of ``seed``, the agent on the start tile."""
        self.lake_map = generate_map(seed, self._size, self._frozen_probability)
        self._lake = FrozenLakeEnv(desc=list(self.lake_map), is_slippery=self.slippery)
        state, _ = self._lake.reset(seed=seed)
        self.position = divmod(int(state), self._size)
        self.turns = 0
        self.ended = False
        return render(self.lake_map, self.position)

    def step(self, action_text: str) -> StepResult:
        """Apply one turn; a malformed action leaves the agent in place (see the module doc)."""
        if self._lake is None or self.ended:
            raise RuntimeError("step outside an episode: call reset first")
        self.turns += 1
        action = parse_action(action_text)
        info: dict[str, object] = {}
        reward, terminated = 0.0, False
        if action is None:
            info["error"] = f"expected exactly one of {' '.join(ACTIONS)}, got {action_text!r}"
        else:
            state, gym_reward, gym_terminated, _, _ = self._lake.step(ACTIONS.index(action))
            self.position = divmod(int(state), self._size)
            reward, terminated = float(gym_reward), bool(gym_terminated)
        truncated = not terminated and self.turns >= self.max_turns
        info["position"] = list(self.position)
        if terminated or truncated:
            self.ended = True
            tile = self.lake_map[self.position[0]][self.position[1]]
            info["outcome"] = "turn_limit" if truncated else ("goal" if tile == "G" else "hole")
        return StepResult(render(self.lake_map, self.position), reward, terminated, truncated, info)
