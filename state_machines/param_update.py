"""The param_update role: moves each newly trained version into the rollout engines.

It waits (event-driven, no polling) for the trained version to pass the loaded one, syncs the
newest trained version (skipping any it fell behind on: older weights are never worth
loading), then publishes the loaded version, which is what opens admission for later steps.

A failed sync (after the role's retries) leaves the old weights serving. ``on_error: fail``
stops the flow. ``on_error: drop`` tolerates it: the role tries again as soon as a newer
version is trained, or after ``retry_backoff_s`` if none is (at k = 0 none can be: training
waits for this very load), so a failing sync never stalls the flow for good; after
``param_sync.give_up_after_failures`` failures in a row it stops the run with an error naming
the last one, rather than retrying forever.

Each outcome is reported to the staleness gate, which owns degradation
(``staleness.degrade_after_sync_failures``): while syncs keep failing it admits synchronously
against the weights actually serving, and restores the configured bound once they succeed
again. This role records each change of mode in the history (``metrics.jsonl`` rows of kind
``mode``) and logs it as a warning; the ``tandem_degraded`` and ``tandem_staleness_bound``
gauges read the gate.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from tandem.core.history import ModeChange
from tandem.state_machines.base import State, StateMachine

__all__ = ["ParamUpdateStateMachine", "SyncGaveUpError"]


class SyncGaveUpError(RuntimeError):
    """Weight syncs failed too many times in a row; names the count and the last error."""


class ParamUpdateStateMachine(StateMachine):
    role = "param_update"

    last_error = ""

    async def main(self) -> None:
        clock = self.services.clock
        sync = self.services.components.weight_sync
        self.version = clock.loaded
        while True:
            self.set_state(State.WAITING_INPUT)
            target = await clock.wait_trained_beyond(clock.loaded)
            report = await self.work([], lambda: sync.sync(target))  # noqa: B023 (called within this iteration)
            if report is None:
                await self._failed(target)
                continue
            if report.version < target:
                raise RuntimeError(f"weight sync asked for version {target} but loaded {report.version}")
            # A sync may load a version whose train step has not been published yet; the clock
            # keeps loaded <= trained, so wait for it (the train role publishes right after).
            await clock.wait_trained_at_least(report.version)
            await clock.set_loaded(report.version)
            self.version = report.version
            self.items_done += 1
            self.services.history.add_sync(report.version, report.metrics)
            gate = self.services.gate
            if await gate.sync_succeeded():
                self._mode_changed(f"{gate.syncs.successes_in_a_row} weight syncs in a row succeeded")

    async def drop(self, items: Sequence[Any], reason: str) -> None:
        """The error policy's ``drop`` for a sync: no prompts to drop, the old weights keep serving."""
        self.last_error = reason
        self.log.warning("weight sync failed; old weights keep serving", loaded=self.version, error=reason)

    async def _failed(self, target: int) -> None:
        gate = self.services.gate
        if await gate.sync_failed():
            self._mode_changed(f"{gate.syncs.failures_in_a_row} weight syncs in a row failed: {self.last_error}")
        limit = self.config.param_sync.give_up_after_failures
        if gate.syncs.failures_in_a_row >= limit:
            raise SyncGaveUpError(
                f"{gate.syncs.failures_in_a_row} weight syncs in a row failed (param_sync.give_up_after_failures="
                f"{limit}); the last: {self.last_error}"
            )
        # Next attempt: at once for a newer version, else after the backoff (the same one may now work).
        self.set_state(State.PAUSED)
        try:
            await asyncio.wait_for(self.services.clock.wait_trained_beyond(target), self.role_config.retry_backoff_s)
        except TimeoutError:
            pass

    def _mode_changed(self, reason: str) -> None:
        services = self.services
        gate, clock = services.gate, services.clock
        services.history.add_mode_change(
            ModeChange(asyncio.get_running_loop().time(), gate.degraded, gate.k, clock.loaded, clock.trained, reason)
        )
        if gate.degraded:
            self.log.warning("degraded to synchronous admission", staleness_bound=gate.k, reason=reason)
        else:
            self.log.warning("back to asynchronous admission", staleness_bound=gate.k, reason=reason)
