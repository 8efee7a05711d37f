"""The recording proxy a run serves its agents in front of servers that keep no record of their
calls (vLLM's): each group's agents reach the server the router gave the group, a call whose
server is gone is answered by another and still recorded, the run's API key is required, and
no port outlives it. Its records are checked against the trainer in ``test_server_openai.py``
(the same endpoints as ``tandem serve``'s); against vLLM itself in
``tests/integration/test_vllm_flow.py``."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from pydantic import SecretStr
from tiny_lm import decode, encode

openai = pytest.importorskip("openai")

from tandem.core.protocols import AgentRun, RolloutRequest
from tandem.core.records import PromptGroup, TaskItem
from tandem.engines.server.agent import OpenAIAgentWorkflow, agent_session
from tandem.engines.server.agent_proxy import AgentProxy
from tandem.engines.server.router import ServerRolloutEngine
from tandem.engines.server.weights import free_port
from tests.unit.engines.server.test_server_support import proxied


def complete(base_url: str, conversation: str, *, api_key: str = "unused") -> Any:
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    return client.completions.create(model="m", prompt="1+2=", max_tokens=4, seed=5,
                                     extra_body={"conversation_id": conversation})


def listening(url: str) -> bool:
    parts = urlsplit(url)
    with socket.socket() as sock:
        return sock.connect_ex((parts.hostname, parts.port)) == 0


async def test_each_groups_agents_call_the_server_the_router_gave_the_group(model_dir: Path) -> None:
    urls: dict[str, str] = {}

    async def agent(run: AgentRun) -> None:
        urls[run.conversation_id] = run.base_url
        await complete(run.base_url, run.conversation_id)

    groups = [PromptGroup(p, TaskItem("1+2="), n=2) for p in range(2)]
    async with proxied(model_dir, count=2) as (proxy, router):
        workflow = OpenAIAgentWorkflow(router, agent_session(agent), decode=decode, gateway=proxy)
        out = [t async for t in workflow.rollout([RolloutRequest(g, i, seed=i) for g in groups for i in range(2)])]
        served = [ep.served for ep in router.endpoints]
        outstanding = [ep.outstanding for ep in router.endpoints]
    by_group = {p: {url for conversation, url in urls.items() if conversation.startswith(f"{p}-")} for p in range(2)}
    assert sorted(map(len, by_group.values())) == [1, 1] and by_group[0] != by_group[1]  # one server per group
    assert {u.split("/servers/")[1] for u in urls.values()} == {"0/v1", "1/v1"}
    assert served == [2, 2] and outstanding == [0, 0]
    assert all(t.num_actions == 4 and t.payload.prompt_ids == encode("1+2=") for t in out) and len(out) == 4
    assert proxy.conversations.pop(next(iter(urls))) == []  # the workflow read and forgot every record


async def test_a_call_whose_server_is_gone_is_answered_by_another_and_recorded(model_dir: Path) -> None:
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there: the connection is refused
    async with proxied(model_dir, urls=[gone]) as (proxy, router):
        base = await proxy.base_url(router.endpoints[0])
        await complete(base, "c")  # sent to the dead server, retried on the live one
        await complete(base, "c")  # the conversation goes on: straight to a server in service
        records = await proxy.records(router.endpoints[0], "c")
        in_service = [ep.in_service for ep in router.endpoints]
        served_by = [ep.served for ep in router.endpoints]
    assert in_service == [False, True] and served_by == [0, 2]
    assert [len(r.output_ids) for r in records] == [4, 4] and all(r.versions == [0] * 4 for r in records)


async def test_the_proxy_requires_the_runs_api_key(model_dir: Path) -> None:
    async with proxied(model_dir, api_key=SecretStr("k-123")) as (proxy, router):
        base = await proxy.base_url(router.endpoints[0])
        with pytest.raises(openai.AuthenticationError):
            await complete(base, "a")
        await complete(base, "a", api_key="k-123")
        assert len(await proxy.records(router.endpoints[0], "a")) == 1


def test_no_port_outlives_the_proxy_whether_or_not_its_loop_closed_it() -> None:
    async def serve(close_in_loop: bool) -> AgentProxy:
        router = ServerRolloutEngine(["http://127.0.0.1:9"], decode=decode, live_updates=True, request_timeout_s=5,
                                     health_interval_s=30, wait_for_server_s=1)
        proxy = AgentProxy(router, tokenizer=None, model_path="m", context=64, vocab_size=20)
        await proxy.start()
        assert proxy.url is not None and listening(proxy.url)
        if close_in_loop:
            await proxy.aclose()
        router.close()
        return proxy

    for close_in_loop in (True, False):
        proxy = asyncio.run(serve(close_in_loop))
        proxy.close()  # the components' close callback, after the run's loop has ended
        assert proxy.url is not None and not listening(proxy.url)
