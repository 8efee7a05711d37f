"""Staleness at consumption and dynamic sampling under random timing and faults (hypothesis, virtual clock).

For each consumption policy (train, drop, recompute, withhold), whatever the delays, bounds,
batch shapes and faults: every step trains a full batch of its own groups; no trained group is
staler than its admission bound, and none staler than the consumption bounds unless the policy
keeps stale groups on purpose (train, or a withheld group); the ledger balances with nothing in
flight; every drop is a stale group (drop, or withhold with no room next step) or an injected
fault; and refills are capped: a group is judged stale at most once (a refill or regeneration
is admitted under the consumption bound), so no step judges more groups stale than it has
slots. With dynamic sampling, no step drops more equal-reward groups than its refill bound, and
every equal-reward group it trains is counted as such.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.core.records import TrajectoryGroup
from tandem.pipeline import AsyncTrainingFlow
from tests.conftest import make_config, run_virtual
from tests.unit.pipeline.test_flow import RecordingTrain, recording
from tests.unit.pipeline.test_flow_properties import latencies


class JudgingTrain(RecordingTrain):
    """The train role, recording every judgement on arrival: (prompt id, its step then, the stale
    reason if any, the step it was held for or None)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.judged: list[tuple[int, int, str | None, int | None]] = []
        accept = self.consumption.accept

        async def judging(group: TrajectoryGroup) -> int | None:
            step, reason = group.step, self.consumption.stale_reason(group)
            held = await accept(group)
            self.judged.append((group.prompt_id, step, reason, held))
            return held

        self.consumption.accept = judging  # type: ignore[method-assign]


bounds = st.integers(1, 3).flatmap(
    lambda k: st.tuples(
        st.just(k),
        st.one_of(st.none(), st.integers(0, k - 1)),
        st.one_of(st.none(), st.integers(0, k - 1)),
    ).filter(lambda b: b[1] is not None or b[2] is not None)
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    bound=bounds,
    policy=st.sampled_from(["train", "drop", "recompute", "withhold"]),
    prompts_per_step=st.integers(1, 6),
    n=st.integers(1, 3),
    steps=st.integers(3, 12),
    slots=st.integers(1, 32),
    gen=latencies,
    train=latencies,
    sync=latencies,
    delay=latencies,
    delay_rate=st.sampled_from([0.0, 0.3, 1.0]),
    failure_rate=st.sampled_from([0.0, 0.0, 0.1]),
    seed=st.integers(0, 2**16),
)
def test_consumption_policies_keep_the_bounds_the_ledger_and_the_refill_cap(
    bound: tuple[int, int | None, int | None], policy: str, prompts_per_step: int, n: int, steps: int, slots: int,
    gen: dict, train: dict, sync: dict, delay: dict, delay_rate: float, failure_rate: float, seed: int,
) -> None:
    k, c, span = bound
    fault = {"failure_rate": failure_rate, "delay_rate": delay_rate, "delay": delay}
    cfg = make_config(
        run={"max_steps": steps, "seed": seed},
        train={"prompts_per_step": prompts_per_step},
        rollout={"samples_per_prompt": n},
        staleness={"max_staleness": k, "max_consumption_staleness": c, "max_version_span": span, "on_stale": policy},
        flow={"custom_stages": {"train": "tests.unit.pipeline.test_consumption_properties:JudgingTrain"}},
        roles={role: {"on_error": "drop", "max_retries": 1, "retry_backoff_s": 0.01} for role in ("generate", "reward")},
        engines={
            "generation_slots": slots, "generation_latency": gen, "train_step_latency": train, "sync_latency": sync,
            "faults": {"generate": fault, "reward": fault},
        },
    )
    components, trainer = recording(cfg)
    flow = AsyncTrainingFlow(cfg, components)
    result = run_virtual(flow.run())
    role = next(m for m in flow.machines if isinstance(m, JudgingTrain))
    batches = [role.groups(batch) for batch in trainer.batches]
    withheld = {pid for pid, step, reason, held in role.judged if reason and held is not None and held != step}

    assert len(batches) == steps
    for t, batch in enumerate(batches):
        assert len(batch) == prompts_per_step and all(g.step == t for g in batch)
        for group in batch:
            staleness = t - group.oldest_version
            assert staleness <= group.group.admitted_k <= k
            if policy in ("drop", "recompute") or (policy == "withhold" and group.prompt_id not in withheld):
                assert c is None or staleness <= c
                assert span is None or all(max(s.versions) - min(s.versions) <= span for s in group.trajectories)
    # The ledger balances: trained once or dropped once, nothing left in flight.
    trained = [g.prompt_id for batch in batches for g in batch]
    dropped = [d.prompt_id for d in result.drops]
    assert len(set(trained)) == len(trained) and not set(trained) & set(dropped)
    assert result.ledger["balanced"] and result.ledger["in_flight"] == 0
    assert result.ledger["admitted"] == len(trained) + len(dropped)
    stale_drops = {pid for pid, _, reason, held in role.judged if reason and held is None and policy != "recompute"}
    for drop in result.drops:
        assert drop.reason.startswith("InjectedFault") or (drop.stage == "train" and drop.prompt_id in stale_drops)
    if policy in ("train", "recompute"):
        assert all(d.reason.startswith("InjectedFault") for d in result.drops)
    # Refills are capped: a group is judged stale at most once, so a step at most once per slot.
    stale = [(pid, step) for pid, step, reason, _ in role.judged if reason]
    assert len({pid for pid, _ in stale}) == len(stale)
    assert max(Counter(step for _, step in stale).values(), default=0) <= prompts_per_step
    counted = Counter()
    for record in result.steps:
        counted.update(record.consumption)
    assert counted["stale"] == len(stale)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts_per_step=st.integers(1, 6),
    n=st.integers(1, 4),
    k=st.integers(0, 2),
    steps=st.integers(2, 10),
    max_refills=st.integers(1, 6),
    gen=latencies,
    seed=st.integers(0, 2**16),
)
def test_dynamic_sampling_refills_equal_reward_groups_within_its_bound(
    prompts_per_step: int, n: int, k: int, steps: int, max_refills: int, gen: dict, seed: int
) -> None:
    cfg = make_config(
        run={"max_steps": steps, "seed": seed},
        train={"prompts_per_step": prompts_per_step},
        rollout={"samples_per_prompt": n},
        staleness={"max_staleness": k},
        algorithm={"dynamic_sampling": True, "dynamic_sampling_max_refills": max_refills},
        engines={"generation_latency": gen},
    )
    components, trainer = recording(cfg)
    result = run_virtual(AsyncTrainingFlow(cfg, components).run())
    assert result.ledger["balanced"] and result.ledger["in_flight"] == 0
    assert {d.reason for d in result.drops} <= {"no reward variance (dynamic sampling)"}
    assert len(result.drops) == sum(s.consumption.get("filtered", 0) for s in result.steps)
    for record, batch in zip(result.steps, trainer.batches, strict=True):
        assert record.consumption.get("filtered", 0) <= max_refills
        rewards: dict[int, set[float]] = {}
        for sample in batch:
            rewards.setdefault(sample.prompt_id, set()).add(sample.reward)
        flat = sum(1 for values in rewards.values() if len(values) == 1)
        assert flat == record.consumption.get("zero_variance_trained", 0)
        if flat:  # equal-reward groups are trained only once the step's refills are spent
            assert record.consumption["filtered"] == max_refills
