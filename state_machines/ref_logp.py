"""The ref_logp role: log-probs of the frozen reference model, for the KL penalty."""

from __future__ import annotations

from pipeline.records import RolloutGroup
from state_machines.base import Stage

__all__ = ["RefLogPStateMachine"]


class RefLogPStateMachine(Stage[RolloutGroup, RolloutGroup]):
    role = "ref_logp"

    async def process(self, items: list[RolloutGroup]) -> list[RolloutGroup]:
        engine = self.services.components.reference
        if engine is None:
            raise RuntimeError("the ref_logp stage runs but the components have no reference engine")
        samples = [s for g in items for s in g.samples]
        logprobs = await engine.logprobs(samples)
        for sample, lp in zip(samples, logprobs, strict=True):
            if len(lp) != sample.num_tokens:
                raise ValueError(
                    f"prompt {sample.prompt_id} sample {sample.index}: {len(lp)} reference log-probs "
                    f"for {sample.num_tokens} tokens"
                )
            sample.ref_logprobs = lp
        return items
