"""Properties of the flow under random timing and random faults (hypothesis, virtual clock).

Whatever the per-stage delays, the staleness bound, the micro-batching, the channel sizes and
the faults (random exceptions and extra delays in every role's engine calls, weight syncs
included, injected by the fake engines from ``engines.faults``): every sample trained in step
t started at version >= t - k, where k is the bound in force when its group was admitted (never
above the configured one); no channel ever held more than its capacity; every admitted prompt
group was trained exactly once or dropped with a reason by a role that had faults; every step
trained a full batch; a failing weight sync never stopped the run; and with k = 0 and no
faults, step t trained exactly the t-th block of prompts.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.core.config import FAULT_ROLES
from tandem.pipeline import AsyncTrainingFlow
from tandem.pipeline.builders import build_components
from tests.conftest import make_config, run_virtual
from tests.unit.pipeline.test_flow import RecordingTrain, RecordingTrainer

latencies = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["constant", "uniform", "exponential", "lognormal"]),
        "mean_s": st.sampled_from([0.0, 0.01, 0.1, 0.5, 1.0, 3.0]),
        "sigma": st.sampled_from([0.2, 0.5, 1.0, 1.5]),
    }
)
faults = st.fixed_dictionaries(
    {
        "failure_rate": st.sampled_from([0.0, 0.0, 0.05, 0.2, 0.4]),
        "delay_rate": st.sampled_from([0.0, 0.3, 1.0]),
        "delay": latencies,
    }
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
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
    fault_specs=st.dictionaries(st.sampled_from(FAULT_ROLES), faults, max_size=len(FAULT_ROLES)),
    stages=st.sampled_from([["logp", "ref_logp", "reward"], ["logp", "reward"], ["reward"]]),
    retries=st.integers(0, 2),
    degrade_after=st.sampled_from([None, 1, 2]),
    seed=st.integers(0, 2**16),
)
def test_invariants_hold_under_random_timing_and_faults(
    k: int, prompts_per_step: int, n: int, steps: int, micro_batch: int, capacity: int, slots: int,
    gen: dict, train: dict, logp: dict, reward: dict, sync: dict, fault_specs: dict, stages: list[str],
    retries: int, degrade_after: int | None, seed: int,
) -> None:
    policy = {"on_error": "drop", "max_retries": retries, "retry_backoff_s": 0.01}
    cfg = make_config(
        run={"max_steps": steps, "seed": seed},
        train={"prompts_per_step": prompts_per_step},
        rollout={"samples_per_prompt": n},
        staleness={"max_staleness": k, "degrade_after_sync_failures": degrade_after},
        flow={
            "stages": ["dataloader", "generate", "rollout", *stages, "train"],
            "micro_batch_size": micro_batch, "channel_capacity": capacity,
            "custom_stages": {"train": "tests.unit.pipeline.test_flow:RecordingTrain"},
        },
        roles={role: policy for role in FAULT_ROLES},
        engines={
            "generation_slots": slots, "generation_latency": gen, "train_step_latency": train,
            "logp_latency": logp, "reward_latency": reward, "sync_latency": sync, "faults": fault_specs,
        },
    )
    components = build_components(cfg)
    trainer = RecordingTrainer(components.trainer)  # type: ignore[arg-type]
    components.trainer = trainer
    flow = AsyncTrainingFlow(cfg, components)
    result = run_virtual(flow.run())
    train = next(m for m in flow.machines if isinstance(m, RecordingTrain))
    batches = [train.groups(batch) for batch in trainer.batches]
    failing = {role for role, spec in fault_specs.items() if spec["failure_rate"] > 0}

    # Staleness: every token of a group trained at step t was sampled at version >= t - k_admitted.
    assert len(batches) == steps
    for t, batch in enumerate(batches):
        assert len(batch) == prompts_per_step
        for group in batch:
            assert group.step == t
            assert 0 <= group.group.admitted_k <= k
            for sample in group.trajectories:
                assert sample.start_version >= t - group.group.admitted_k
                assert sample.versions == sorted(sample.versions)
                assert len(sample.versions) == len(sample.payload.response_ids) == len(sample.behaviour_logprobs)
    # Backpressure: no channel ever exceeded its capacity.
    assert all(ch.max_depth <= ch.capacity for ch in result.channels.values())
    # Exactly once: trained once, or dropped with a reason; nothing in flight at the end.
    trained = [g.prompt_id for batch in batches for g in batch]
    dropped = [d.prompt_id for d in result.drops]
    assert len(set(trained)) == len(trained)
    assert not set(trained) & set(dropped)
    # The train role also calls the logp engine (it rescores stale proximal log-probs), so its
    # drops may come from logp's faults.
    calls = {role: {role} for role in failing} | {"train": {"train", "logp"} & failing}
    assert all(d.reason.startswith("InjectedFault") and calls.get(d.stage) for d in result.drops)
    assert result.ledger["balanced"] and result.ledger["in_flight"] == 0
    assert result.ledger["admitted"] == len(trained) + len(dropped)
    # Degradation: only after failed syncs, and every step trained under the bound then in force.
    assert all(m.staleness_bound == (0 if m.degraded else k) for m in result.mode_changes)
    assert [m.degraded for m in result.mode_changes] == [True, False] * (len(result.mode_changes) // 2) + [True] * (
        len(result.mode_changes) % 2
    )
    if "param_update" not in failing or degrade_after is None:
        assert not result.mode_changes
    assert all(0 <= s.staleness_bound <= k and max(s.staleness) <= k for s in result.steps)
    if not failing:
        assert not dropped
    if k == 0 and not dropped:
        for t, batch in enumerate(batches):
            assert sorted(g.prompt_id for g in batch) == list(range(t * prompts_per_step, (t + 1) * prompts_per_step))
