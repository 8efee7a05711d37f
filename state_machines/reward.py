"""The reward role: scores each micro-batch of groups as it arrives, while generation goes on.

The reward implementation must not block the loop (rule-based verifiers run in a process
pool). A verifier that fails on a sample scores it as failed with the reason recorded in
``Sample.reward_info``; the run continues. A reward that is not a finite number (NaN, a bool,
a string), or a result that is not a ``RewardResult``, is such a failure too, never a silent
NaN in the loss.
"""

from __future__ import annotations

import math

from core.protocols import RewardResult
from core.records import RolloutGroup
from state_machines.base import Stage

__all__ = ["RewardStateMachine"]


class RewardStateMachine(Stage[RolloutGroup, RolloutGroup]):
    role = "reward"

    async def process(self, items: list[RolloutGroup]) -> list[RolloutGroup]:
        samples = [s for g in items for s in g.samples]
        answers = [g.group.answer for g in items for _ in g.samples]
        results = await self.services.components.reward.score(samples, answers)
        if len(results) != len(samples):
            raise ValueError(f"reward returned {len(results)} results for {len(samples)} samples")
        for sample, result in zip(samples, results, strict=True):
            if not isinstance(result, RewardResult):
                sample.reward, sample.reward_info = 0.0, f"invalid reward {result!r}: not a RewardResult"
                continue
            value = result.reward
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                sample.reward, sample.reward_info = 0.0, f"invalid reward {value!r}"
            else:
                sample.reward = float(value)
                sample.reward_info = result.info if result.ok else f"failed: {result.info}"
        return items
