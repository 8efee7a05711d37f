"""Fault injection in the fake engines (``engines.faults``): seeded failures and delays per role,
a generation call that fails part-way, and no effect at all when no fault is configured."""

from __future__ import annotations

import asyncio

import pytest

from tandem.algorithms import PolicyObjective
from tandem.core.config import AlgorithmConfig
from tandem.core.protocols import RolloutRequest
from tandem.core.records import FinishReason, PromptGroup, TaskItem, TrajectoryGroup, token_trajectory
from tandem.engines.fake import InjectedFault
from tandem.pipeline.builders import build_components
from tests.conftest import make_config, run_virtual

FIXED = {"type": "constant", "mean_s": 1.0}


def requests(n: int) -> list[RolloutRequest]:
    return [RolloutRequest(PromptGroup(0, TaskItem("p", [1, 2]), n), i, seed=0) for i in range(n)]


def group() -> TrajectoryGroup:
    trajectory = token_trajectory(0, 0, [1], [2], [-1.0], [0], FinishReason.STOP)
    return TrajectoryGroup(PromptGroup(0, TaskItem("p", [1], answer="3"), 1), [trajectory])


def test_a_failing_role_raises_injected_faults_and_a_delayed_one_takes_longer() -> None:
    cfg = make_config(engines={
        "train_step_latency": FIXED, "reward_latency": FIXED,
        "faults": {"train": {"failure_rate": 1.0}, "reward": {"delay_rate": 1.0, "delay": {"mean_s": 2.5}}},
    })
    components = build_components(cfg)

    async def scenario() -> float:
        with pytest.raises(InjectedFault, match="injected train fault #1"):
            await components.trainer.train_step(group().trajectories, PolicyObjective(AlgorithmConfig()))
        assert components.trainer.version == 0  # a failed step trains nothing
        loop = asyncio.get_running_loop()
        start = loop.time()
        await components.reward.score(group().trajectories, [group().group])
        return loop.time() - start

    assert run_virtual(scenario()) == pytest.approx(1.0 + 2.5)


def test_a_failing_generation_call_delivers_part_of_its_samples_first() -> None:
    cfg = make_config(engines={"generation_latency": FIXED, "faults": {"generate": {"failure_rate": 1.0}}})
    rollout = build_components(cfg).workflow

    async def scenario() -> int:
        delivered = 0
        with pytest.raises(InjectedFault, match="injected generate fault"):
            async for _ in rollout.rollout(requests(8)):
                delivered += 1
        return delivered

    assert 0 <= run_virtual(scenario()) < 8


def test_a_failing_sync_keeps_the_old_weights_serving() -> None:
    cfg = make_config(engines={"faults": {"param_update": {"failure_rate": 1.0}}})
    components = build_components(cfg)

    async def scenario() -> None:
        with pytest.raises(InjectedFault):
            await components.weight_sync.sync(1)

    run_virtual(scenario())
    assert components.workflow.version == 0  # type: ignore[attr-defined]


def test_a_fault_spec_with_zero_rates_changes_nothing() -> None:
    lognormal = {"type": "lognormal", "mean_s": 1.0, "sigma": 1.0}
    plain = make_config(engines={"generation_latency": lognormal})
    idle = make_config(engines={"generation_latency": lognormal, "faults": {"generate": {"delay": {"mean_s": 5.0}}}})

    async def deliveries(cfg: object) -> list[tuple[int, int, float]]:
        rollout = build_components(cfg).workflow  # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        return [(s.index, s.num_actions, loop.time()) async for s in rollout.rollout(requests(16))]

    assert run_virtual(deliveries(plain)) == run_virtual(deliveries(idle))


def test_an_unknown_fault_role_is_named() -> None:
    from tandem.core.config import ConfigError

    with pytest.raises(ConfigError, match="engines.fake.faults.rollout"):
        make_config(engines={"faults": {"rollout": {"failure_rate": 0.1}}})
