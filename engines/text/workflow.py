"""The single-turn text workflow: one completion per request from a token rollout engine.

What it owns: turning the flow's rollout requests (a group, a sample index, a seed) into the
token engine's generation requests with the run's sampling parameters, and passing the
finished trajectories through as they come. The prompt's tokens are the item's own: the
workload's data source tokenized them when it loaded the item.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from tandem.core.protocols import GenerationRequest, RolloutEngine, RolloutRequest, SamplingParams
from tandem.core.records import Trajectory

__all__ = ["SingleTurnWorkflow"]


class SingleTurnWorkflow:
    """Implements :class:`core.protocols.RolloutWorkflow` over a :class:`RolloutEngine`."""

    def __init__(self, engine: RolloutEngine, sampling: SamplingParams) -> None:
        self.engine = engine
        self.sampling = sampling

    def rollout(self, requests: Sequence[RolloutRequest]) -> AsyncIterator[Trajectory]:
        return self.engine.generate(
            [GenerationRequest(r.group.prompt_id, r.index, r.group.prompt_ids, self.sampling, r.seed) for r in requests]
        )
