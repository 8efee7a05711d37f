"""Properties of the flow under random timing and random faults (hypothesis, virtual clock).

Whatever the per-stage delays, the staleness bound, the micro-batching, the channel sizes and
the faults: every sample trained in step t started at version >= t - k; no channel ever held
more than its capacity; every admitted prompt group was trained exactly once or dropped with
a reason; every step trained a full batch; and with k = 0 and no faults, step t trained
exactly the t-th block of prompts.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engines.fake import FakeReward, build_fake_components
from engines.protocols import RewardResult
from pipeline import AsyncTrainingFlow
from pipeline.records import Sample
from tests.conftest import make_config, run_virtual
from tests.unit.pipeline.test_flow import RecordingTrainer

latencies = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["constant", "uniform", "exponential", "lognormal"]),
        "mean_s": st.sampled_from([0.0, 0.01, 0.1, 0.5, 1.0, 3.0]),
        "sigma": st.sampled_from([0.2, 0.5, 1.0, 1.5]),
    }
)


class FlakyReward:
    """The fake reward, raising on a seeded fraction of its calls."""

    def __init__(self, inner: FakeReward, failure_rate: float, seed: int) -> None:
        self._inner = inner
        self._rate = failure_rate
        self._rng = random.Random(seed)
        self.failures = 0

    async def score(self, samples: Sequence[Sample], answers: Sequence[str | None]) -> list[RewardResult]:
        if self._rng.random() < self._rate:
            self.failures += 1
            raise RuntimeError("injected reward fault")
        return await self._inner.score(samples, answers)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    k=st.integers(0, 3),
    prompts_per_step=st.integers(1, 8),
    n=st.integers(1, 4),
    steps=st.integers(3, 20),
    micro_batch=st.integers(1, 8),
    capacity=st.integers(1, 16),
    slots=st.integers(1, 64),
    gen=latencies,
    train=latencies,
    logp=latencies,
    reward=latencies,
    sync=latencies,
    failure_rate=st.sampled_from([0.0, 0.0, 0.1, 0.3]),
    retries=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_invariants_hold_under_random_timing_and_faults(
    k: int, prompts_per_step: int, n: int, steps: int, micro_batch: int, capacity: int, slots: int,
    gen: dict, train: dict, logp: dict, reward: dict, sync: dict, failure_rate: float, retries: int, seed: int,
) -> None:
    cfg = make_config(
        run={"max_steps": steps, "seed": seed},
        staleness={"max_staleness": k},
        train={"prompts_per_step": prompts_per_step},
        rollout={"samples_per_prompt": n},
        flow={"micro_batch_size": micro_batch, "channel_capacity": capacity},
        roles={"reward": {"on_error": "drop", "max_retries": retries, "retry_backoff_s": 0.01}},
        engines={
            "generation_slots": slots, "generation_latency": gen, "train_step_latency": train,
            "logp_latency": logp, "reward_latency": reward, "sync_latency": sync,
        },
    )
    components = build_fake_components(cfg)
    trainer = RecordingTrainer(components.trainer)  # type: ignore[arg-type]
    components.trainer = trainer
    flaky = FlakyReward(components.reward, failure_rate, seed)  # type: ignore[arg-type]
    components.reward = flaky
    result = run_virtual(AsyncTrainingFlow(cfg, components).run())

    # Staleness: every token of a group trained at step t was sampled at version >= t - k.
    assert len(trainer.batches) == steps
    for t, batch in enumerate(trainer.batches):
        assert len(batch) == prompts_per_step
        for group in batch:
            assert group.step == t
            for sample in group.samples:
                assert sample.start_version >= t - k
                assert sample.token_versions == sorted(sample.token_versions)
                assert len(sample.token_versions) == len(sample.response_ids) == len(sample.behaviour_logprobs)
    # Backpressure: no channel ever exceeded its capacity.
    assert all(ch.max_depth <= ch.capacity for ch in result.channels.values())
    # Exactly once: trained once, or dropped with a reason; nothing in flight at the end.
    trained = [g.prompt_id for batch in trainer.batches for g in batch]
    dropped = [d.prompt_id for d in result.drops]
    assert len(set(trained)) == len(trained)
    assert not set(trained) & set(dropped)
    assert all(d.reason and d.stage == "reward" for d in result.drops)
    assert result.ledger["balanced"] and result.ledger["in_flight"] == 0
    assert result.ledger["admitted"] == len(trained) + len(dropped)
    if failure_rate == 0.0:
        assert not dropped
    if k == 0 and not dropped:
        for t, batch in enumerate(trainer.batches):
            assert sorted(g.prompt_id for g in batch) == list(range(t * prompts_per_step, (t + 1) * prompts_per_step))
