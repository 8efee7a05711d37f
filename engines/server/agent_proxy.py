"""The OpenAI endpoint a run serves its own agents in front of rollout servers that record nothing.

Why it exists: an agent written against the ``openai`` client is trained from the records of its
calls: the exact token ids in and out, each output token's behaviour log-prob, and the policy
version that sampled it. ``tandem serve`` records them itself (``engines.server.openai_api``).
vLLM's own ``/v1`` keeps no per-conversation record, and even with ``return_token_ids`` and
log-probs its answers carry no weight versions, which a run that updates weights under running
requests must have. vLLM's token-in, token-out route (``/inference/v1/generate``, through
:class:`~engines.vllm.server.VllmServerClient`) returns all three exactly. So the run answers its
agents' OpenAI calls itself and generates each one through the router.

What it owns: :class:`AgentProxy`, one aiohttp application per run, on a free port of 127.0.0.1,
in the run's own event loop, with tandem serve's OpenAI endpoints (the same request schemas,
chat-template rendering, responses and records: ``openai_api.add_openai_routes``) over each of
the router's servers at ``/servers/{i}/v1``, each a :class:`RoutedServer`; prompts are rendered
and encoded with the run's tokenizer (the trainer's, ``engines.chat_template`` included). It is
the agent workflow's :class:`~engines.server.agent.AgentGateway`: an episode's ``base_url`` names
the server its group was given (one server per group: its prefix cache), and the records stay in
this process (one :class:`~engines.server.openai_api.ConversationLog`), read without HTTP.

Failures: a call whose server goes away is handled as the router handles its own requests
(:meth:`~engines.server.router.ServerRolloutEngine.sample`): sent once more, from scratch with
the same seed, to a server in service; the conversation's later calls go to a server in service
while its own is out. A second loss answers 500 with the error, which fails the episode (the
generate role's retry policy takes over). The records never lived on the server, so none are
lost with it.

Invariants: bound to loopback, and needing the servers' API key when the run has one (what the
agents are given); started at most once, in the run's loop, on the first episode;
:meth:`AgentProxy.aclose` (in that loop) stops it, and :meth:`AgentProxy.close` closes its
listening socket if the loop ended first, so its port never outlives the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

from aiohttp import web
from pydantic import SecretStr

from tandem.core.protocols import GenerationRequest
from tandem.core.records import Trajectory
from tandem.engines.server.auth import ApiKeys, auth_middleware
from tandem.engines.server.limits import ServerLimits
from tandem.engines.server.openai_api import ConversationLog, add_openai_routes
from tandem.engines.server.router import Endpoint, ServerRolloutEngine
from tandem.engines.server.schemas import ConversationRecord, request_context

__all__ = ["AgentProxy", "RoutedServer"]

_HOST = "127.0.0.1"


class RoutedServer:
    """One of the router's servers as the OpenAI endpoints' backend (``openai_api.OpenAIBackend``)."""

    def __init__(self, router: ServerRolloutEngine, endpoint: Endpoint, *, tokenizer: Any, model_path: str, context: int,
                 vocab_size: int) -> None:
        self._router = router
        self._endpoint = endpoint
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.context = context
        self.request_context = request_context(vocab_size, ServerLimits().max_top_logprobs)

    def admitted(self, requests: list[GenerationRequest]) -> contextlib.AbstractContextManager[None]:
        # No caps of its own: only the run's agents call it, the server queues what it cannot
        # batch yet, and the router's request timeout bounds each call.
        return contextlib.nullcontext()

    async def complete(self, rid: str, request: GenerationRequest) -> Trajectory:
        endpoint = self._endpoint if self._endpoint.in_service else await self._router.pick()
        endpoint.outstanding += 1  # released by sample(), as for the router's own requests
        return await self._router.sample(request, endpoint)


class AgentProxy:
    """The run's OpenAI endpoint for its agents over ``router``'s servers (see the module docstring)."""

    def __init__(self, router: ServerRolloutEngine, *, tokenizer: Any, model_path: str, context: int, vocab_size: int,
                 api_key: SecretStr | None = None) -> None:
        self._router = router
        self._model = {"tokenizer": tokenizer, "model_path": model_path, "context": context, "vocab_size": vocab_size}
        self._keys = ApiKeys(api_key=api_key)
        self.conversations = ConversationLog()
        self.url: str | None = None  # http://127.0.0.1:PORT once started
        self._started: asyncio.Future[None] | None = None
        self._runner: web.AppRunner | None = None
        self._socket: socket.socket | None = None

    async def start(self) -> None:
        """Serve, once the router is started (its servers are the routes). Idempotent."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._start())
        await asyncio.shield(self._started)

    async def _start(self) -> None:
        await self._router.start()
        app = web.Application(client_max_size=ServerLimits().max_body_bytes, middlewares=[auth_middleware(self._keys)])
        for i, endpoint in enumerate(self._router.endpoints):
            routes = web.Application()
            add_openai_routes(routes, RoutedServer(self._router, endpoint, **self._model), self.conversations)
            app.add_subapp(f"/servers/{i}", routes)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        self._socket = socket.create_server((_HOST, 0))
        await web.SockSite(self._runner, self._socket).start()
        self.url = f"http://{_HOST}:{self._socket.getsockname()[1]}"

    async def base_url(self, endpoint: Endpoint) -> str:
        await self.start()
        return f"{self.url}/servers/{self._router.endpoints.index(endpoint)}/v1"

    async def records(self, endpoint: Endpoint, conversation_id: str) -> list[ConversationRecord]:
        return self.conversations.pop(conversation_id)

    async def aclose(self) -> None:
        """Stop serving (in the run's loop): the port and every connection closed."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner, self._socket = None, None

    def close(self) -> None:
        """Close the listening socket if :meth:`aclose` did not run (the run's loop ended first)."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None
