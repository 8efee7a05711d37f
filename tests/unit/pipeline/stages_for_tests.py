"""Custom stages that the flow tests name in config, as a user would."""

from __future__ import annotations

from tandem.core.records import TrajectoryGroup
from tandem.state_machines.base import Stage


class DropOddPrompts(Stage[TrajectoryGroup, TrajectoryGroup]):
    """A filter between reward and train: odd prompt ids are dropped with a reason."""

    async def process(self, items: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
        odd = [g for g in items if g.prompt_id % 2]
        if odd:
            await self.drop(odd, "filtered: odd prompt id")
        return [g for g in items if not g.prompt_id % 2]


class ConstantReward(Stage[TrajectoryGroup, TrajectoryGroup]):
    """Replaces the reward role: every sample scores 0.25."""

    async def process(self, items: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
        for group in items:
            for sample in group.trajectories:
                sample.reward = 0.25
        return items


class FailOnPrompt(Stage[TrajectoryGroup, TrajectoryGroup]):
    """Replaces the reward role and raises on prompt 5."""

    async def process(self, items: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
        if any(g.prompt_id == 5 for g in items):
            raise ValueError("verifier exploded")
        return items
