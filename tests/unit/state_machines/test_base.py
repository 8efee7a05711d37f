"""StateMachine: legal transitions only, error policies, fair locks for colocated roles."""

from __future__ import annotations

import asyncio

import pytest

from tandem.core.channel import open_channel
from tandem.core.history import RunHistory
from tandem.core.ledger import Ledger
from tandem.core.records import PromptGroup, TaskItem
from tandem.core.staleness import StalenessGate, VersionClock
from tandem.core.trace import TraceRecorder
from tandem.pipeline.builders import build_components
from tandem.state_machines.base import FlowServices, Stage, StageError, State, StateMachine
from tests.conftest import make_config, run_virtual


def services(**roles: dict) -> FlowServices:
    cfg = make_config(roles=roles)
    clock = VersionClock()
    gate = StalenessGate(clock, 1, 4, 10, 100)
    return FlowServices(cfg, clock, gate, Ledger(gate), build_components(cfg), TraceRecorder(0.0, 1000), RunHistory())


class Flaky(Stage[PromptGroup, PromptGroup]):
    """Fails its first ``failures`` calls."""

    failures = 2
    calls = 0

    async def process(self, items: list[PromptGroup]) -> list[PromptGroup]:
        self.calls += 1
        if self.calls <= self.failures:
            raise RuntimeError(f"flaky call {self.calls}")
        return items


def admitted(svc: FlowServices, prompt_id: int) -> PromptGroup:
    slot = svc.gate.try_admit()
    assert slot is not None
    svc.ledger.admit(prompt_id, slot.step)
    return PromptGroup(prompt_id, TaskItem("p", [1]), 1, step=slot.step)


async def run_one(stage: Stage, items: list[PromptGroup]) -> list[PromptGroup]:
    out: list[PromptGroup] = []
    assert stage.inbox is not None and stage.outbox is not None
    tx, rx = stage._test_tx, stage._test_rx  # type: ignore[attr-defined]
    await tx.send_many(items)
    tx.close()
    await stage.run()
    async for item in rx:
        out.append(item)
    return out


def stage_with_channels(cls: type[Stage], svc: FlowServices, name: str = "reward") -> Stage:
    tx_in, rx_in = open_channel("in", 8)
    tx_out, rx_out = open_channel("out", 8)
    stage = cls(name, svc, inbox=rx_in, outbox=tx_out)
    stage._test_tx, stage._test_rx = tx_in, rx_out  # type: ignore[attr-defined]
    return stage


def test_retries_with_backoff_then_succeeds() -> None:
    async def scenario() -> None:
        svc = services(reward={"max_retries": 2, "retry_backoff_s": 0.5})
        stage = stage_with_channels(Flaky, svc)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        out = await run_one(stage, [admitted(svc, 0)])
        assert [g.prompt_id for g in out] == [0] and stage.calls == 3
        assert loop.time() - t0 >= 0.5 + 1.0  # exponential: 0.5 s, then 1 s
        assert stage.state is State.STOPPED

    run_virtual(scenario())


def test_fail_policy_raises_naming_stage_and_prompts() -> None:
    async def scenario() -> None:
        svc = services(reward={"max_retries": 1})
        stage = stage_with_channels(Flaky, svc)
        with pytest.raises(StageError, match=r"stage 'reward' failed on prompt\(s\) \[3\]: RuntimeError: flaky call 2"):
            await run_one(stage, [admitted(svc, 3)])
        assert stage.state is State.FAILED

    run_virtual(scenario())


def test_drop_policy_records_the_reason_and_frees_the_slot() -> None:
    async def scenario() -> None:
        svc = services(reward={"on_error": "drop"})
        stage = stage_with_channels(Flaky, svc)
        stage.micro_batch_size = 1
        groups = [admitted(svc, i) for i in range(3)]
        in_flight_before = svc.gate.in_flight
        out = await run_one(stage, groups)
        assert [g.prompt_id for g in out] == [2]
        assert [(d.prompt_id, d.stage, d.reason) for d in svc.ledger.drops] == [
            (0, "reward", "RuntimeError: flaky call 1"),
            (1, "reward", "RuntimeError: flaky call 2"),
        ]
        assert svc.gate.in_flight == in_flight_before - 2
        assert svc.ledger.balanced

    run_virtual(scenario())


def test_illegal_transitions_are_refused() -> None:
    async def scenario() -> None:
        sm = StateMachine("x", services())
        sm.set_state(State.RUNNING)
        sm.set_state(State.STOPPED)
        with pytest.raises(RuntimeError, match="illegal transition stopped -> running"):
            sm.set_state(State.RUNNING)
        assert sm.transitions[(State.IDLE, State.RUNNING)] == 1

    run_virtual(scenario())


def test_colocated_roles_take_turns_in_arrival_order() -> None:
    async def scenario() -> None:
        svc = services()
        lock = asyncio.Lock()
        order: list[str] = []

        async def unit(sm: StateMachine, tag: str) -> None:
            async def body() -> None:
                order.append(f"{tag}+")
                await asyncio.sleep(1)
                order.append(f"{tag}-")

            await sm.work([], body)

        a, b = StateMachine("generate", svc, lock=lock), StateMachine("train", svc, lock=lock)
        await asyncio.gather(unit(a, "g1"), unit(b, "t1"), unit(a, "g2"), unit(b, "t2"))
        assert order == ["g1+", "g1-", "t1+", "t1-", "g2+", "g2-", "t2+", "t2-"]
        assert b.state_seconds[State.PAUSED] > 0  # waiting for the device shows as PAUSED

    run_virtual(scenario())
