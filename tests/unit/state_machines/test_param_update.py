"""The param_update role under failing weight syncs: old weights keep serving, failed syncs are
retried, repeated failures degrade admission to synchronous (k in force 0) and good syncs bring
the configured k back, all visible in the step records, the mode changes and the metrics."""

from __future__ import annotations

import pytest

from tandem.core.config import ConfigError, TandemConfig
from tandem.core.history import StepRecord
from tandem.core.protocols import SyncReport
from tandem.engines.fake import FakeWeightSync, InjectedFault
from tandem.pipeline import AsyncTrainingFlow, FlowResult
from tandem.pipeline.builders import build_components
from tandem.state_machines.base import StageError
from tests.conftest import make_config, run_virtual


class ScriptedSync:
    """The fake weight sync, refusing ``refusals`` attempts in a row from the first one that
    asks for version ``from_version`` or later (an outage of the transport)."""

    def __init__(self, inner: FakeWeightSync, from_version: int, refusals: int) -> None:
        self._inner = inner
        self._from = from_version
        self._left = refusals
        self.attempts: list[tuple[int, bool]] = []

    async def sync(self, version: int) -> SyncReport:
        ok = version < self._from or self._left == 0
        self.attempts.append((version, ok))
        if not ok:
            self._left -= 1
            raise InjectedFault(f"sync of version {version} refused")
        return await self._inner.sync(version)


def degrading_config(**extra: object) -> TandemConfig:
    sections: dict = {
        "run": {"max_steps": 12},
        "staleness": {"max_staleness": 2, "degrade_after_sync_failures": 2, "recover_after_syncs": 2},
        "roles": {"param_update": {"on_error": "drop", "retry_backoff_s": 0.2}},
    }
    sections.update(extra)
    return make_config(**sections)


def run_with_outage(cfg: TandemConfig, from_version: int, refusals: int) -> tuple[FlowResult, ScriptedSync, list]:
    """Run the flow through a sync outage; also return, per step, the ``tandem_degraded`` and
    ``tandem_staleness_bound`` gauges read when the step landed."""
    components = build_components(cfg)
    sync = ScriptedSync(components.weight_sync, from_version, refusals)  # type: ignore[arg-type]
    components.weight_sync = sync
    gauges: list[tuple[int, float, float]] = []

    def on_step(record: StepRecord) -> None:
        assert flow.metrics is not None
        read = flow.metrics.registry.get_sample_value
        gauges.append((record.step, read("tandem_degraded"), read("tandem_staleness_bound")))

    flow = AsyncTrainingFlow(cfg, components, on_step=on_step)
    return run_virtual(flow.run()), sync, gauges


def test_failed_syncs_degrade_to_synchronous_admission_and_good_ones_restore_k() -> None:
    cfg = degrading_config()
    result, sync, gauges = run_with_outage(cfg, from_version=3, refusals=5)

    assert len(result.steps) == cfg.run.max_steps and result.ledger["balanced"]
    assert not result.drops  # a failed sync drops no prompt: the old weights kept serving
    assert [ok for _, ok in sync.attempts][:7] == [True, True, False, False, False, False, False]
    down, up = result.mode_changes
    assert (down.degraded, down.staleness_bound, down.loaded_version) == (True, 0, 2)
    assert "2 weight syncs in a row failed" in down.reason and "refused" in down.reason
    assert (up.degraded, up.staleness_bound) == (False, 2) and down.time_s < up.time_s
    # Recovery needs two good syncs in a row: the first after the outage and the next one.
    good_after = [v for v, ok in sync.attempts[7:] if ok]
    assert up.loaded_version == good_after[1]
    # While degraded nothing was admitted past the loaded version 2: training stopped at the
    # steps admitted under k = 2 (up to step 4) until the outage ended.
    assert down.trained_version <= 5 and all(s.loaded_version >= s.step - 2 for s in result.steps)
    bounds = [s.staleness_bound for s in result.steps]
    assert 0 in bounds and bounds[0] == bounds[-1] == 2
    assert all(max(s.staleness) <= 2 for s in result.steps)
    # The same story in the metrics: degraded while the bound was 0, and back.
    assert [(d, b) for _, d, b in gauges] == [(float(s.staleness_bound == 0), float(s.staleness_bound)) for s in result.steps]
    assert gauges[0][1] == gauges[-1][1] == 0.0 and any(d == 1.0 for _, d, _ in gauges)
    assert result.ledger["trained"] == cfg.run.max_steps * cfg.train.prompts_per_step


def test_a_failed_sync_at_k0_is_retried_after_the_backoff_and_the_run_goes_on() -> None:
    # At k = 0 no newer version can be trained while the load is missing: the retry must come
    # from the backoff, not from a new version (which would wait forever).
    cfg = make_config(
        staleness={"max_staleness": 0},
        roles={"param_update": {"on_error": "drop", "retry_backoff_s": 0.5}},
        engines={"generation_latency": {"type": "constant", "mean_s": 1.0}},
    )
    components = build_components(cfg)
    sync = ScriptedSync(components.weight_sync, from_version=2, refusals=3)  # type: ignore[arg-type]
    components.weight_sync = sync
    result = run_virtual(AsyncTrainingFlow(cfg, components).run())

    assert len(result.steps) == cfg.run.max_steps and not result.mode_changes
    assert [v for v, ok in sync.attempts if not ok] == [2, 2, 2]
    assert [s.staleness for s in result.steps] == [[0] * cfg.train.prompts_per_step] * cfg.run.max_steps
    # Step 2 waited for the three refused attempts, each 0.5 s of backoff apart.
    gap = result.steps[2].time_s - result.steps[1].time_s
    normal = result.steps[1].time_s - result.steps[0].time_s
    assert gap == pytest.approx(normal + 3 * 0.5)


def test_a_failed_sync_with_on_error_fail_stops_the_run_naming_param_update() -> None:
    cfg = make_config(engines={"faults": {"param_update": {"failure_rate": 1.0}}})
    with pytest.raises(StageError, match="stage 'param_update' failed.*injected param_update fault"):
        run_virtual(AsyncTrainingFlow(cfg).run())


def test_a_sync_that_keeps_failing_gives_up_naming_the_count_and_the_last_error() -> None:
    cfg = make_config(
        run={"max_steps": 50},
        roles={"param_update": {"on_error": "drop", "retry_backoff_s": 0.5}},
        param_sync={"give_up_after_failures": 4},
        engines={"faults": {"param_update": {"failure_rate": 1.0}}},
    )
    flow = AsyncTrainingFlow(cfg)
    with pytest.raises(StageError, match=r"stage 'param_update'.*4 weight syncs in a row failed .*give_up_after_failures=4.*"
                                         r"injected param_update fault #4"):
        run_virtual(flow.run())


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"staleness": {"degrade_after_sync_failures": 2}}, "needs roles.param_update.on_error=drop"),
        ({"roles": {"param_update": {"on_error": "drop", "retry_backoff_s": 0}}}, "retry_backoff_s must be > 0"),
        ({"staleness": {"recover_after_syncs": 0}}, "staleness.recover_after_syncs"),
    ],
)
def test_bad_degradation_settings_fail_naming_the_field(sections: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_config(**sections)
