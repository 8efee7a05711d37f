"""The logp role: recomputes proximal log-probs with the trainer's current weights.

Decoupled PPO needs pi_prox, the policy the trust region is centred on; the behaviour policy
pi_behav (the rollout engine's log-probs) may be several versions older. The version used is
recorded per sample. The flow puts this role under one lock with train (they share the
trainer's weights), so a score never straddles an optimizer step.
"""

from __future__ import annotations

from pipeline.records import RolloutGroup
from state_machines.base import Stage

__all__ = ["LogPStateMachine"]


class LogPStateMachine(Stage[RolloutGroup, RolloutGroup]):
    role = "logp"

    async def process(self, items: list[RolloutGroup]) -> list[RolloutGroup]:
        engine = self.services.components.trainer
        samples = [s for g in items for s in g.samples]
        version = engine.version
        logprobs = await engine.logprobs(samples)
        for sample, lp in zip(samples, logprobs, strict=True):
            if len(lp) != sample.num_tokens:
                raise ValueError(
                    f"prompt {sample.prompt_id} sample {sample.index}: {len(lp)} log-probs for "
                    f"{sample.num_tokens} tokens"
                )
            sample.prox_logprobs = lp
            sample.prox_version = version
        self.version = version
        return items
