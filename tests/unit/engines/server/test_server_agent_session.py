"""An agent's session lives as long as the run: entered once before the first episode, in the
run's loop, and exited once when the run closes, in the task that entered it.

The router here is a stand-in that answers every conversation with one recorded call, so these
tests are about the workflow's lifecycle; the agent against ``tandem serve`` is in
``test_server_openai.py`` and ``tests/integration/test_server_flow.py``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from tandem.core.components import Components
from tandem.core.config import ConfigError
from tandem.core.protocols import RolloutRequest
from tandem.core.records import PromptGroup, TaskItem
from tandem.engines.server import agent as agent_module
from tandem.engines.server.agent import OpenAIAgentWorkflow
from tandem.engines.server.schemas import ConversationRecord
from tests.unit.engines.agents_for_tests import SessionLog, failing_session, recording_session, yields_no_agent


class RecordedCalls:
    async def conversation(self, conversation_id: str) -> list[ConversationRecord]:
        return [ConversationRecord(conversation_id=conversation_id, request_id="r0", prompt_ids=[1, 2], output_ids=[3],
                                   logprobs=[-0.5], versions=[0], finish_reason="stop")]


@dataclass
class StandInEndpoint:
    url: str = "http://127.0.0.1:1"
    outstanding: int = 0
    client: RecordedCalls = field(default_factory=RecordedCalls)


class StandInRouter:
    def __init__(self) -> None:
        self.endpoint = StandInEndpoint()

    async def start(self) -> None:
        pass

    async def pick(self) -> StandInEndpoint:
        return self.endpoint


def workflow(session: Any) -> OpenAIAgentWorkflow:
    return OpenAIAgentWorkflow(StandInRouter(), session, decode=lambda ids: " ".join(map(str, ids)))  # type: ignore[arg-type]


def requests(prompt_id: int, n: int = 2) -> list[RolloutRequest]:
    group = PromptGroup(prompt_id, TaskItem("1+1"), n=n)
    return [RolloutRequest(group, i, seed=i) for i in range(n)]


async def collect(flow: OpenAIAgentWorkflow, prompt_id: int) -> list[int]:
    return sorted([t.index async for t in flow.rollout(requests(prompt_id))])


async def test_concurrent_rollouts_share_one_entry_and_the_session_exits_at_close_in_the_task_that_entered_it() -> None:
    log = SessionLog()
    flow = workflow(recording_session(log))
    assert await asyncio.gather(collect(flow, 0), collect(flow, 1)) == [[0, 1], [0, 1]]
    assert await collect(flow, 2) == [0, 1]
    assert len(log.entered_in) == 1 and log.exited_in == []  # open between rollouts
    assert len(log.episodes) == 6
    await flow.aclose()
    assert log.exited_in == log.entered_in  # one exit, in the entering task (task groups, cancel scopes)
    await flow.aclose()  # a second close does nothing
    assert len(log.exited_in) == 1


async def test_a_rollout_after_close_is_refused() -> None:
    flow = workflow(recording_session(SessionLog()))
    await flow.aclose()
    with pytest.raises(RuntimeError, match="closed agent workflow"):
        await collect(flow, 0)


async def test_a_session_that_fails_to_start_fails_the_rollout_with_its_own_error() -> None:
    flow = workflow(failing_session)
    with pytest.raises(ConnectionError, match="sandbox pool unreachable"):
        await collect(flow, 0)
    await flow.aclose()  # logged, not raised: the run's own failure is the one reported


async def test_a_session_must_yield_an_agent() -> None:
    flow = workflow(yields_no_agent)
    with pytest.raises(ConfigError, match="engines.servers.agent: the session yielded str"):
        await collect(flow, 0)
    await flow.aclose()


async def test_a_session_whose_exit_hangs_is_cancelled_so_the_run_still_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_module, "SESSION_EXIT_TIMEOUT_S", 0.05)
    log = SessionLog()
    flow = workflow(recording_session(log, hang_on_exit=True))
    await collect(flow, 0)
    await asyncio.wait_for(flow.aclose(), timeout=5)
    assert len(log.exited_in) == 1


async def test_the_bundle_closes_its_engines_even_when_an_async_closer_fails() -> None:
    closed: list[str] = []

    async def failing_aclose() -> None:
        raise OSError("agent session exit failed")

    components = Components(prompts=None, workflow=None, trainer=None, reward=None, weight_sync=None,  # type: ignore[arg-type]
                            close_callbacks=[lambda: closed.append("engines")], aclose_callbacks=[failing_aclose])
    with pytest.raises(OSError, match="agent session exit failed"):
        await components.aclose()
    assert closed == ["engines"]
