"""The version clock and the admission gate: s <= loaded + k, the in-flight cap, refills."""

from __future__ import annotations

import asyncio

import pytest

from tandem.core.config import ConfigError, validate_config
from tandem.core.staleness import StalenessGate, StalenessViolation, SyncHealth, VersionClock
from tests.conftest import run_virtual


def gate(k: int, per_step: int = 2, max_steps: int = 10, cap: int = 100) -> StalenessGate:
    return StalenessGate(VersionClock(), k, per_step, max_steps, cap)


def test_versions_only_move_forward_and_loaded_never_passes_trained() -> None:
    async def scenario() -> None:
        clock = VersionClock()
        with pytest.raises(ValueError, match="loaded"):
            await clock.set_loaded(1)
        await clock.advance_trained(1)
        await clock.set_loaded(1)
        with pytest.raises(ValueError, match="forward"):
            await clock.advance_trained(1)
        with pytest.raises(ValueError, match="loaded"):
            await clock.set_loaded(0)
        assert clock.lag == 0

    run_virtual(scenario())


@pytest.mark.parametrize("k", [0, 1, 3])
def test_admits_steps_up_to_loaded_plus_k_then_waits_for_a_new_version(k: int) -> None:
    async def scenario() -> None:
        g = gate(k)
        slots = [g.try_admit() for _ in range(2 * (k + 1))]
        assert [s.step for s in slots if s] == [s for s in range(k + 1) for _ in range(2)]
        assert g.try_admit() is None  # step k + 1 needs version 1 loaded
        waiter = asyncio.ensure_future(g.admit())
        await asyncio.sleep(1)
        assert not waiter.done()
        await g.clock.advance_trained(1)
        await asyncio.sleep(1)
        assert not waiter.done()  # trained is not enough: the rollout must serve version 1
        await g.clock.set_loaded(1)
        admission = await asyncio.wait_for(waiter, 1)
        assert (admission.step, admission.version) == (k + 1, 1)

    run_virtual(scenario())


def test_in_flight_cap_and_completion() -> None:
    async def scenario() -> None:
        g = gate(k=3, per_step=2, cap=3)
        assert [g.try_admit() is not None for _ in range(4)] == [True, True, True, False]
        await g.complete(0, 2)
        assert g.try_admit() is not None and g.in_flight == 2

    run_virtual(scenario())


def test_a_released_slot_is_refilled_for_the_same_step() -> None:
    async def scenario() -> None:
        g = gate(k=0, per_step=2)
        a, b = g.try_admit(), g.try_admit()
        assert a and b and g.try_admit() is None
        await g.release(0)
        again = g.try_admit()
        assert again is not None and again.step == 0

    run_virtual(scenario())


def test_nothing_is_admitted_past_max_steps() -> None:
    async def scenario() -> None:
        g = gate(k=5, per_step=1, max_steps=2)
        assert [g.try_admit() is not None for _ in range(3)] == [True, True, False]

    run_virtual(scenario())


def test_check_reports_staleness_and_refuses_over_the_bound_the_group_was_admitted_under() -> None:
    assert StalenessGate.check(trained_step=5, oldest_version=4, prompt_id=9, k=1) == 1
    with pytest.raises(StalenessViolation, match="prompt 9.*staleness 2 > the bound 1"):
        StalenessGate.check(trained_step=5, oldest_version=3, prompt_id=9, k=1)
    with pytest.raises(StalenessViolation, match="staleness 1 > the bound 0"):
        StalenessGate.check(trained_step=5, oldest_version=4, prompt_id=9, k=0)


def test_a_lowered_bound_holds_new_admissions_and_raising_it_wakes_them() -> None:
    async def scenario() -> None:
        g = StalenessGate(VersionClock(), 1, 1, 100, 100, degrade_after=2, recover_after=2)
        first = g.try_admit()
        assert first is not None and (first.step, first.k) == (0, 1)
        assert not await g.sync_failed()  # one failure: still k = 1
        assert await g.sync_failed()  # two in a row: degraded, step 1 now needs version 1 loaded
        assert g.degraded and g.k == 0 and g.try_admit() is None
        waiter = asyncio.ensure_future(g.admit())
        assert not await g.sync_succeeded()  # one success: not yet
        await asyncio.sleep(1)
        assert not waiter.done()
        assert await g.sync_succeeded()  # recovered: step 1 is within loaded 0 + 1 again
        admission = await asyncio.wait_for(waiter, 1)
        assert (admission.step, admission.version, admission.k) == (1, 0, 1)
        assert (g.syncs.failures, g.syncs.degradations, g.degraded) == (2, 1, False)

    run_virtual(scenario())


def test_a_gate_that_never_degrades_only_counts_failures() -> None:
    async def scenario() -> None:
        g = gate(k=1, per_step=1)
        for _ in range(5):
            assert not await g.sync_failed()
        assert (g.k, g.degraded, g.syncs.failures, g.syncs.failures_in_a_row) == (1, False, 5, 5)
        await g.sync_succeeded()
        assert g.syncs.failures_in_a_row == 0

    run_virtual(scenario())


def test_a_restored_record_puts_its_bound_back_in_force() -> None:
    async def scenario() -> None:
        g = StalenessGate(VersionClock(), 2, 1, 100, 100, degrade_after=1)
        await g.restore(SyncHealth(failures=3, failures_in_a_row=1, degraded=True, degradations=1))
        assert (g.k, g.degraded, g.syncs.failures) == (0, True, 3)
        assert await g.sync_succeeded() and g.k == 2

    run_virtual(scenario())


@pytest.mark.parametrize(
    ("knob", "value", "k"),
    [
        ("max_staleness", 2, 2),
        ("max_head_offpolicyness", 2, 2),
        ("async_generation_ratio", 2.0, 2),
        ("generate_ahead_steps", 3, 2),
        ("generate_ahead_steps", 1, 0),
    ],
)
def test_peer_aliases_mean_the_same_bound(knob: str, value: float, k: int) -> None:
    assert validate_config({"staleness": {knob: value}}).staleness.k == k


def test_default_bound_is_one_step_and_cap_is_k_plus_one_batches() -> None:
    cfg = validate_config({"train": {"prompts_per_step": 3}})
    assert cfg.staleness.k == 1 and cfg.max_concurrent == 6


@pytest.mark.parametrize(
    ("staleness", "message"),
    [
        ({"max_staleness": 1, "max_head_offpolicyness": 2}, "disagree"),
        ({"async_generation_ratio": 0.5}, "whole number"),
        ({"max_staleness": -1}, "staleness.max_staleness"),
    ],
)
def test_bad_staleness_settings_fail_naming_the_field(staleness: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate_config({"staleness": staleness})
