"""The logp role: recomputes proximal log-probs with the trainer's current weights.

Decoupled PPO needs pi_prox, the policy the trust region is centred on; the behaviour policy
pi_behav (the rollout engine's log-probs) may be several versions older. The version used is
recorded per sample. The flow puts this role under one lock with train (they share the
trainer's weights), so a score never straddles an optimizer step.
"""

from __future__ import annotations

from core.protocols import LogProbEngine
from core.records import RolloutGroup, Sample
from state_machines.base import Stage

__all__ = ["LogPStateMachine", "score"]


class LogPStateMachine(Stage[RolloutGroup, RolloutGroup]):
    role = "logp"

    async def process(self, items: list[RolloutGroup]) -> list[RolloutGroup]:
        engine = self.services.components.trainer
        version = engine.version
        for sample, lp in await score(engine, items, "log-probs"):
            sample.prox_logprobs = lp
            sample.prox_version = version
        self.version = version
        return items


async def score(engine: LogProbEngine, items: list[RolloutGroup], what: str) -> list[tuple[Sample, list[float]]]:
    """Each sample of ``items`` with its per-token log-probs under ``engine``, one per token
    (an engine returning any other count is an error naming the sample)."""
    samples = [s for g in items for s in g.samples]
    scored = list(zip(samples, await engine.logprobs(samples), strict=True))
    for sample, lp in scored:
        if len(lp) != sample.num_tokens:
            raise ValueError(
                f"prompt {sample.prompt_id} sample {sample.index}: {len(lp)} {what} for {sample.num_tokens} tokens"
            )
    return scored
