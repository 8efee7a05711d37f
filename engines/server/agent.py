"""Training agents written against the ``openai`` client: a workflow over the server's records.

What it owns: :class:`OpenAIAgentWorkflow`, a :class:`core.protocols.RolloutWorkflow` that runs
an agent (any ``async`` function that talks to an OpenAI-compatible endpoint, e.g. with
``openai.AsyncOpenAI``) once per rollout request against the ``/v1`` its :class:`AgentGateway`
gives for the group's server, tagging its requests with a conversation id (the agent passes
:attr:`AgentRun.extra_body` to each call, or the header in :attr:`AgentRun.headers`), then
collects the conversation's records from the gateway (the exact token ids in and out, log-probs
and versions of every call) and turns them into one trajectory. The gateway is the server's own
endpoint for ``tandem serve``, which records the calls itself (:class:`ServerGateway`: ``GET
/tandem/conversations/{id}``), or a recording proxy in the run's process in front of servers
that keep no such record (vLLM's: ``engines.server.agent_proxy``).

A conversation of several calls becomes one trajectory when each call's prompt extends the
previous call's prompt and output (the chat template re-renders the history the same way):
the model's tokens are actions trained with their own log-probs and versions; the tokens in
between (tool results, the user's next turn, template markers) are actions masked out of the
loss (``loss_mask`` 0). A conversation that breaks that prefix property is refused (it would
need one trajectory per call).

An agent that keeps state across episodes (an ``openai`` client whose connections stay open, a
sandbox pool) is given as an :data:`core.protocols.AgentSession`: the workflow enters it in the
run's loop before the first episode and exits it in :meth:`OpenAIAgentWorkflow.aclose`, which the
bundle's async close runs when the run ends.

Invariants: one trajectory per request (the flow's contract), its actions stamped with the
versions the server reported; the group's agents run on one server (prefix cache), chosen by
the router's load; a session is entered at most once and exited once, however the run ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

import structlog
from pydantic import SecretStr

from tandem.core.config import ConfigError, import_named
from tandem.core.protocols import Agent, AgentRun, AgentSession, RolloutRequest, SamplingParams
from tandem.core.records import FinishReason, ResumePolicy, Trajectory, token_trajectory
from tandem.engines.server.openai_api import CONVERSATION_HEADER
from tandem.engines.server.router import Endpoint, ServerRolloutEngine
from tandem.engines.server.schemas import ConversationRecord

__all__ = ["AgentGateway", "OpenAIAgentWorkflow", "ServerGateway", "agent_session", "load_agent", "records_to_trajectory"]

log = structlog.get_logger("tandem.agent")
# How long a session's exit may take before the run ends without it: user code (closing clients,
# sandboxes) must not keep a finished run, and the servers it talks to, from stopping.
SESSION_EXIT_TIMEOUT_S = 30.0


class AgentGateway(Protocol):
    """Where an episode's agent calls when its group was given ``endpoint``, and where that
    conversation's records are read back once the agent is done (each record read once)."""

    async def base_url(self, endpoint: Endpoint) -> str:
        """The ``/v1`` base URL for ``openai.AsyncOpenAI``."""
        ...

    async def records(self, endpoint: Endpoint, conversation_id: str) -> list[ConversationRecord]:
        """The conversation's records, in the order its calls finished; then forgotten."""
        ...


class ServerGateway:
    """The servers' own OpenAI endpoint, for servers that record the calls (``tandem serve``)."""

    async def base_url(self, endpoint: Endpoint) -> str:
        return endpoint.url + "/v1"

    async def records(self, endpoint: Endpoint, conversation_id: str) -> list[ConversationRecord]:
        return await endpoint.client.conversation(conversation_id)


def agent_session(agent: Agent) -> AgentSession:
    """A plain per-episode agent as a session that holds nothing."""
    return lambda: contextlib.nullcontext(agent)


def load_agent(path: str) -> AgentSession:
    """What ``path`` (``module:name``) names, as a session: an ``async`` function (a per-episode
    :data:`~core.protocols.Agent`) or an ``asynccontextmanager`` function yielding one (an
    :data:`~core.protocols.AgentSession`). :class:`ConfigError` naming ``engines.servers.agent``
    when it cannot be imported or is neither."""
    agent = import_named(path, "engines.servers.agent")
    if inspect.iscoroutinefunction(agent):
        return agent_session(agent)
    if inspect.isasyncgenfunction(inspect.unwrap(agent)):
        return agent
    raise ConfigError(f"engines.servers.agent: {path!r} is neither an async function taking an AgentRun "
                      "nor an asynccontextmanager function yielding one")


def records_to_trajectory(prompt_id: int, index: int, records: Sequence[ConversationRecord],
                          decode: Callable[[list[int]], str]) -> Trajectory:
    """One conversation's records as one trajectory (see the module docstring)."""
    if not records:
        raise ValueError(f"conversation of {prompt_id}/{index} made no model call")
    first = records[0]
    context = list(first.prompt_ids) + list(first.output_ids)
    actions, logprobs, versions = list(first.output_ids), list(first.logprobs), list(first.versions)
    mask = [1] * len(actions)
    for record in records[1:]:
        if record.prompt_ids[: len(context)] != context:
            raise ValueError(f"conversation {record.conversation_id}: call {record.request_id}'s prompt does not extend "
                             "the previous call's prompt and output (one trajectory per call would be needed)")
        between = record.prompt_ids[len(context):]
        carried = versions[-1] if versions else 0  # masked tokens: never trained, versions stay monotone
        actions += between + list(record.output_ids)
        logprobs += [0.0] * len(between) + list(record.logprobs)
        versions += [carried] * len(between) + list(record.versions)
        mask += [0] * len(between) + [1] * len(record.output_ids)
        context = list(record.prompt_ids) + list(record.output_ids)
    last = records[-1].finish_reason
    resumed = next((ResumePolicy(r.resumed) for r in records if r.resumed is not None), None)
    trained = [a for a, m in zip(actions, mask, strict=True) if m]
    return token_trajectory(
        prompt_id, index, list(first.prompt_ids), actions, logprobs, versions,
        FinishReason.LENGTH if last == "length" else FinishReason.STOP, text=decode(trained),
        loss_mask=None if all(mask) else mask, resumed=resumed,
    )


class OpenAIAgentWorkflow:
    """Implements :class:`core.protocols.RolloutWorkflow` by running the agent ``session`` yields
    against the servers of ``engine`` (the router; named as the text workflow names its engine, so
    code that starts a bundle's router finds it the same way)."""

    def __init__(self, engine: ServerRolloutEngine, session: AgentSession, *, decode: Callable[[list[int]], str],
                 sampling: SamplingParams | None = None, api_key: SecretStr | None = None,
                 gateway: AgentGateway | None = None) -> None:
        self.engine = engine
        self._session = session
        self._gateway = gateway or ServerGateway()
        # the servers' API key for the agents' clients (openai's needs a value even without one)
        self._api_key = api_key.get_secret_value() if api_key is not None else "unused"
        self._decode = decode
        self._sampling = sampling or SamplingParams()
        self._closing = asyncio.Event()
        self._ready: asyncio.Future[Agent] | None = None
        self._holder: asyncio.Task[None] | None = None

    def rollout(self, requests: Sequence[RolloutRequest]) -> AsyncIterator[Trajectory]:
        return self._rollout(list(requests))

    async def _agent(self) -> Agent:
        """The session's agent, entering the session on first use (once, however many rollouts
        ask at once; an entry that fails fails every rollout with the session's error)."""
        if self._closing.is_set():
            raise RuntimeError("rollout() on a closed agent workflow")
        if self._holder is None:
            self._ready = asyncio.get_running_loop().create_future()
            self._holder = asyncio.ensure_future(self._hold(self._ready))
        assert self._ready is not None
        await asyncio.wait([self._ready, self._holder], return_when=asyncio.FIRST_COMPLETED)
        if not self._ready.done():
            self._holder.result()  # the session failed before it yielded: raise its error
        return self._ready.result()

    async def _hold(self, ready: asyncio.Future[Agent]) -> None:
        """Owns the session from entry to exit in one task, so a session holding a task group or a
        cancel scope (anyio's, an MCP client's) exits in the task that entered it."""
        async with self._session() as agent:
            if not callable(agent):
                raise ConfigError(f"engines.servers.agent: the session yielded {type(agent).__name__}, "
                                  "not an async function taking an AgentRun")
            ready.set_result(agent)
            await self._closing.wait()

    async def aclose(self) -> None:
        """Exit the session (if it was entered) in the run's loop; later rollouts are refused.
        An exit that fails or outlasts ``SESSION_EXIT_TIMEOUT_S`` is logged, not raised: the run's
        own outcome stands and the rest of the bundle still closes. (An entry that failed was
        already raised to the rollouts that asked.)"""
        self._closing.set()
        holder = self._holder
        if holder is None:
            return
        done, _ = await asyncio.wait([holder], timeout=SESSION_EXIT_TIMEOUT_S)
        if not done:
            holder.cancel()
            log.error("the agent session did not exit in time; cancelled", timeout_s=SESSION_EXIT_TIMEOUT_S)
        elif self._ready is not None and self._ready.done() and not holder.cancelled() and holder.exception() is not None:
            log.error("the agent session failed on exit", exc_info=holder.exception())

    async def _rollout(self, requests: list[RolloutRequest]) -> AsyncIterator[Trajectory]:
        agent = await self._agent()
        await self.engine.start()
        groups: dict[int, list[RolloutRequest]] = {}
        for request in requests:
            groups.setdefault(request.prompt_id, []).append(request)
        tasks: set[asyncio.Task[Trajectory]] = set()
        try:
            for group in groups.values():
                endpoint = await self.engine.pick()
                endpoint.outstanding += len(group)
                tasks.update(asyncio.ensure_future(self._episode(agent, r, endpoint)) for r in group)
            while tasks:
                done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    yield task.result()
        finally:
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks)

    async def _episode(self, agent: Agent, request: RolloutRequest, endpoint: Endpoint) -> Trajectory:
        conversation = f"{request.prompt_id}-{request.index}-{uuid.uuid4().hex[:12]}"
        try:
            run = AgentRun(
                base_url=await self._gateway.base_url(endpoint), conversation_id=conversation, item=request.group.item,
                seed=request.seed, evaluation=request.evaluation, sampling=self._sampling,
                extra_body={"conversation_id": conversation}, headers={CONVERSATION_HEADER: conversation},
                api_key=self._api_key,
            )
            await agent(run)
            records = await self._gateway.records(endpoint, conversation)
        finally:
            endpoint.outstanding -= 1
        return records_to_trajectory(request.prompt_id, request.index, records, self._decode)
