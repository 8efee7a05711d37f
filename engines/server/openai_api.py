"""The OpenAI-compatible endpoints, recording what every request generated.

What it owns: ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions`` (rendered with
the model's chat template), in OpenAI's (and sglang's) request and response format, so an agent
written against the ``openai`` Python client runs against them unchanged; and the
:class:`ConversationLog`: for every request that names a conversation (``conversation_id`` in
the body, e.g. the client's ``extra_body``, or the ``X-Conversation-Id`` header) the exact token
ids in and out, each output token's log-prob and policy version. ``GET
/tandem/conversations/{id}`` returns a conversation's records and forgets them; a workflow
turns them into trajectories (``engines.server.agent``).

What generates behind them is an :class:`OpenAIBackend`: ``tandem serve``'s engine
(``engines.server.app``), or one of the router's servers for the recording proxy the run serves
its agents in front of vLLM servers (``engines.server.agent_proxy``). Both sample the same
:func:`~engines.server.sampling.engine_request`, so a call means the same on either.

Invariants:
- a record holds the tokens the model actually saw and produced (no re-tokenization of text);
  the log-probs are the engine's behaviour log-probs, the same quantity ``/generate`` returns;
- the log is bounded: past ``max_conversations`` open conversations the oldest is dropped
  (with a warning), so agents that never collect cannot grow the server without limit.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import OrderedDict
from typing import Any, Protocol

import structlog
from aiohttp import web

from tandem.core.protocols import GenerationRequest
from tandem.core.records import Trajectory
from tandem.engines.server.engine import Partial
from tandem.engines.server.http import error_response, parse
from tandem.engines.server.limits import BusyError, busy_response
from tandem.engines.server.sampling import engine_request
from tandem.engines.server.schemas import ChatCompletionRequest, CompletionRequest, ConversationRecord, SamplingParams

__all__ = ["ConversationLog", "OpenAIBackend", "add_openai_routes"]

log = structlog.get_logger("tandem.serve")
CONVERSATION_HEADER = "X-Conversation-Id"


class OpenAIBackend(Protocol):
    """What the endpoints need of whatever generates behind them (see the module docstring)."""

    model_path: str  # the model's id in /v1/models
    context: int  # tokens a prompt and its completion may take together
    tokenizer: Any  # encodes text prompts, renders chat templates, decodes completions
    request_context: dict[str, int]  # what validating a request needs (``schemas.request_context``)

    def admitted(self, requests: list[GenerationRequest]) -> contextlib.AbstractContextManager[None]:
        """Hold ``requests`` against the backend's caps while they are served: ValueError when
        they could never fit, :class:`~engines.server.limits.BusyError` when they do not fit now."""
        ...

    async def complete(self, rid: str, request: GenerationRequest) -> Trajectory | Partial:
        """Generate one admitted request to its end: its trajectory, or its partial output if
        the backend aborted it."""
        ...


class ConversationLog:
    """Records per conversation id, in the order their requests finished; bounded."""

    def __init__(self, max_conversations: int = 10_000) -> None:
        self._records: OrderedDict[str, list[ConversationRecord]] = OrderedDict()
        self._max = max_conversations

    def record(self, conversation_id: str | None, rid: str, request: GenerationRequest, result: Trajectory | Partial) -> None:
        """File what ``request`` generated under ``conversation_id`` (nothing for an untagged call)."""
        if conversation_id is None:
            return
        if isinstance(result, Trajectory):
            ids, lps, versions, resumed = result.payload.response_ids, result.behaviour_logprobs, result.versions, result.resumed
        else:
            ids, lps, versions, resumed = result.response_ids, result.logprobs, result.versions, result.resumed
        self.add(ConversationRecord(
            conversation_id=conversation_id, request_id=rid, prompt_ids=list(request.prompt_ids), output_ids=list(ids),
            logprobs=list(lps), versions=list(versions), finish_reason=_finish(result),
            resumed=None if resumed is None else resumed.value,
        ))

    def add(self, record: ConversationRecord) -> None:
        records = self._records.setdefault(record.conversation_id, [])
        records.append(record)
        self._records.move_to_end(record.conversation_id)
        while len(self._records) > self._max:
            dropped, _ = self._records.popitem(last=False)
            log.warning("conversation log full; dropped the oldest conversation", conversation_id=dropped)

    def pop(self, conversation_id: str) -> list[ConversationRecord]:
        return self._records.pop(conversation_id, [])


def _finish(result: Trajectory | Partial) -> str:
    if isinstance(result, Partial):
        return "abort"
    return result.finish_reason.value


class OpenAIEndpoints:
    """The routes over one backend; the calls naming a conversation go to ``conversations``."""

    def __init__(self, backend: OpenAIBackend, conversations: ConversationLog) -> None:
        self.backend = backend
        self.conversations = conversations

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.backend.model_path, "object": "model", "created": 0, "owned_by": "tandem",
                "root": self.backend.model_path, "max_model_len": self.backend.context}
        return web.json_response({"object": "list", "data": [card]})

    async def conversation(self, request: web.Request) -> web.Response:
        records = self.conversations.pop(request.match_info["conversation_id"])
        return web.json_response([r.model_dump(mode="json") for r in records])

    async def completions(self, request: web.Request) -> web.Response:
        req: CompletionRequest = await parse(request, CompletionRequest, context=self.backend.request_context)
        prompt_ids = req.prompt if isinstance(req.prompt, list) else list(self.backend.tokenizer(req.prompt)["input_ids"])
        result, rid, gen = await self._generate(request, req, prompt_ids, default_max_tokens=16)
        if isinstance(result, web.Response):
            return result
        ids, lps = _ids_and_logprobs(result)
        text = self.backend.tokenizer.decode(ids, skip_special_tokens=True)
        if req.echo:
            text = (req.prompt if isinstance(req.prompt, str) else self.backend.tokenizer.decode(prompt_ids)) + text
        logprobs = None
        if req.logprobs:
            tokens = [self.backend.tokenizer.decode([t]) for t in ids]
            offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
            logprobs = {"tokens": tokens, "token_logprobs": lps, "top_logprobs": None, "text_offset": offsets}
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": _finish(result)}
        return web.json_response({
            "id": f"cmpl-{rid}", "object": "text_completion", "created": int(time.time()), "model": req.model,
            "choices": [choice], "usage": _usage(gen, ids),
        })

    async def chat(self, request: web.Request) -> web.Response:
        req: ChatCompletionRequest = await parse(request, ChatCompletionRequest, context=self.backend.request_context)
        tokenizer = self.backend.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            return error_response(400, f"the model at {self.backend.model_path} has no chat template; use /v1/completions")
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        try:
            rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        except Exception as exc:  # the template refuses this conversation (a role order it raises on, ...)
            return error_response(400, f"messages: the model's chat template refused them: {type(exc).__name__}: {exc}")
        result, rid, gen = await self._generate(request, req, list(rendered["input_ids"]), default_max_tokens=None)
        if isinstance(result, web.Response):
            return result
        ids, lps = _ids_and_logprobs(result)
        logprobs = None
        if req.logprobs:
            logprobs = {"content": [
                {"token": tokenizer.decode([t]), "logprob": lp, "bytes": list(tokenizer.decode([t]).encode()), "top_logprobs": []}
                for t, lp in zip(ids, lps, strict=True)
            ]}
        message = {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": _finish(result)}
        return web.json_response({
            "id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(time.time()), "model": req.model,
            "choices": [choice], "usage": _usage(gen, ids),
        })

    async def _generate(self, request: web.Request, req: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int],
                        *, default_max_tokens: int | None) -> tuple[Any, str, GenerationRequest]:
        backend = self.backend
        max_new = req.max_completion_tokens or req.max_tokens or default_max_tokens
        # the request's numbers were checked when it was parsed: these are in range
        params = SamplingParams(
            max_new_tokens=max_new, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=-1 if req.top_k is None else req.top_k,
            stop=req.stop, sampling_seed=req.seed,
        )
        rid = uuid.uuid4().hex
        try:
            gen = engine_request(prompt_ids, params, params.sampling_seed, context=backend.context)
            admitted = backend.admitted([gen])
        except ValueError as exc:
            return error_response(400, str(exc)), rid, None  # type: ignore[return-value]
        try:
            with admitted:
                result = await backend.complete(rid, gen)
        except BusyError as exc:
            return busy_response(exc), rid, gen
        except Exception as exc:
            return error_response(500, f"{type(exc).__name__}: {exc}"), rid, gen
        self.conversations.record(req.conversation_id or request.headers.get(CONVERSATION_HEADER), rid, gen, result)
        return result, rid, gen


def _ids_and_logprobs(result: Trajectory | Partial) -> tuple[list[int], list[float]]:
    if isinstance(result, Trajectory):
        return list(result.payload.response_ids), list(result.behaviour_logprobs)
    return list(result.response_ids), list(result.logprobs)


def _usage(gen: GenerationRequest, ids: list[int]) -> dict[str, int]:
    return {"prompt_tokens": len(gen.prompt_ids), "completion_tokens": len(ids), "total_tokens": len(gen.prompt_ids) + len(ids)}


def add_openai_routes(app: web.Application, backend: OpenAIBackend,
                      conversations: ConversationLog | None = None) -> ConversationLog:
    """Register the OpenAI endpoints over ``backend`` and the conversation records on ``app``;
    the records go to ``conversations`` (a new log if None), which is returned."""
    conversations = conversations if conversations is not None else ConversationLog()
    api = OpenAIEndpoints(backend, conversations)
    app.router.add_get("/v1/models", api.models)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat)
    app.router.add_get("/tandem/conversations/{conversation_id}", api.conversation)
    return conversations
