"""The shipped OpenAI-client agent: what it asks the endpoint for, and that it leaves nothing open.

The endpoint here is a stand-in that answers like ``/v1/completions`` and keeps the request
bodies; the agent trained end to end against ``tandem serve`` is in
``tests/integration/test_server_flow.py``.
"""

from __future__ import annotations

import asyncio
import gc
import json
import weakref
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

from core.protocols import AgentRun, SamplingParams
from core.records import TaskItem
from tasks.arithmetic.openai_agent import solve

COMPLETION = {
    "id": "cmpl-0", "object": "text_completion", "created": 0, "model": "tandem",
    "choices": [{"index": 0, "text": "4", "finish_reason": "stop", "logprobs": None}],
}


async def run_agent_against_a_stand_in(run_of: Any) -> list[dict[str, Any]]:
    """Serve a stand-in ``/v1/completions`` on a free port, run the agent once, return the bodies."""
    bodies: list[dict[str, Any]] = []

    async def completions(request: web.Request) -> web.Response:
        bodies.append(await request.json())
        return web.json_response(COMPLETION)

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        await solve(run_of(str(server.make_url("/v1"))))
    finally:
        await server.close()
    return bodies


def agent_run(base_url: str) -> AgentRun:
    return AgentRun(
        base_url=base_url, conversation_id="c-7", item=TaskItem(prompt="2+2="), seed=11,
        sampling=SamplingParams(max_new_tokens=5, temperature=0.7, top_p=0.9),
        extra_body={"conversation_id": "c-7"},
    )


def test_the_agent_asks_for_the_prompt_with_the_runs_sampling_settings_and_tags() -> None:
    [body] = asyncio.run(run_agent_against_a_stand_in(agent_run))
    assert body["prompt"] == "2+2=" and body["max_tokens"] == 5 and body["seed"] == 11
    assert body["temperature"] == 0.7 and body["top_p"] == 0.9
    assert body["conversation_id"] == "c-7", json.dumps(body)  # extra_body goes into the body


def test_an_episode_leaves_no_client_holding_its_event_loop() -> None:
    """A client kept past its episode holds its connection and event loop: after each
    ``asyncio.run`` (a notebook cell, a test) one more loop would stay alive."""
    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []

    async def episode() -> None:
        loops.append(weakref.ref(asyncio.get_running_loop()))
        assert len(await run_agent_against_a_stand_in(agent_run)) == 1

    for _ in range(2):
        asyncio.run(episode())
    gc.collect()
    assert [ref() for ref in loops] == [None, None]
