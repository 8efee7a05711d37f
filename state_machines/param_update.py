"""The param_update role: moves each newly trained version into the rollout engines.

It waits (event-driven, no polling) for the trained version to pass the loaded one, syncs the
newest trained version (skipping any it fell behind on: older weights are never worth
loading), then publishes the loaded version, which is what opens admission for later steps.

A failed sync (after the role's retries) leaves the old weights serving. ``on_error: fail``
stops the flow. ``on_error: drop`` tolerates it: the role tries again as soon as a newer
version is trained, or after ``retry_backoff_s`` if none is (at k = 0 none can be: training
waits for this very load), so a failing sync never stalls the flow for good.

Degradation (``staleness.degrade_after_sync_failures = N``): after N failed syncs in a row the
bound in force for new admissions drops to 0, i.e. synchronous admission against the weights
actually serving: step ``s`` is admitted only while ``s <= loaded``. Training goes on through
every step already admitted (each group keeps, and is checked against, the bound it was
admitted under), then waits for a sync to succeed; no sample is ever trained staler than the
bound it was admitted under, and no generation is spent on weights that cannot be refreshed.
After ``staleness.recover_after_syncs`` successful syncs in a row the configured k is back in
force. Each change is logged as a warning, recorded in the history (``metrics.jsonl`` rows of
kind ``mode``) and shown by the ``tandem_degraded`` and ``tandem_staleness_bound`` gauges.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from core.history import ModeChange
from state_machines.base import State, StateMachine

__all__ = ["ParamUpdateStateMachine"]


class ParamUpdateStateMachine(StateMachine):
    role = "param_update"

    sync_failures = 0  # failed syncs (after retries) over the run
    failures_in_a_row = 0
    successes_in_a_row = 0
    degraded = False
    degradations = 0  # times the flow went synchronous
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
            await self._succeeded()

    async def drop(self, items: Sequence[Any], reason: str) -> None:
        """The error policy's ``drop`` for a sync: no prompts to drop, the old weights keep serving."""
        self.last_error = reason
        self.log.warning("weight sync failed; old weights keep serving", loaded=self.version, error=reason)

    async def _failed(self, target: int) -> None:
        self.sync_failures += 1
        self.failures_in_a_row += 1
        self.successes_in_a_row = 0
        limit = self.config.staleness.degrade_after_sync_failures
        if limit is not None and not self.degraded and self.failures_in_a_row >= limit:
            await self._set_degraded(True, f"{self.failures_in_a_row} weight syncs in a row failed: {self.last_error}")
        # Next attempt: at once for a newer version, else after the backoff (the same one may now work).
        self.set_state(State.PAUSED)
        try:
            await asyncio.wait_for(self.services.clock.wait_trained_beyond(target), self.role_config.retry_backoff_s)
        except TimeoutError:
            pass

    async def _succeeded(self) -> None:
        self.failures_in_a_row = 0
        self.successes_in_a_row += 1
        if self.degraded and self.successes_in_a_row >= self.config.staleness.recover_after_syncs:
            await self._set_degraded(False, f"{self.successes_in_a_row} weight syncs in a row succeeded")

    async def _set_degraded(self, degraded: bool, reason: str) -> None:
        services = self.services
        k = 0 if degraded else self.config.staleness.k
        await services.gate.set_k(k)
        self.degraded = degraded
        self.degradations += degraded
        clock = services.clock
        services.history.add_mode_change(
            ModeChange(asyncio.get_running_loop().time(), degraded, k, clock.loaded, clock.trained, reason)
        )
        if degraded:
            self.log.warning("degraded to synchronous admission", staleness_bound=k, reason=reason)
        else:
            self.log.warning("back to asynchronous admission", staleness_bound=k, reason=reason)
