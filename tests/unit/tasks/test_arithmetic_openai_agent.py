"""The shipped OpenAI-client agent: what it asks the endpoint for, that its episodes share kept-alive
connections, and that its session leaves nothing open when the run ends.

The endpoint here is a stand-in that answers like ``/v1/completions`` and keeps the request
bodies and the client's address of each; the agent trained end to end against ``tandem serve``
is in ``tests/integration/test_server_flow.py``.
"""

from __future__ import annotations

import asyncio
import gc
import json
import weakref
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

from tandem.core.protocols import AgentRun, SamplingParams
from tandem.core.records import TaskItem
from tandem.tasks.arithmetic.openai_agent import solver

COMPLETION = {
    "id": "cmpl-0", "object": "text_completion", "created": 0, "model": "tandem",
    "choices": [{"index": 0, "text": "4", "finish_reason": "stop", "logprobs": None}],
}


async def episodes_against_a_stand_in(episodes: int) -> list[tuple[dict[str, Any], Any]]:
    """Serve a stand-in ``/v1/completions``, run ``episodes`` episodes one after another in one
    session, return each request's body and the client's address it came from."""
    seen: list[tuple[dict[str, Any], Any]] = []

    async def completions(request: web.Request) -> web.Response:
        assert request.transport is not None
        seen.append((await request.json(), request.transport.get_extra_info("peername")))
        return web.json_response(COMPLETION)

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        async with solver() as solve:
            for _ in range(episodes):
                await solve(agent_run(str(server.make_url("/v1"))))
    finally:
        await server.close()
    return seen


def agent_run(base_url: str) -> AgentRun:
    return AgentRun(
        base_url=base_url, conversation_id="c-7", item=TaskItem(prompt="2+2="), seed=11,
        sampling=SamplingParams(max_new_tokens=5, temperature=0.7, top_p=0.9),
        extra_body={"conversation_id": "c-7"},
    )


def test_the_agent_asks_for_the_prompt_with_the_runs_sampling_settings_and_tags() -> None:
    [(body, _)] = asyncio.run(episodes_against_a_stand_in(1))
    assert body["prompt"] == "2+2=" and body["max_tokens"] == 5 and body["seed"] == 11
    assert body["temperature"] == 0.7 and body["top_p"] == 0.9
    assert body["conversation_id"] == "c-7", json.dumps(body)  # extra_body goes into the body


def test_episodes_of_one_session_reuse_one_connection() -> None:
    """A connection per episode costs the trainer's core 0.6 to 1.3 ms an episode."""
    seen = asyncio.run(episodes_against_a_stand_in(3))
    assert len(seen) == 3 and len({peer for _, peer in seen}) == 1


def test_a_finished_session_leaves_nothing_holding_its_event_loop() -> None:
    """A client left open past its run holds its connection and event loop: after each
    ``asyncio.run`` (a notebook cell, a test) one more loop would stay alive."""
    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []

    async def run() -> None:
        loops.append(weakref.ref(asyncio.get_running_loop()))
        assert len(await episodes_against_a_stand_in(2)) == 2

    for _ in range(2):
        asyncio.run(run())
    gc.collect()
    assert [ref() for ref in loops] == [None, None]
