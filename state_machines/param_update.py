"""The param_update role: moves each newly trained version into the rollout engines.

It waits (event-driven, no polling) for the trained version to pass the loaded one, syncs the
newest trained version (skipping any it fell behind on: older weights are never worth
loading), then publishes the loaded version, which is what opens admission for later steps.
A failed sync leaves the old weights serving; the role's error policy decides what follows.
"""

from __future__ import annotations

from state_machines.base import State, StateMachine

__all__ = ["ParamUpdateStateMachine"]


class ParamUpdateStateMachine(StateMachine):
    role = "param_update"

    async def main(self) -> None:
        clock = self.services.clock
        sync = self.services.components.weight_sync
        self.version = clock.loaded
        while True:
            self.set_state(State.WAITING_INPUT)
            target = await clock.wait_trained_beyond(clock.loaded)
            report = await self.work([], lambda: sync.sync(target))
            if report is None:
                continue  # dropped: old weights keep serving, the next trained version retries
            if report.version < target:
                raise RuntimeError(f"weight sync asked for version {target} but loaded {report.version}")
            # A sync may load a version whose train step has not been published yet; the clock
            # keeps loaded <= trained, so wait for it (the train role publishes right after).
            await clock.wait_trained_at_least(report.version)
            await clock.set_loaded(report.version)
            self.version = report.version
            self.items_done += 1
            self.services.history.add_sync(report.version, report.metrics)
