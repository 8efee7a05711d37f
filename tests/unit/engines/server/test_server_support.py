"""Helpers for the rollout-server tests: a ``tandem serve`` app inside the test's event loop.

Serving in-process keeps each test fast (no interpreter start, no model load in a child);
the tests that need a real process (kill -9, orphans, the launcher) start ``tandem serve``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from tandem.engines.server.agent_proxy import AgentProxy
from tandem.engines.server.app import RolloutServer, serve
from tandem.engines.server.auth import ApiKeys
from tandem.engines.server.launcher import ServerFleet, ServerSpec, tandem_command
from tandem.engines.server.router import ServerRolloutEngine, running
from tandem.engines.server.weights import free_port


@contextlib.asynccontextmanager
async def served(model_dir: Path, **options: Any) -> AsyncIterator[tuple[RolloutServer, str]]:
    """A server for ``model_dir`` on a free port of 127.0.0.1: yields it and its URL."""
    server = RolloutServer.create(str(model_dir), **options)
    stop = asyncio.Event()
    port: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(serve(server, "127.0.0.1", 0, ready=port.set_result, stop=stop))
    try:
        yield server, f"http://127.0.0.1:{await port}"
    finally:
        stop.set()
        await task


@contextlib.asynccontextmanager
async def proxied(model_dir: Path, count: int = 1, *, urls: Sequence[str] = (),
                  api_key: SecretStr | None = None) -> AsyncIterator[tuple[AgentProxy, ServerRolloutEngine]]:
    """``count`` in-process servers for ``model_dir`` (after any at ``urls``) behind a router, and
    the agents' recording proxy in front of it as a run builds it, started; all stopped on the way out."""
    from tiny_lm import decode

    from tandem.engines.server.build import agent_proxy
    from tandem.engines.shared.tokenizer import load_tokenizer

    async with contextlib.AsyncExitStack() as stack:
        urls = [*urls, *[(await stack.enter_async_context(served(model_dir)))[1] for _ in range(count)]]
        router = await stack.enter_async_context(running(ServerRolloutEngine(
            urls, decode=decode, live_updates=True, request_timeout_s=60, health_interval_s=30, wait_for_server_s=10)))
        proxy = agent_proxy(str(model_dir), load_tokenizer(model_dir), router, ApiKeys(api_key=api_key))
        await proxy.start()
        stack.push_async_callback(proxy.aclose)
        yield proxy, router


def fleet_of(model_dir: Path, count: int, logs: Path, *, max_restarts: int = 0) -> ServerFleet:
    """``count`` ``tandem serve`` processes for ``model_dir`` on free ports (not yet launched)."""
    specs = []
    for i in range(count):
        port = free_port()
        command = tandem_command(str(model_dir), "127.0.0.1", port, name=f"server{i}", threads=1, max_batch_size=16,
                                 resume_policy="recompute", dtype="float32", device="cpu", consume_bucket_mb=64)
        specs.append(ServerSpec(f"server{i}", command, f"http://127.0.0.1:{port}", logs / f"server{i}.log"))
    return ServerFleet(specs, startup_timeout_s=240, max_restarts=max_restarts)


@contextlib.asynccontextmanager
async def launched(model_dir: Path, count: int, logs: Path, **options: Any) -> AsyncIterator[ServerFleet]:
    """``count`` real server processes, ready; stopped on the way out."""
    fleet = fleet_of(model_dir, count, logs, **options)
    fleet.launch()
    try:
        await fleet.ready()
        yield fleet
    finally:
        fleet.stop()


def test_served_yields_a_live_url(model_dir: Path) -> None:
    """The helper itself: the server answers at the URL it yields, and stops afterwards."""
    import aiohttp

    async def check() -> tuple[int, bool]:
        async with served(model_dir) as (server, url), aiohttp.ClientSession() as session:
            async with session.get(url + "/health") as resp:
                status = resp.status
        return status, server.engine._thread.is_alive()

    status, alive_after = asyncio.run(check())
    assert status == 200
    assert not alive_after  # closed with the server
