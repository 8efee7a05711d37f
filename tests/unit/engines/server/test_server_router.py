"""The router: a RolloutEngine over rollout servers. Log-probs equal the trainer's, groups stay
on one server, the load is balanced, a dead server's requests are retried elsewhere exactly
once, a server that comes back gets the current weights before any work, and partial
rollouts survive a paused weight update by abort + resume with the recompute policy."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tiny_lm import decode, encode

from tandem.core.protocols import GenerationRequest, RolloutEngine, SamplingParams
from tandem.core.records import FinishReason, ResumePolicy, Trajectory
from tandem.engines.server.app import RolloutServer, serve
from tandem.engines.server.limits import ServerLimits
from tandem.engines.server.router import ServerRolloutEngine, running
from tandem.engines.server.weights import free_port, post_json
from tandem.engines.trainers.torch_train import TorchLogProbEngine
from tests.unit.engines.server.test_server_support import launched, served

PROMPTS = ["1+2=", "34+5=", "6=", "78+90="]


def requests(groups: int, n: int, max_new: int, seed: int = 3) -> list[GenerationRequest]:
    return [
        GenerationRequest(g, i, encode(PROMPTS[g % len(PROMPTS)]), SamplingParams(max_new_tokens=max_new), seed=seed)
        for g in range(groups) for i in range(n)
    ]


def router(urls: list[str], *, live: bool = True, health_s: float = 30.0) -> ServerRolloutEngine:
    return ServerRolloutEngine(urls, decode=decode, live_updates=live, request_timeout_s=60, health_interval_s=health_s,
                               wait_for_server_s=30)


async def collect(engine: RolloutEngine, reqs: list[GenerationRequest]) -> list[Trajectory]:
    return sorted([t async for t in engine.generate(reqs)], key=lambda t: (t.prompt_id, t.index))


class Process:
    """An in-process server that can be stopped (its connections dropped) and started again on its port."""

    def __init__(self, model_dir: Path, port: int | None = None, *, weight_dirs: tuple[Path, ...] = ()) -> None:
        self.model_dir = model_dir
        self.limits = ServerLimits(weight_dirs=weight_dirs)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server: RolloutServer | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> RolloutServer:
        self.server = RolloutServer.create(str(self.model_dir), limits=self.limits)
        self._stop = asyncio.Event()
        ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._task = asyncio.ensure_future(serve(self.server, "127.0.0.1", self.port, ready=ready.set_result, stop=self._stop))
        await ready
        return self.server

    async def stop(self) -> None:
        self._stop.set()
        assert self._task is not None
        await self._task


@contextlib.asynccontextmanager
async def processes(*procs: Process) -> AsyncIterator[None]:
    for p in procs:
        await p.start()
    try:
        yield
    finally:
        for p in procs:
            if p._task is not None and not p._task.done():
                await p.stop()


async def test_is_a_rollout_engine_whose_logprobs_equal_the_trainers(model_dir: Path) -> None:
    async with served(model_dir) as (_, url):
        async with running(router([url])) as engine:
            assert isinstance(engine, RolloutEngine)
            trajectories = await collect(engine, requests(4, 2, 12))
    assert [(t.prompt_id, t.index) for t in trajectories] == [(g, i) for g in range(4) for i in range(2)]
    async with TorchLogProbEngine(str(model_dir)) as scorer:
        expected = await scorer.logprobs(trajectories)
    gap = max(abs(a - b) for t, e in zip(trajectories, expected) for a, b in zip(t.behaviour_logprobs, e))
    assert gap < 1e-4
    for t in trajectories:
        assert t.versions == [0] * t.num_actions and t.finish_reason is FinishReason.LENGTH and t.resumed is None
        assert t.payload.text == decode(t.payload.response_ids)


async def test_same_seed_same_tokens_whichever_server(model_dir: Path) -> None:
    """Sampling is a function of the request: a retried request draws the same tokens."""
    async with served(model_dir) as (_, a), served(model_dir) as (_, b):
        async with running(router([a])) as on_a, running(router([b])) as on_b:
            first, second = await collect(on_a, requests(2, 2, 10)), await collect(on_b, requests(2, 2, 10))
    assert [t.payload.response_ids for t in first] == [t.payload.response_ids for t in second]


async def test_a_groups_samples_stay_on_one_server_and_groups_spread_by_load(model_dir: Path) -> None:
    seen: dict[str, set[int]] = {}
    async with served(model_dir) as (s0, a), served(model_dir) as (s1, b):
        for server, url in ((s0, a), (s1, b)):
            server.on_generated.append(lambda _c, rid, _r, _x, url=url: seen.setdefault(url, set()).add(int(rid.split("-")[0])))
        async with running(router([a, b])) as engine:
            await collect(engine, requests(4, 3, 6))
            assert all(ep.outstanding == 0 for ep in engine.endpoints)
    assert seen[a].isdisjoint(seen[b])  # no group split between servers
    assert seen[a] | seen[b] == {0, 1, 2, 3} and len(seen[a]) == len(seen[b]) == 2  # least outstanding first


@pytest.mark.slow
async def test_a_killed_servers_requests_are_retried_elsewhere_exactly_once(model_dir: Path, tmp_path: Path) -> None:
    """A ``tandem serve`` process is killed (-9) while it decodes its group; the other server, in
    this process (only the killed one needs a process of its own), takes the group over."""
    import os
    import signal

    async with (
        launched(model_dir, 1, tmp_path) as fleet,
        served(model_dir) as (_, other),
        running(router([*fleet.urls, other])) as engine,
    ):
        reqs = requests(2, 3, 400)
        stream = engine.generate(reqs)
        first = asyncio.ensure_future(anext(stream))
        while not all(ep.outstanding == 3 for ep in engine.endpoints):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # decoding
        os.kill(fleet.pids[0], signal.SIGKILL)
        got = [await first] + [t async for t in stream]
        out = {ep.url: ep.in_service for ep in engine.endpoints}
    assert sorted((t.prompt_id, t.index) for t in got) == [(r.prompt_id, r.index) for r in reqs]  # each once
    assert all(t.num_actions == 400 for t in got)
    assert out == {fleet.urls[0]: False, other: True}


async def test_a_server_that_comes_back_gets_the_current_weights_before_any_work(model_dir: Path, v1_model_dir: Path) -> None:
    a = Process(model_dir, weight_dirs=(v1_model_dir,))
    async with processes(a), running(router([a.url], health_s=0.2)) as engine:
        pushed: list[int] = []

        async def resync() -> None:  # what the weight sync does: the trainer's current weights, version 1
            status, _ = await asyncio.to_thread(post_json, a.url, "/update_weights_from_disk",
                                                {"model_path": str(v1_model_dir), "weight_version": "1"}, 30)
            pushed.append(status)

        engine.resync = resync
        await resync()
        engine.loaded(1)
        await a.stop()
        await a.start()  # a restart: the model file's weights, version 0
        back = await collect(engine, requests(1, 2, 5))
        assert pushed == [200, 200]  # loaded again before the work went there
    assert all(t.versions == [1] * 5 for t in back)


async def test_a_paused_update_aborts_and_resumes_requests_recomputing_their_prefix(model_dir: Path, v1_model_dir: Path) -> None:
    """Servers without live updates (sglang): the update pauses generation; each request in
    flight comes back aborted and is resumed under the new weights, its tokens versioned."""
    a = Process(model_dir, weight_dirs=(v1_model_dir,))
    async with processes(a), running(router([a.url], live=False)) as engine:
        reqs = requests(1, 2, 150)
        pending = asyncio.ensure_future(collect(engine, reqs))
        assert a.server is not None
        for _ in range(2000):
            if len(a.server.running) == 2 and all(len(r.seq.versions) > 3 for r in a.server.running.values()):
                break
            await asyncio.sleep(0.005)
        await engine.pause_generation()
        status, _ = await asyncio.to_thread(post_json, a.url, "/update_weights_from_disk",
                                            {"model_path": str(v1_model_dir), "weight_version": "1"}, 30)
        engine.loaded(1)
        await engine.continue_generation()
        trajectories = await pending
    assert status == 200
    for t in trajectories:
        cut = t.versions.index(1)
        assert 0 < cut < 150 and t.versions == [0] * cut + [1] * (150 - cut)
        assert t.resumed is ResumePolicy.RECOMPUTE and t.num_actions == 150
    # After the cut the behaviour log-probs are the new weights' on the whole sequence so far.
    async with TorchLogProbEngine(str(v1_model_dir)) as scorer:
        expected = await scorer.logprobs(trajectories)
    for t, e in zip(trajectories, expected):
        cut = t.versions.index(1)
        assert max(abs(x - y) for x, y in zip(t.behaviour_logprobs[cut:], e[cut:])) < 1e-4


async def test_no_server_in_service_fails_after_the_wait(model_dir: Path) -> None:
    engine = ServerRolloutEngine([f"http://127.0.0.1:{free_port()}"], decode=decode, live_updates=True,
                                 request_timeout_s=5, health_interval_s=30, wait_for_server_s=0.2)
    async with running(engine):
        with pytest.raises(ConnectionError):
            await collect(engine, requests(1, 1, 3))
        assert not engine.endpoints[0].in_service
