"""The logp role: recomputes proximal log-probs with the trainer's current weights.

Decoupled PPO needs pi_prox, the policy the trust region is centred on; the behaviour policy
pi_behav (the rollout engine's log-probs) may be several versions older. The version used is
recorded per trajectory. The flow puts this role under one lock with train (they share the
trainer's weights), so a score never straddles an optimizer step.

Only groups the trainer has reached are scored here: pi_prox is the policy at the start of the
group's train step, so a group assigned to step ``s`` scored while the trainer is still at a
version ``< s`` would be scored again by the train role (``TrainStateMachine.refresh_proximal``),
a wasted forward pass on the role that bounds throughput. Such a group passes through unscored
and is scored once, in its train step. With ``k = 0`` and ``k = 1`` most groups arrive after
their step's version exists and are scored here, ahead of the step; with larger ``k`` most
arrive early. Passing through, rather than holding groups back, keeps the stream in order and
the reward role fed.
"""

from __future__ import annotations

from tandem.core.protocols import LogProbEngine
from tandem.core.records import Trajectory, TrajectoryGroup
from tandem.state_machines.base import Stage

__all__ = ["LogPStateMachine", "score"]


class LogPStateMachine(Stage[TrajectoryGroup, TrajectoryGroup]):
    role = "logp"

    async def process(self, items: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
        engine = self.services.components.trainer
        version = engine.version
        reached = [g for g in items if g.step <= version]
        for trajectory, lp in await score(engine, reached, "log-probs") if reached else []:
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
