"""A ``RolloutEngine`` over N rollout servers: routing, health, failover and partial rollouts.

What it owns: one ``aiohttp`` session (one connection pool) and a :class:`ServerClient` per
server; which servers are in service; how many requests each has outstanding; and the policy
version every server serves (what the weight syncs reported).

- Routing: a call's requests are grouped by prompt; each group goes whole to the server with
  the fewest outstanding requests (a group's samples share a prompt, so they share one
  server's prefix), its requests sent one by one so they batch continuously there.
- Back-pressure: a server at its caps answers 429; the request waits the ``Retry-After`` it
  names and goes again to the same server (still in service: busy is not gone).
- Health: every ``health_interval_s`` each server's ``/health`` and the weight version it
  reports (``/get_model_info``). A server that fails, or drops a request's connection, is taken
  out of service; each request it held is sent once more, to a server in service (waiting for
  one to come back if none is), from scratch with the same seed: delivered exactly once. A
  second loss fails the request (the generate role's retry policy takes over).
- Coming back: a server that answers again is given the trainer's current weights (``resync``,
  set by the builder) before any work reaches it, whenever it reports an older version than
  the others serve (a restarted server holds the model file's weights). A restart faster than
  the health checks is caught by the answer itself: one that reports older weights than the
  router gave every server is discarded and its request retried (as for a lost server).
- Partial rollouts: with ``live_updates`` (tandem's servers) weights change under running
  requests, and every token comes back with its version. Otherwise (sglang) a weight update
  pauses generation (``/pause_generation``, mode ``abort``): requests in flight come back
  aborted with their partial output; once the update is in, each is resumed with its prompt
  plus the tokens so far (the server re-encodes that prefix under the new weights: the
  recompute policy) and the rest of its token budget, each segment's tokens stamped with the
  version served while it ran. To the flow a resumed trajectory looks exactly like one the
  in-process engine resumed (``resumed = recompute``).

Invariants: each ``generate`` request yields exactly one trajectory or the call raises; tokens'
versions never decrease along a trajectory; requests never go to a server out of service.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

import aiohttp
import numpy as np
import structlog

from tandem.core.protocols import GenerationRequest
from tandem.core.records import FinishReason, ResumePolicy, Trajectory, token_trajectory
from tandem.engines.server.auth import ApiKeys
from tandem.engines.server.client import ServerBusyError, ServerClient, ServerError, ServerGoneError

__all__ = ["Endpoint", "NoServerError", "ServerRolloutEngine", "served_version"]

log = structlog.get_logger("tandem.router")


class NoServerError(ServerGoneError):
    """No server came back into service within the wait."""


@dataclass(slots=True, eq=False)
class Endpoint:
    """One server as the router sees it."""

    url: str
    client: ServerClient
    outstanding: int = 0  # requests sent and not yet answered
    in_service: bool = True
    resyncing: bool = False  # back, being given the current weights before any work
    served: int = 0  # requests answered over the run


def segment_seed(request: GenerationRequest, done: int) -> int:
    """The sampling seed of a request's segment that starts after ``done`` tokens: a function
    of the request alone, so a retried request draws the same tokens."""
    return int(np.random.SeedSequence([request.seed, request.prompt_id, request.index, done]).generate_state(1)[0])


def served_version(text: str | None) -> int:
    """The step a server says it serves; a server that was never updated (sglang says
    ``default``) serves the model file's weights: version 0."""
    try:
        return int(text) if text is not None else 0
    except ValueError:
        return 0


class ServerRolloutEngine:
    """Implements :class:`core.protocols.RolloutEngine` over the servers at ``urls``."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        decode: Callable[[list[int]], str],
        live_updates: bool,
        request_timeout_s: float,
        health_interval_s: float,
        wait_for_server_s: float,
        ready: Callable[[], Awaitable[None]] | None = None,
        client: Callable[[str, aiohttp.ClientSession], ServerClient] | None = None,
        keys: ApiKeys | None = None,
    ) -> None:
        if not urls:
            raise ValueError("a server rollout engine needs at least one server")
        self.urls = list(urls)
        self.live_updates = live_updates
        self._decode = decode
        self._request_timeout_s = request_timeout_s
        self._health_interval_s = health_interval_s
        self._wait_s = wait_for_server_s
        self._ready = ready
        # A server's client: sglang's API by default (tandem serve, sglang); vLLM's has its own.
        self._client = client or (lambda url, session: ServerClient(url, session, request_timeout_s=request_timeout_s,
                                                                    keys=keys))
        self.resync: Callable[[], Awaitable[None]] | None = None  # set by the builder
        self.endpoints: list[Endpoint] = []
        self._version = 0
        self._session: aiohttp.ClientSession | None = None
        self._started: asyncio.Future[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._in_service = asyncio.Event()
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._pauses = 0  # pause_generation calls so far: an abort after one of ours is ours
        self._returning: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> None:
        """Wait until the servers are up, open the connection pool, start the health checks.
        Idempotent; every public coroutine calls it first."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._start())
        await asyncio.shield(self._started)

    async def _start(self) -> None:
        if self._ready is not None:
            await self._ready()
        # One pool for every server; no per-host cap (a server batches every request it has). Idle
        # connections are let go before the servers let them go: vLLM's and sglang's uvicorn close
        # an idle connection after 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE), aiohttp reuses one for 15 s by
        # default, and a request written on a connection the server is closing fails with "connection
        # reset": a healthy server was taken out of service that way in a two-server vLLM test.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=3.0))
        self.endpoints = [Endpoint(url, self._client(url, self._session)) for url in self.urls]
        self._in_service.set()
        self._watcher = asyncio.ensure_future(self._watch())

    def close(self) -> None:
        """Stop the health checks and close the pool (synchronous: a components close callback)."""
        if self._watcher is not None:
            self._watcher.cancel()
        for task in self._returning:
            task.cancel()
        if self._session is not None:
            connector = self._session.connector
            self._session.detach()
            if connector is not None:
                # The synchronous part of the connector's (async) close: every connection closed now.
                connector._close()
            self._session = None

    # -------------------------------------------------------------------- versions

    @property
    def version(self) -> int:
        """The newest version a weight sync reported loaded into every server in service."""
        return self._version

    def loaded(self, version: int) -> None:
        self._version = max(self._version, version)

    def receivers(self) -> list[str]:
        """The servers a weight transfer goes to: those in service and those coming back."""
        return [ep.url for ep in self.endpoints if ep.in_service or ep.resyncing]

    async def pause_generation(self) -> None:
        """Before a weight update of servers that cannot update under running requests: their
        requests in flight come back aborted and are resumed after :meth:`continue_generation`."""
        await self.start()
        self._unpaused.clear()
        self._pauses += 1
        await self._each(lambda ep: ep.client.pause_generation("abort"))

    async def continue_generation(self) -> None:
        await self._each(lambda ep: ep.client.continue_generation())
        self._unpaused.set()

    async def _each(self, call: Callable[[Endpoint], Awaitable[None]]) -> None:
        serving = [ep for ep in self.endpoints if ep.in_service or ep.resyncing]
        results = await asyncio.gather(*(call(ep) for ep in serving), return_exceptions=True)
        for ep, result in zip(serving, results, strict=True):
            if isinstance(result, ServerGoneError):
                self._take_out(ep, str(result))
            elif isinstance(result, BaseException):
                raise result

    # ------------------------------------------------------------------- generation

    def generate(self, requests: Sequence[GenerationRequest]) -> AsyncIterator[Trajectory]:
        return self._generate(list(requests))

    async def _generate(self, requests: list[GenerationRequest]) -> AsyncIterator[Trajectory]:
        await self.start()
        groups: dict[int, list[GenerationRequest]] = {}
        for request in requests:
            groups.setdefault(request.prompt_id, []).append(request)
        tasks: set[asyncio.Task[Trajectory]] = set()
        try:
            for group in groups.values():
                endpoint = await self.pick()
                endpoint.outstanding += len(group)  # claimed now, so the next group sees the load
                tasks.update(asyncio.ensure_future(self.sample(request, endpoint)) for request in group)
            while tasks:
                done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    yield task.result()  # an error cancels the rest (finally)
        finally:
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks)

    async def pick(self) -> Endpoint:
        """The server in service with the fewest outstanding requests; waits for one to be in
        service (:class:`NoServerError` after ``wait_for_server_s``)."""
        while True:
            serving = [ep for ep in self.endpoints if ep.in_service]
            if serving:
                return min(serving, key=lambda ep: ep.outstanding)
            self._in_service.clear()
            try:
                await asyncio.wait_for(self._in_service.wait(), self._wait_s)
            except TimeoutError:
                raise NoServerError(f"no rollout server in service for {self._wait_s:g} s: {self.urls}") from None

    async def sample(self, request: GenerationRequest, endpoint: Endpoint) -> Trajectory:
        """One request on ``endpoint``, sent once more to another server if that one goes away.
        The caller claimed its place in ``endpoint.outstanding`` (released here): a group claims
        all its requests before the first is sent, so the next group's pick sees the load."""
        try:
            return await self._run(request, endpoint)
        except ServerGoneError as exc:
            self._take_out(endpoint, str(exc))
        finally:
            endpoint.outstanding -= 1
        retry = await self.pick()
        retry.outstanding += 1
        log.warning("request retried on another server", prompt_id=request.prompt_id, index=request.index, server=retry.url)
        try:
            return await self._run(request, retry)
        except ServerGoneError as exc:
            self._take_out(retry, str(exc))
            raise
        finally:
            retry.outstanding -= 1

    async def _run(self, request: GenerationRequest, endpoint: Endpoint) -> Trajectory:
        """Segments of one request until it finishes; aborted segments (ours, for a weight
        update) are resumed from where they stopped."""
        p = request.params
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        resumed: ResumePolicy | None = None
        while True:
            await self._unpaused.wait()
            pauses, version = self._pauses, self._version
            body = {
                "rid": f"{request.prompt_id}-{request.index}-{uuid.uuid4().hex[:8]}",
                "input_ids": list(request.prompt_ids) + ids,
                "sampling_params": {
                    "max_new_tokens": p.max_new_tokens - len(ids), "temperature": p.temperature, "top_p": p.top_p,
                    "top_k": p.top_k or -1, "stop": list(p.stop) or None, "no_stop_trim": True,
                    "sampling_seed": segment_seed(request, len(ids)),
                },
                "return_logprob": True,
            }
            try:
                answer = await endpoint.client.generate(body)
            except ServerBusyError as exc:
                log.info("rollout server busy; retrying after its Retry-After", server=endpoint.url, after_s=exc.retry_after_s)
                await asyncio.sleep(exc.retry_after_s)  # the server names when it has room: no event to wait on
                continue
            meta = answer.meta_info
            if served_version(meta.weight_version) < version:
                # Older weights than every server was given: it restarted since. Its tokens are
                # not the policy's; the request goes elsewhere (or here again, once resynced).
                raise ServerGoneError(f"{endpoint.url} serves version {meta.weight_version}, older than {version}: restarted")
            tokens = meta.output_token_logprobs or []
            if len(tokens) != meta.completion_tokens:
                raise ServerError(endpoint.url, 200, f"{meta.completion_tokens} tokens but {len(tokens)} log-probs")
            ids += [token for _, token, _ in tokens]
            logprobs += [lp for lp, _, _ in tokens]
            # tandem's servers stamp each token; for others every token of a segment was made by
            # the weights served when it began (updates happen only while paused).
            versions += meta.output_token_versions if meta.output_token_versions is not None else [version] * len(tokens)
            if meta.resumed is not None:
                resumed = ResumePolicy(meta.resumed)
            kind = meta.finish_reason.type if meta.finish_reason is not None else "abort"
            if kind == "abort":
                if self._pauses == pauses:
                    raise ServerError(endpoint.url, 200, f"request {body['rid']} aborted by the server: {meta.finish_reason}")
                if ids:
                    resumed = ResumePolicy.RECOMPUTE  # the prefix is re-encoded under the new weights
                if len(ids) < p.max_new_tokens:
                    continue
                kind = "length"
            endpoint.served += 1
            return token_trajectory(
                request.prompt_id, request.index, list(request.prompt_ids), ids, logprobs, versions,
                FinishReason.STOP if kind == "stop" else FinishReason.LENGTH, text=self._decode(ids), resumed=resumed,
            )

    # ------------------------------------------------------------------------- health

    def restarted(self, url: str) -> None:
        """The launcher restarted the server at ``url``: out of service until it is back and resynced."""
        for endpoint in self.endpoints:
            if endpoint.url == url:
                self._take_out(endpoint, "restarted")

    def _take_out(self, endpoint: Endpoint, reason: str) -> None:
        if endpoint.in_service:
            endpoint.in_service = False
            log.warning("rollout server taken out of service", server=endpoint.url, reason=reason)

    async def _watch(self) -> None:
        """Probe every server each ``health_interval_s``: take out the ones that fail, bring
        back (with the current weights) the ones that answer again."""
        while True:
            await asyncio.sleep(self._health_interval_s)  # periodic by nature: no event says a server died
            await self.check()

    async def check(self) -> None:
        """One round of health checks now."""
        states = await asyncio.gather(*(self._probe(ep) for ep in self.endpoints))
        for endpoint, (alive, served) in zip(self.endpoints, states, strict=True):
            if endpoint.in_service and (not alive or served < self._version):
                self._take_out(endpoint, "health check failed" if not alive else f"serves version {served}")
            if not endpoint.in_service and not endpoint.resyncing and alive:
                task = asyncio.ensure_future(self._bring_back(endpoint, served))
                self._returning.add(task)
                task.add_done_callback(self._returning.discard)

    async def _probe(self, endpoint: Endpoint) -> tuple[bool, int]:
        timeout = max(1.0, self._health_interval_s)
        if not await endpoint.client.health(timeout):
            return False, -1
        try:
            info = await endpoint.client.model_info()
        except (ServerGoneError, ServerError):
            return False, -1
        return True, served_version(info.weight_version)

    async def _bring_back(self, endpoint: Endpoint, served: int) -> None:
        endpoint.resyncing = True
        try:
            if served < self._version:
                log.warning("rollout server back; loading the current weights", server=endpoint.url, serving=served,
                            current=self._version)
                assert self.resync is not None, "the builder sets resync"
                await self.resync()
        except Exception as exc:  # it stays out; the next probe tries again
            log.warning("could not bring a rollout server back", server=endpoint.url, error=str(exc))
            return
        finally:
            endpoint.resyncing = False
        endpoint.in_service = True
        self._in_service.set()
        log.info("rollout server back in service", server=endpoint.url, version=self._version)


@contextlib.asynccontextmanager
async def running(engine: ServerRolloutEngine) -> AsyncIterator[ServerRolloutEngine]:
    """``async with running(engine)``: started, and closed on the way out (tests, scripts)."""
    await engine.start()
    try:
        yield engine
    finally:
        engine.close()
