"""The reward role: scores each micro-batch of groups as it arrives, while generation goes on.

The reward implementation must not block the loop (reward functions run in a process pool, or
inline when they are trivially cheap). A reward function that fails on a trajectory scores it
as failed with the reason recorded in ``Trajectory.reward_info``; the run continues. A reward
that is not a finite number (NaN, a bool, a string), or a result that is not a
``RewardResult``, is such a failure too, never a silent NaN in the loss. Each named reward of a
weighted sum is kept in ``Trajectory.rewards``.
"""

from __future__ import annotations

import math

from tandem.core.protocols import RewardResult
from tandem.core.records import TrajectoryGroup
from tandem.state_machines.base import Stage

__all__ = ["RewardStateMachine"]


class RewardStateMachine(Stage[TrajectoryGroup, TrajectoryGroup]):
    role = "reward"

    async def process(self, items: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
        trajectories = [t for g in items for t in g.trajectories]
        groups = [g.group for g in items for _ in g.trajectories]
        results = await self.services.components.reward.score(trajectories, groups)
        if len(results) != len(trajectories):
            raise ValueError(f"reward returned {len(results)} results for {len(trajectories)} trajectories")
        for trajectory, result in zip(trajectories, results, strict=True):
            if not isinstance(result, RewardResult):
                trajectory.reward, trajectory.reward_info = 0.0, f"invalid reward {result!r}: not a RewardResult"
                continue
            value = result.reward
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                trajectory.reward, trajectory.reward_info = 0.0, f"invalid reward {value!r}"
            else:
                trajectory.reward = float(value)
                trajectory.rewards = result.components
                trajectory.reward_info = result.info if result.ok else f"failed: {result.info}"
        return items
