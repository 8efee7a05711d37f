"""The rollout role: assembles finished trajectories into complete prompt groups.

Trajectories of one group finish at different times (the long tail); GRPO needs the whole
group, so a group leaves only when all ``n`` are in, ordered by index. Partial groups are
bounded by the groups in flight, and a group dropped anywhere is discarded here too.
"""

from __future__ import annotations

from tandem.core.records import Trajectory, TrajectoryGroup
from tandem.state_machines.base import FlowServices, Stage
from tandem.state_machines.messages import Generation

__all__ = ["RolloutStateMachine"]


class RolloutStateMachine(Stage[Generation, TrajectoryGroup]):
    role = "rollout"

    def __init__(self, name: str, services: FlowServices, **channels: object) -> None:
        super().__init__(name, services, **channels)  # type: ignore[arg-type]
        self._partial: dict[int, dict[int, Trajectory]] = {}
        services.ledger.on_drop(self._forget)

    def _forget(self, prompt_id: int) -> None:
        self._partial.pop(prompt_id, None)

    async def process(self, items: list[Generation]) -> list[TrajectoryGroup]:
        ledger = self.services.ledger
        done: list[TrajectoryGroup] = []
        for gen in items:
            group = gen.group
            if not ledger.is_live(group.prompt_id):
                continue  # the group was dropped while this trajectory was being generated
            arrived = self._partial.setdefault(group.prompt_id, {})
            index = gen.trajectory.index
            if index in arrived:
                raise RuntimeError(f"prompt {group.prompt_id}: trajectory {index} delivered twice")
            arrived[index] = gen.trajectory
            if len(arrived) == group.n:
                del self._partial[group.prompt_id]
                done.append(TrajectoryGroup(group, [arrived[i] for i in range(group.n)]))
        return done
