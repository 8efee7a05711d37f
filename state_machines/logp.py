"""The logp role: recomputes proximal log-probs with the trainer's current weights.

Decoupled PPO needs pi_prox, the policy the trust region is centred on; the behaviour policy
pi_behav (the rollout engine's log-probs) may be several versions older. The version used is
recorded per trajectory. The flow puts this role under one lock with train (they share the
trainer's weights), so a score never straddles an optimizer step.
"""

from __future__ import annotations

from core.protocols import LogProbEngine
from core.records import Trajectory, TrajectoryGroup
from state_machines.base import Stage

__all__ = ["LogPStateMachine", "score"]


class LogPStateMachine(Stage[TrajectoryGroup, TrajectoryGroup]):
    role = "logp"

    async def process(self, items: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
        engine = self.services.components.trainer
        version = engine.version
        for trajectory, lp in await score(engine, items, "log-probs"):
            trajectory.prox_logprobs = lp
            trajectory.prox_version = version
        self.version = version
        return items


async def score(engine: LogProbEngine, items: list[TrajectoryGroup], what: str) -> list[tuple[Trajectory, list[float]]]:
    """Each trajectory of ``items`` with its per-action log-probs under ``engine``, one per action
    (an engine returning any other count is an error naming the trajectory)."""
    trajectories = [t for g in items for t in g.trajectories]
    scored = list(zip(trajectories, await engine.logprobs(trajectories), strict=True))
    for trajectory, lp in scored:
        if len(lp) != trajectory.num_actions:
            raise ValueError(
                f"prompt {trajectory.prompt_id} trajectory {trajectory.index}: {len(lp)} {what} "
                f"for {trajectory.num_actions} actions"
            )
    return scored
