"""The generate role: admits prompt groups under the staleness gate and keeps the engine busy.

For each prompt group it waits for an admission slot (training step ``s`` only while
``s <= loaded_version + k``, and under the in-flight cap), then hands the group's ``n`` requests
to the workload's rollout workflow without waiting for earlier calls to finish, so the engine's
continuous batch stays full. Finished trajectories go downstream as soon as they finish, each
with its group.

Every admitted slot is launched before the role blocks on the gate again (otherwise k = 0 would
deadlock: the step's last groups would wait behind the gate that their own training opens).
A group whose prompt is longer than the components' ``max_prompt_tokens`` (the model's context
minus ``max_new_tokens``) is dropped at admission with the lengths as reason; its slot refills.
A failed call is retried for the trajectories it had not yet delivered, so a retry never
duplicates one; if the error policy then drops the call, it drops only the groups still missing
trajectories (a group whole before the failure has gone on to training and stays there).
State: RUNNING while any call is in flight, else PAUSED while held by the gate, else
WAITING_INPUT.

With ``staleness.on_stale: recompute`` it also generates again each stale group the train role
sends back through the gate (``StalenessGate.regenerate``), once the gate hands it out under the
refill bound, until the prompt stream ends. Each group records when its trajectories were
requested and each trajectory when it was delivered: the ends of its time in flight.

A trajectory the workflow could not produce through no fault of the policy (``Trajectory.failure``:
its environment raised, hung or broke its protocol) drops its group with that reason in the
ledger; the slot refills, and the group's other trajectories are discarded as they arrive. A
workflow that declares ``use_trace(recorder)`` is given the run's trace before the first call.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator

from tandem.core.protocols import RolloutRequest
from tandem.core.records import PromptGroup
from tandem.core.staleness import Admission
from tandem.state_machines.base import StageError, State, StateMachine
from tandem.state_machines.messages import Generation

__all__ = ["GenerateStateMachine", "request_seed"]


def request_seed(run_seed: int, prompt_id: int, index: int) -> int:
    """The sampling seed of one trajectory: a function of the run seed and the trajectory alone,
    so its actions do not depend on the schedule that generated it."""
    return hash((run_seed, prompt_id, index)) & 0x7FFFFFFF


@contextlib.asynccontextmanager
async def _call_group() -> AsyncIterator[asyncio.TaskGroup]:
    """A task group for engine calls that fails with its first call's :class:`StageError`, not
    a group of them: calls on an engine that died all fail at once, for the same reason."""
    try:
        async with asyncio.TaskGroup() as group:
            yield group
    except* StageError as failed:
        raise failed.exceptions[0] from None


class GenerateStateMachine(StateMachine):
    role = "generate"

    _calls_in_flight = 0
    _held_by_gate = False

    def _refresh_state(self, idle: State) -> None:
        if self._calls_in_flight:
            self.set_state(State.RUNNING)
        elif self._held_by_gate:
            self.set_state(State.PAUSED)
        else:
            self.set_state(idle)

    async def main(self) -> None:
        gate = self.services.gate
        use_trace = getattr(self.services.components.workflow, "use_trace", None)
        if use_trace is not None:  # a workflow with spans of its own (environment steps) records them in the run's trace
            use_trace(self.services.trace)
        async with _call_group() as calls:  # owns every in-flight engine call
            regenerating = None
            if self.config.staleness.on_stale == "recompute":
                regenerating = calls.create_task(self._regenerate(calls))
            while True:
                self._refresh_state(State.WAITING_INPUT)
                groups = await self.receive(waiting=None)  # _refresh_state chose the state
                if groups is None:
                    break
                pending = deque(groups)
                while pending:
                    self._held_by_gate = True
                    self._refresh_state(State.PAUSED)
                    admitted = [self._admit(pending.popleft(), await gate.admit())]
                    self._held_by_gate = False
                    while pending and (slot := gate.try_admit()) is not None:
                        admitted.append(self._admit(pending.popleft(), slot))
                    if admitted := await self._drop_over_budget(admitted):
                        calls.create_task(self._run_call(admitted))
            if regenerating is not None:
                regenerating.cancel()  # the prompt stream ended: no call is left to join
        assert self.outbox is not None
        self.outbox.close()

    async def _regenerate(self, calls: asyncio.TaskGroup) -> None:
        """Generate again each stale group the train role sends back (``on_stale: recompute``),
        as the gate hands it out: same prompt, same step, its slot and ledger entry kept."""
        while True:
            group = await self.services.gate.next_regeneration()
            self.version = group.admitted_version
            calls.create_task(self._run_call([group]))

    def _admit(self, group: PromptGroup, admission: Admission) -> PromptGroup:
        group.step = admission.step
        group.admitted_version = admission.version
        group.admitted_k = admission.k
        self.services.ledger.admit(group.prompt_id, admission.step)
        self.version = admission.version
        return group

    async def _drop_over_budget(self, groups: list[PromptGroup]) -> list[PromptGroup]:
        """Drop the groups whose prompt leaves the model no room for ``max_new_tokens`` (the
        drop is recorded with the lengths, and the slot refilled); return the others."""
        budget = self.services.components.max_prompt_tokens
        if budget is None:
            return groups  # this workload's prompts have no token budget
        for group in groups:
            if len(group.prompt_ids) > budget:
                reason = (
                    f"prompt of {len(group.prompt_ids)} tokens is over the budget of {budget} "
                    "(the model's context minus rollout.max_new_tokens)"
                )
                await self.drop([group], reason)
        return [g for g in groups if len(g.prompt_ids) <= budget]

    async def _run_call(self, groups: list[PromptGroup]) -> None:
        self._calls_in_flight += 1
        self._refresh_state(State.WAITING_INPUT)
        try:
            await self._generate(groups)
        finally:
            self._calls_in_flight -= 1
            self._refresh_state(State.WAITING_INPUT)

    async def _generate(self, groups: list[PromptGroup]) -> None:
        workflow = self.services.components.workflow
        by_id = {g.prompt_id: g for g in groups}
        seed = self.config.run.seed
        todo = {
            (g.prompt_id, i): RolloutRequest(g, i, request_seed(seed, g.prompt_id, i)) for g in groups for i in range(g.n)
        }
        missing = {g.prompt_id: g.n for g in groups}
        # The groups a failure concerns; ``work`` reads it when the policy decides, so a group
        # that became whole before the failure is neither dropped nor named.
        incomplete = list(groups)
        assert self.outbox is not None
        loop = asyncio.get_running_loop()
        for group in groups:
            group.requested_s = loop.time()  # each trajectory's time in flight starts here

        async def call() -> None:
            # Only what has not been delivered yet: a retry never duplicates a trajectory.
            async for trajectory in workflow.rollout(list(todo.values())):
                del todo[(trajectory.prompt_id, trajectory.index)]
                trajectory.finished_s = loop.time()
                if trajectory.failure is not None:  # not the policy's doing: the group goes, with the reason
                    await self.drop([by_id[trajectory.prompt_id]], trajectory.failure)
                else:
                    generation = Generation(by_id[trajectory.prompt_id], trajectory)
                    if not self.outbox.try_send(generation):  # no coroutine per item while there is room
                        await self.outbox.send(generation)
                self.items_done += 1
                missing[trajectory.prompt_id] -= 1
                if not missing[trajectory.prompt_id]:
                    incomplete.remove(by_id[trajectory.prompt_id])

        await self.work(incomplete, call)
