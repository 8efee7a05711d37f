"""The ref_logp role: log-probs of the frozen reference model, for the KL penalty."""

from __future__ import annotations

from tandem.core.records import TrajectoryGroup
from tandem.state_machines.base import Stage
from tandem.state_machines.logp import score

__all__ = ["RefLogPStateMachine"]


class RefLogPStateMachine(Stage[TrajectoryGroup, TrajectoryGroup]):
    role = "ref_logp"

    async def process(self, items: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
        engine = self.services.components.reference
        if engine is None:
            raise RuntimeError("the ref_logp stage runs but the components have no reference engine")
        for trajectory, lp in await score(engine, items, "reference log-probs"):
            trajectory.ref_logprobs = lp
        return items
