"""The Ray rollout proxy over fake rollout actors: work split across actors, streams merged,
and a dead actor waited for, reloaded and named."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from tandem.core.config import LatencySpec
from tandem.core.protocols import GenerationRequest, RolloutRequest, SamplingParams
from tandem.core.records import PromptGroup, TaskItem, Trajectory
from tandem.engines.fake import FakeRolloutEngine, LatencySampler

ray = pytest.importorskip("ray")

from tandem.engines.ray.build import ActorFailedError, ActorRef, RayRolloutEngine

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests


@ray.remote
class FakeRolloutActor:
    """A rollout actor's generate/ready interface over the fake engine: sequences take 0.05 to
    0.95 s, so a kill after the first one lands while the others are still decoding."""

    def __init__(self) -> None:
        latency = LatencySpec(type="uniform", mean_s=0.5, sigma=0.9)
        self.engine = FakeRolloutEngine(64, LatencySampler(latency, 0), 4)

    async def ready(self) -> tuple[int, int]:
        return os.getpid(), self.engine.version

    async def generate(self, requests: Sequence[GenerationRequest]) -> AsyncIterator[Trajectory]:
        rollouts = [RolloutRequest(PromptGroup(r.prompt_id, TaskItem("", r.prompt_ids), 1), r.index, r.seed) for r in requests]
        async for trajectory in self.engine.rollout(rollouts):
            yield trajectory

    async def hold(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def requests(groups: int, n: int) -> list[GenerationRequest]:
    return [GenerationRequest(g, i, [1, 2, 3], SamplingParams()) for g in range(groups) for i in range(n)]


def proxy(count: int, restarts: int = 0) -> RayRolloutEngine:
    actors = [
        ActorRef("generate", f"rollout-{i}", FakeRolloutActor.options(num_cpus=0, max_restarts=restarts).remote(), restarts > 0)
        for i in range(count)
    ]
    return RayRolloutEngine(actors)


def kill_all(engine: RayRolloutEngine) -> None:
    for actor in engine.actors:
        ray.kill(actor.handle)


def test_a_calls_groups_are_split_between_the_actors_and_every_sample_arrives_once(ray_cluster: Any) -> None:
    engine = proxy(2)

    async def run() -> list[tuple[int, int]]:
        return [(s.prompt_id, s.index) async for s in engine.generate(requests(6, 2))]

    try:
        got = asyncio.run(run())
    finally:
        kill_all(engine)
    assert sorted(got) == [(g, i) for g in range(6) for i in range(2)]
    assert [a.requests for a in engine.actors] == [6, 6]  # whole groups, three to each
    assert [a.in_flight for a in engine.actors] == [0, 0]


async def first_then_kill(engine: RayRolloutEngine, delivered: list[Trajectory]) -> None:
    async for sample in engine.generate(requests(4, 2)):
        delivered.append(sample)
        ray.kill(engine.actors[0].handle, no_restart=False)


def test_past_the_restart_bound_a_dead_actor_fails_naming_its_role_and_name(ray_cluster: Any) -> None:
    engine = proxy(1, restarts=0)
    delivered: list[Trajectory] = []
    with pytest.raises(ActorFailedError, match="generate actor 'rollout-0' failed"):
        asyncio.run(first_then_kill(engine, delivered))
    assert len(delivered) == 1 and engine.actors[0].in_flight == 0


def test_a_restarted_actor_is_reloaded_before_the_call_fails_and_then_serves_again(ray_cluster: Any) -> None:
    engine = proxy(1, restarts=1)
    reloads: list[int] = []

    async def resync() -> None:
        reloads.append(1)

    engine.resync = resync
    engine.loaded(3)  # the flow has loaded version 3; the restarted actor holds version 0

    async def run() -> list[Trajectory]:
        delivered: list[Trajectory] = []
        with pytest.raises(ActorFailedError, match="rollout-0"):
            await first_then_kill(engine, delivered)
        assert reloads == [1]  # reloaded before the failure reached the caller
        return [s async for s in engine.generate(requests(1, 2))]  # the retry finds it serving

    try:
        again = asyncio.run(run())
    finally:
        kill_all(engine)
    assert len(again) == 2


@pytest.mark.parametrize("restarts", [0, 1])
def test_a_call_whose_actor_died_fails_naming_it_once_the_actor_is_back_or_gone(ray_cluster: Any, restarts: int) -> None:
    handle = FakeRolloutActor.options(num_cpus=0, max_restarts=restarts).remote()
    actor = ActorRef("reward", "reward", handle, restartable=restarts > 0)

    async def run() -> None:
        pid, _ = await actor.call(handle.ready.remote())
        pending = handle.hold.remote(30.0)
        ray.kill(handle, no_restart=False)
        with pytest.raises(ActorFailedError, match="reward actor 'reward' failed"):
            await actor.call(pending)
        if restarts:  # the error came once the actor was back: the role's retry finds it serving
            again, _ = await actor.call(handle.ready.remote())
            assert again != pid
        else:
            with pytest.raises(ActorFailedError):
                await actor.call(handle.ready.remote())

    try:
        asyncio.run(run())
    finally:
        ray.kill(handle)
