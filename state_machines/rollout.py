"""The rollout role: assembles finished samples into complete prompt groups.

Samples of one group finish at different times (the long tail); GRPO needs the whole group,
so a group leaves only when all ``n`` samples are in, ordered by index. Partial groups are
bounded by the groups in flight, and a group dropped anywhere is discarded here too.
"""

from __future__ import annotations

from core.records import RolloutGroup, Sample
from state_machines.base import FlowServices, Stage
from state_machines.messages import Generation

__all__ = ["RolloutStateMachine"]


class RolloutStateMachine(Stage[Generation, RolloutGroup]):
    role = "rollout"

    def __init__(self, name: str, services: FlowServices, **channels: object) -> None:
        super().__init__(name, services, **channels)  # type: ignore[arg-type]
        self._partial: dict[int, dict[int, Sample]] = {}
        services.ledger.on_drop(self._forget)

    def _forget(self, prompt_id: int) -> None:
        self._partial.pop(prompt_id, None)

    async def process(self, items: list[Generation]) -> list[RolloutGroup]:
        ledger = self.services.ledger
        done: list[RolloutGroup] = []
        for gen in items:
            group = gen.group
            if not ledger.is_live(group.prompt_id):
                continue  # the group was dropped while this sample was being generated
            samples = self._partial.setdefault(group.prompt_id, {})
            if gen.sample.index in samples:
                raise RuntimeError(f"prompt {group.prompt_id}: sample {gen.sample.index} delivered twice")
            samples[gen.sample.index] = gen.sample
            if len(samples) == group.n:
                del self._partial[group.prompt_id]
                done.append(RolloutGroup(group, [samples[i] for i in range(group.n)]))
        return done
