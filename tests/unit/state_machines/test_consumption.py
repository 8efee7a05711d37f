"""Staleness at consumption, dynamic sampling, reward shaping and lag records: the gate's refill
bound, regeneration and moves, the ledger's reassignment, and the train role's own decisions."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry, Histogram

from tandem.core.history import RunHistory, StepRecord
from tandem.core.ledger import Ledger
from tandem.core.records import FinishReason, PromptGroup, TaskItem, TokenPayload, Trajectory, TrajectoryGroup
from tandem.core.staleness import StalenessGate, VersionClock
from tandem.core.trace import TraceRecorder
from tandem.pipeline import AsyncTrainingFlow
from tandem.pipeline.builders import build_components
from tandem.pipeline.metrics import FlowMetrics, StepHistogram
from tandem.state_machines.base import FlowServices
from tandem.state_machines.train import TrainStateMachine
from tests.conftest import make_config, run_virtual
from tests.unit.pipeline.test_flow import recording


def gate(k: int, per_step: int, refill_bound: int | None) -> StalenessGate:
    return StalenessGate(VersionClock(), k, per_step, 10, 100, refill_bound=refill_bound)


async def load(g: StalenessGate, version: int) -> None:
    await g.clock.advance_trained(version)
    await g.clock.set_loaded(version)


def group_of(step: int, prompt_id: int = 0) -> PromptGroup:
    return PromptGroup(prompt_id, TaskItem("p", [1]), 1, step=step, admitted_version=0, admitted_k=2)


def test_a_slot_given_back_is_refilled_only_under_the_refill_bound() -> None:
    async def scenario() -> None:
        g = gate(k=2, per_step=1, refill_bound=0)
        assert [g.try_admit().step for _ in range(3)] == [0, 1, 2]  # type: ignore[union-attr]
        await g.release(2)
        assert g.try_admit() is None  # step 2 refills only once the rollout serves version 2
        await load(g, 1)
        assert g.try_admit() is None
        await load(g, 2)
        refill = g.try_admit()
        assert refill is not None and (refill.step, refill.version, refill.k) == (2, 2, 0)
        assert g.try_admit().k == 2  # type: ignore[union-attr]  # a fresh step: the configured bound

    run_virtual(scenario())


def test_without_a_refill_bound_a_slot_refills_under_the_bound_in_force() -> None:
    async def scenario() -> None:
        g = gate(k=2, per_step=1, refill_bound=None)
        for _ in range(3):
            g.try_admit()
        await g.release(2)
        again = g.try_admit()
        assert again is not None and (again.step, again.k) == (2, 2)

    run_virtual(scenario())


def test_a_regeneration_keeps_its_slot_and_waits_for_the_refill_bound() -> None:
    async def scenario() -> None:
        g = gate(k=3, per_step=1, refill_bound=1)
        for _ in range(4):
            g.try_admit()
        stale = group_of(step=3)
        await g.regenerate(stale)
        waiter = asyncio.ensure_future(g.next_regeneration())
        await load(g, 1)
        await asyncio.sleep(1)
        assert not waiter.done()  # step 3 needs version >= 2 loaded
        await load(g, 2)
        again = await asyncio.wait_for(waiter, 1)
        assert again is stale and (again.step, again.admitted_version, again.admitted_k) == (3, 2, 1)
        assert g.in_flight == 4  # the slot was kept: nothing admitted or released

    run_virtual(scenario())


def test_regeneration_needs_a_refill_bound() -> None:
    async def scenario() -> None:
        with pytest.raises(ValueError, match="refill bound"):
            await gate(k=1, per_step=1, refill_bound=None).regenerate(group_of(step=1))

    run_virtual(scenario())


def test_a_withheld_group_moves_its_slot_to_the_next_step_only_when_there_is_room() -> None:
    async def scenario() -> None:
        g = gate(k=2, per_step=2, refill_bound=0)
        assert [g.try_admit().step for _ in range(3)] == [0, 0, 1]  # type: ignore[union-attr]
        assert await g.move(0, 1)  # step 1 had a free slot: it is taken, step 0's is given back
        assert g.in_flight == 3
        assert not await g.move(0, 1)  # step 1 is full now
        assert not await g.move(9, 10)  # past the run
        refill = g.try_admit()  # version 0 is loaded: step 0 is within the refill bound 0
        assert refill is not None and (refill.step, refill.k) == (0, 0)

    run_virtual(scenario())


def test_a_reassigned_group_gives_back_its_new_steps_slot_when_dropped() -> None:
    async def scenario() -> None:
        g = gate(k=2, per_step=1, refill_bound=None)
        ledger = Ledger(g)
        admission = g.try_admit()
        assert admission is not None
        ledger.admit(7, admission.step)
        g.try_admit()  # step 1 full
        await g.move(0, 2)
        ledger.reassign(7, 2)
        await ledger.drop(7, "train", "test")
        assert ledger.drops[0].step == 2 and ledger.balanced
        refill = g.try_admit()
        assert refill is not None and refill.step == 0  # step 0's slot was given back by the move
        assert g.try_admit().step == 2  # type: ignore[union-attr]  # and step 2's by the drop

    run_virtual(scenario())


def services(**sections: dict) -> FlowServices:
    cfg = make_config(**sections)
    clock = VersionClock()
    g = StalenessGate(clock, cfg.staleness.k, cfg.train.prompts_per_step, cfg.run.max_steps, 100)
    return FlowServices(cfg, clock, g, Ledger(g), build_components(cfg), TraceRecorder(0.0, 1000), RunHistory())


def trajectory(index: int, actions: int, reward: float, finish: FinishReason = FinishReason.STOP, **fields: object) -> Trajectory:
    return Trajectory(
        prompt_id=0, index=index, behaviour_logprobs=[-1.0] * actions, versions=[0] * actions, start_version=0,
        finish_reason=finish, payload=TokenPayload([1], [3] * actions), reward=reward, **fields,  # type: ignore[arg-type]
    )


def batch_of(*trajectories: Trajectory) -> list[TrajectoryGroup]:
    group = PromptGroup(0, TaskItem("p", [1]), len(trajectories), step=0)
    return [TrajectoryGroup(group, list(trajectories))]


def train_role(**sections: dict) -> TrainStateMachine:
    async def build() -> TrainStateMachine:
        return TrainStateMachine("train", services(**sections))

    return run_virtual(build())


def test_dapos_soft_overlong_penalty_shapes_the_rewards_advantages_see() -> None:
    # max_new_tokens 10, buffer 4: no penalty up to 6 tokens, -1/4 per token after, -1 at 10.
    role = train_role(rollout={"max_new_tokens": 10}, algorithm={"overlong_buffer": 4})
    batch = batch_of(trajectory(0, 6, 1.0), trajectory(1, 8, 1.0), trajectory(2, 10, 0.0))
    assert role.shaped_rewards(batch[0]) == [1.0, 0.5, -1.0]
    advantages = [t.advantage for t in role.advantages(batch)]
    assert advantages[0] > advantages[1] > advantages[2]  # GRPO over the shaped rewards, not the raw ones


def test_overlong_filtering_masks_cut_responses_out_of_the_policy_loss_only() -> None:
    role = train_role(algorithm={"overlong_filter": True})
    cut, whole = trajectory(0, 3, 0.0, FinishReason.LENGTH), trajectory(1, 2, 1.0)
    trained, filtered = role.overlong_filtered([cut, whole])
    assert filtered == 1 and trained[0].loss_mask == [0, 0, 0] and trained[0].num_trained == 0
    assert trained[1] is whole and cut.loss_mask is None  # the original is kept for the critic
    everything_cut = [cut, replace(whole, finish_reason=FinishReason.LENGTH)]
    assert role.overlong_filtered(everything_cut) == (everything_cut, 0)  # nothing would be left to train


def test_gae_advantages_and_returns_by_hand() -> None:
    # gamma 1, lambda 1: A_t = R - V_t and the return is R at every action.
    #   trajectory 0: values [0.5, 0.5], reward 1 -> A = [0.5, 0.5], returns [1, 1]
    #   trajectory 1: values [0.25],     reward 0 -> A = [-0.25],    returns [0]
    # Whitened over the step's three actions: mean 0.25, unbiased std sqrt(0.1875).
    role = train_role(
        flow={"stages": ["dataloader", "generate", "rollout", "critic", "reward", "train"]},
        algorithm={"advantage": "gae", "gae_gamma": 1.0, "gae_lambda": 1.0},
    )
    batch = batch_of(trajectory(0, 2, 1.0, values=[0.5, 0.5]), trajectory(1, 1, 0.0, values=[0.25]))
    first, second = role.advantages(batch)
    std = math.sqrt(0.1875)
    assert first.token_advantages == pytest.approx([0.25 / std, 0.25 / std])
    assert second.token_advantages == pytest.approx([-0.5 / std])
    assert (first.returns, second.returns) == ([1.0, 1.0], [0.0])


def test_gae_refuses_trajectories_the_critic_did_not_score() -> None:
    role = train_role(
        flow={"stages": ["dataloader", "generate", "rollout", "critic", "reward", "train"]},
        algorithm={"advantage": "gae"},
    )
    with pytest.raises(ValueError, match="without the critic's values"):
        role.advantages(batch_of(trajectory(0, 2, 1.0)))


@pytest.mark.parametrize("proximal", ["recompute", "current", "behaviour"])
def test_only_a_recomputed_proximal_policy_is_rescored_at_the_train_step(proximal: str) -> None:
    cfg = make_config(algorithm={"proximal": proximal}, staleness={"max_staleness": 1}, run={"max_steps": 4})
    components, trainer = recording(cfg)
    result = run_virtual(AsyncTrainingFlow(cfg, components).run())
    assert ("prox_rescored_fraction" in result.steps[0].train_metrics) == (proximal == "recompute")
    assert trainer.batches  # the step trained either way


def test_every_trained_trajectory_has_its_lag_recorded_and_observed() -> None:
    cfg = make_config(staleness={"max_staleness": 2}, run={"max_steps": 6})
    components, trainer = recording(cfg)
    result = run_virtual(AsyncTrainingFlow(cfg, components).run())
    for record, batch in zip(result.steps, trainer.batches, strict=True):
        assert len(record.trajectory_staleness) == len(record.version_span) == record.samples == len(batch)
        assert len(record.in_flight_s) == len(record.queued_s) == record.samples
        assert record.trajectory_staleness == [record.step - t.start_version for t in batch]
        assert record.version_span == [max(t.versions) - min(t.versions) for t in batch]
        assert all(0 <= s <= 2 for s in record.trajectory_staleness)
        assert all(s >= 0 for s in record.in_flight_s) and all(s >= 0 for s in record.queued_s)
        assert any(s > 0 for s in record.in_flight_s)  # generation takes time on these engines
        assert record.value_staleness == [] and record.consumption == {}
    assert any(span > 0 for r in result.steps for span in r.version_span)  # partial rollouts happen at k = 2

    async def observe() -> FlowMetrics:
        clock = VersionClock()
        g = StalenessGate(clock, 1, 1, 1, 1)
        metrics = FlowMetrics([], [], clock, Ledger(g), g, 0.0)
        for record in result.steps:
            metrics.observe_step(record)
        return metrics

    registry = run_virtual(observe()).registry
    samples = sum(r.samples for r in result.steps)
    for name in ("tandem_trajectory_staleness", "tandem_trajectory_version_span",
                 "tandem_trajectory_in_flight_seconds", "tandem_trajectory_queued_seconds"):
        assert registry.get_sample_value(f"{name}_count") == samples, name
    assert registry.get_sample_value("tandem_value_staleness_count") == 0


def test_the_step_rows_carry_the_lag_and_the_consumption_counts() -> None:
    row = StepRecord(
        step=3, time_s=1.0, step_time_s=0.5, groups=1, samples=2, tokens=4, reward_mean=0.5, staleness=[1],
        loaded_version=3, staleness_bound=1, prompt_ids=[9], trajectory_staleness=[1, 0], version_span=[1, 0],
        in_flight_s=[0.25, 0.5], queued_s=[0.1, 0.2], consumption={"filtered": 2},
    ).to_json()
    assert row["trajectory_staleness"] == [1, 0] and row["queued_s"] == [0.1, 0.2]
    assert row["consumption"] == {"filtered": 2} and row["value_staleness"] == []


def test_a_step_histogram_counts_as_prometheus_own_histogram_does() -> None:
    buckets = (0, 1, 2.5, 10)
    steps = [[0, 1, 1, 3.5], [], [2.5, 11, 0.2], [10]]
    ours = StepHistogram("ours", "test", buckets)
    registry = CollectorRegistry()
    theirs = Histogram("theirs", "test", buckets=buckets, registry=registry)
    for values in steps:
        ours.observe_all(values)
        for value in values:
            theirs.observe(value)
    expected = {(s.name.removeprefix("theirs"), tuple(s.labels.items())): s.value
                for s in next(iter(registry.collect())).samples if not s.name.endswith("_created")}
    got = {(s.name.removeprefix("ours"), tuple(s.labels.items())): s.value for s in ours.family().samples}
    assert got == expected
