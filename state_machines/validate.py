"""The validate role: evaluates the serving policy on a held-out set while training goes on.

Schedule (``validation.every_versions = N``): the role waits, event-driven, for the loaded
version to reach the next multiple of N (0 first: the policy before any RL step), then
generates one sample per held-out prompt with the rollout engine, scores them with the reward,
measures them by the task's held-out measure (``core.task.HeldOutMeasure``) and records the
result tagged with the weight version every sample started with
(:class:`~core.history.ValidationRecord`; a weight update that lands mid-evaluation is
reported as ``max_token_version``). Versions it fell behind on are skipped, never queued, and
one evaluation runs at a time. An evaluation still running when training ends is cancelled and
not recorded.

Its prompts are the components' held-out set, never the training stream: it takes no
admission slot and enters no ledger, so it neither consumes a training step's budget nor
touches the staleness accounting. Its requests join the rollout engine's continuous batch
beside training generation, so training is never paused for it. Its ids start at
``VALIDATION_IDS``, far above any training prompt id.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Sequence
from typing import Any

from tandem.core.history import ValidationRecord
from tandem.core.protocols import RewardResult, RolloutRequest
from tandem.core.records import PromptGroup, Trajectory
from tandem.core.task import HeldOutMeasure
from tandem.state_machines.base import State, StateMachine
from tandem.state_machines.generate import request_seed

__all__ = ["VALIDATION_IDS", "ValidateStateMachine"]

VALIDATION_IDS = 1 << 48


class ValidateStateMachine(StateMachine):
    role = "validate"

    async def main(self) -> None:
        spec = self.config.validation
        every = spec.every_versions
        if every is None:
            raise ValueError("the validate role runs only with validation.every_versions set")
        held_out = self.services.components.held_out
        if held_out is None:
            raise ValueError("validation.every_versions is set but the engines provide no held-out prompts")
        prompts = held_out(spec.prompts)
        if len(prompts) != spec.prompts:
            raise ValueError(f"validation.prompts is {spec.prompts} but the held-out set has {len(prompts)}")
        seed = self.config.run.seed
        groups = [PromptGroup(VALIDATION_IDS + i, item, 1) for i, item in enumerate(prompts)]
        requests = [RolloutRequest(g, 0, request_seed(seed, g.prompt_id, 0), evaluation=True) for g in groups]
        clock = self.services.clock
        target = 0
        while True:
            self.set_state(State.WAITING_INPUT)
            await self._wait_loaded(target)
            record = await self.work([], lambda: self._evaluate(requests))
            if record is not None:
                self.version = record.version
                self.items_done += record.samples
                self.services.history.add_validation(record)
            target = (clock.loaded // every + 1) * every

    async def _wait_loaded(self, version: int) -> None:
        clock = self.services.clock
        async with clock.changed:
            await clock.changed.wait_for(lambda: clock.loaded >= version)

    async def drop(self, items: Sequence[Any], reason: str) -> None:
        """The error policy's ``drop`` for an evaluation: it is skipped, no prompts are accounted."""
        self.log.warning("held-out evaluation skipped", error=reason)

    async def _evaluate(self, requests: list[RolloutRequest]) -> ValidationRecord:
        loop = asyncio.get_running_loop()
        started = loop.time()
        components = self.services.components
        trajectories = [t async for t in components.workflow.rollout(requests)]
        trajectories.sort(key=lambda t: t.prompt_id)
        by_id = {r.prompt_id: r.group for r in requests}
        results = await components.reward.score(trajectories, [by_id[t.prompt_id] for t in trajectories])
        return _record(trajectories, results, components.held_out_measure, loop.time(), loop.time() - started)


def _record(
    trajectories: list[Trajectory], results: list[RewardResult], measure: HeldOutMeasure, now: float, duration: float
) -> ValidationRecord:
    if len(results) != len(trajectories):
        raise ValueError(f"reward returned {len(results)} results for {len(trajectories)} validation trajectories")
    rewards = [r.reward if r.ok else 0.0 for r in results]
    return ValidationRecord(
        version=min(t.start_version for t in trajectories),
        max_token_version=max(max(t.versions, default=t.start_version) for t in trajectories),
        time_s=now,
        duration_s=duration,
        samples=len(trajectories),
        reward_mean=statistics.fmean(rewards),
        measure=measure.name,
        score=sum(measure.met_by(r) for r in results) / len(results),
    )
