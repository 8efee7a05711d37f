"""Training agents written against the ``openai`` client: a workflow over the server's records.

What it owns: :class:`OpenAIAgentWorkflow`, a :class:`core.protocols.RolloutWorkflow` that runs
an agent (any ``async`` function that talks to an OpenAI-compatible endpoint, e.g. with
``openai.AsyncOpenAI``) once per rollout request against a rollout server's ``/v1``, tagging
its requests with a conversation id (the agent passes :attr:`AgentRun.extra_body` to each call,
or the header in :attr:`AgentRun.headers`), then collects the conversation's records from the
server (``GET /tandem/conversations/{id}``: the exact token ids in and out, log-probs and
versions of every call) and turns them into one trajectory.

A conversation of several calls becomes one trajectory when each call's prompt extends the
previous call's prompt and output (the chat template re-renders the history the same way):
the model's tokens are actions trained with their own log-probs and versions; the tokens in
between (tool results, the user's next turn, template markers) are actions masked out of the
loss (``loss_mask`` 0). A conversation that breaks that prefix property is refused (it would
need one trajectory per call).

Invariants: one trajectory per request (the flow's contract), its actions stamped with the
versions the server reported; the group's agents run on one server (prefix cache), chosen by
the router's load.
"""

from __future__ import annotations

import asyncio
import inspect
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from core.config import ConfigError, import_named
from core.protocols import Agent, AgentRun, RolloutRequest, SamplingParams
from core.records import FinishReason, ResumePolicy, Trajectory, token_trajectory
from engines.server.openai_api import CONVERSATION_HEADER
from engines.server.router import ServerRolloutEngine
from engines.server.schemas import ConversationRecord

__all__ = ["OpenAIAgentWorkflow", "load_agent", "records_to_trajectory"]


def load_agent(path: str) -> Agent:
    """The ``async`` function ``path`` (``module:function``) names; :class:`ConfigError` naming
    ``engines.servers.agent`` when it cannot be imported or is not an ``async`` function."""
    agent = import_named(path, "engines.servers.agent")
    if not inspect.iscoroutinefunction(agent):
        raise ConfigError(f"engines.servers.agent: {path!r} is not an async function taking an AgentRun")
    return agent


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
    """Implements :class:`core.protocols.RolloutWorkflow` by running ``agent`` against the servers of
    ``engine`` (the router; named as the text workflow names its engine, so code that starts a
    bundle's router finds it the same way)."""

    def __init__(self, engine: ServerRolloutEngine, agent: Agent, *, decode: Callable[[list[int]], str],
                 sampling: SamplingParams | None = None) -> None:
        self.engine = engine
        self.agent = agent
        self._decode = decode
        self._sampling = sampling or SamplingParams()

    def rollout(self, requests: Sequence[RolloutRequest]) -> AsyncIterator[Trajectory]:
        return self._rollout(list(requests))

    async def _rollout(self, requests: list[RolloutRequest]) -> AsyncIterator[Trajectory]:
        await self.engine.start()
        groups: dict[int, list[RolloutRequest]] = {}
        for request in requests:
            groups.setdefault(request.prompt_id, []).append(request)
        tasks: set[asyncio.Task[Trajectory]] = set()
        try:
            for group in groups.values():
                endpoint = await self.engine.pick()
                endpoint.outstanding += len(group)
                tasks.update(asyncio.ensure_future(self._episode(r, endpoint)) for r in group)
            while tasks:
                done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    yield task.result()
        finally:
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks)

    async def _episode(self, request: RolloutRequest, endpoint: Any) -> Trajectory:
        conversation = f"{request.prompt_id}-{request.index}-{uuid.uuid4().hex[:12]}"
        run = AgentRun(
            base_url=endpoint.url + "/v1", conversation_id=conversation, item=request.group.item, seed=request.seed,
            evaluation=request.evaluation, sampling=self._sampling, extra_body={"conversation_id": conversation},
            headers={CONVERSATION_HEADER: conversation},
        )
        try:
            await self.agent(run)
            records = await endpoint.client.conversation(conversation)
        finally:
            endpoint.outstanding -= 1
        return records_to_trajectory(request.prompt_id, request.index, records, self._decode)
