"""``tandem serve``: the embedded rollout engine in a process of its own, behind sglang's HTTP API.

What it owns: the aiohttp application around one :class:`~engines.server.engine.ServedEngine`,
with the endpoints of sglang's native API an RL trainer calls (``/generate`` with
``input_ids``, ``sampling_params``, ``return_logprob`` and streaming; ``/abort_request``;
``/pause_generation`` and ``/continue_generation``; ``/update_weights_from_disk``,
``/update_weights_from_tensor``, ``/init_weights_update_group`` and
``/update_weights_from_distributed``; ``/flush_cache``; ``/health`` and ``/health_generate``;
``/get_model_info``; ``/load_lora_adapter`` and ``/unload_lora_adapter`` when started with an
adapter, ``engines.server.lora``), with sglang's field names and semantics (``engines.server.schemas``),
plus the shared-memory weight update, the weight probe's scoring and the OpenAI-compatible
endpoints (``engines.server.openai_api``).

How it differs from sglang, on purpose: weights change between two decode steps while requests
keep running (the engine's ``swap`` load), so a weight update needs no pause and returns at
once when loaded; every answer says which policy version produced each output token
(``meta_info.output_token_versions``); there is no cross-request prefix cache, so
``/flush_cache`` has nothing to drop and ``cached_tokens`` is 0.

Invariants:
- every request gets exactly one answer: finished, aborted (with its partial output and finish
  reason ``abort``), or an error; a client that disconnects has its requests dropped;
- weight updates run one at a time, on a worker thread (the loop keeps serving); a failed one
  leaves the old weights serving and answers ``success: false`` with the reason;
- while paused (``/pause_generation``) new requests wait; ``/continue_generation`` releases them;
- exposed safely (``engines.server.auth``, ``engines.server.limits``): with a key configured every
  route but ``/health`` needs it; bodies, numbers, token ids, weight folders and group addresses
  are checked before use and a bad one is a 4xx naming it; admitted work stays under the caps
  (429 with ``Retry-After`` beyond them).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web
from pydantic import SecretStr

from tandem.core.protocols import GenerationRequest
from tandem.core.records import FinishReason, Trajectory
from tandem.engines.server.auth import ApiKeys, auth_middleware, check_bind
from tandem.engines.server.engine import Partial, Running, ServedEngine
from tandem.engines.server.http import error_body, error_response, parse
from tandem.engines.server.limits import Admission, BusyError, ServerLimits, busy_response
from tandem.engines.server.lora import AdapterRequestError, AdapterSlot
from tandem.engines.server.options import ADMIN_KEY_ENV, API_KEY_ENV
from tandem.engines.server.receive import WeightUpdates
from tandem.engines.server.sampling import engine_request
from tandem.engines.server.schemas import (
    AbortReq,
    GenerateReqInput,
    GenerateResponse,
    InitWeightsUpdateGroupReqInput,
    LoadLoRAAdapterReqInput,
    LoadReportBody,
    MetaInfo,
    ModelInfo,
    PauseGenerationReqInput,
    ProbeReqInput,
    ProbeResponse,
    SamplingParams,
    ShmMessage,
    SuccessResponse,
    UnloadLoRAAdapterReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
    header_from_json,
    manifest_from_json,
    request_context,
)
from tandem.engines.shared.lora import adapter_tensors
from tandem.param_sync import LoadReport, Receiver

if TYPE_CHECKING:
    import peft

__all__ = ["RolloutServer", "keys_from", "limits_from", "report_body", "run", "serve", "shm_transfer"]

log = structlog.get_logger("tandem.serve")
_HEALTH_TIMEOUT_S = 20.0  # sglang's SGLANG_HEALTH_CHECK_TIMEOUT default


class RolloutServer:
    """The HTTP front of one engine. Build with :meth:`create` (loads the model), serve with
    :meth:`application`, stop with :meth:`close`."""

    def __init__(self, engine: ServedEngine, *, model_path: str, name: str, consume_bucket_mb: float, dist_timeout_s: float,
                 keys: ApiKeys | None = None, limits: ServerLimits | None = None, lora: peft.LoraConfig | None = None):
        """``lora``: the settings of the adapter ``engine`` was built with (None: no adapter)."""
        self.engine = engine
        self.tokenizer = engine._tokenizer
        self.model_path = model_path
        self.name = name
        self.keys = keys or ApiKeys()
        self.limits = limits or ServerLimits()
        self.context = int(engine.model.config.max_position_embeddings)
        self.request_context = request_context(int(engine.model.config.vocab_size), self.limits.max_top_logprobs)
        self.admission = Admission(self.limits.max_running_requests, self.limits.max_queued_tokens)
        self.updates = WeightUpdates(
            Receiver(engine.target, consume_bucket_mb=consume_bucket_mb, engine=name), engine.model, timeout_s=dist_timeout_s,
            weight_dirs=self.limits.weight_dirs or (Path(model_path),), group_addresses=self.limits.group_addresses,
            connect_timeout_s=self.limits.connect_timeout_s,
        )
        self.adapter = AdapterSlot(lora, adapter_tensors(engine.model), self.updates) if lora is not None else None
        self.running: dict[str, Running] = {}
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._weights = asyncio.Lock()  # one weight update at a time
        self.on_generated: list[Callable[[str | None, str, GenerationRequest, Trajectory | Partial], None]] = []

    @classmethod
    def create(cls, model_path: str, *, name: str = "tandem", device: str = "cpu", dtype: Any = None,
               max_batch_size: int = 64, num_threads: int = 1, resume_policy: str = "recompute",
               consume_bucket_mb: float = 64.0, dist_timeout_s: float = 600.0, keys: ApiKeys | None = None,
               limits: ServerLimits | None = None, lora: peft.LoraConfig | None = None) -> RolloutServer:
        import torch

        engine = ServedEngine(model_path, device=device, dtype=dtype or torch.float32, max_batch_size=max_batch_size,
                              num_threads=num_threads, resume_policy=resume_policy, load_mode="swap", lora=lora)
        return cls(engine, model_path=model_path, name=name, consume_bucket_mb=consume_bucket_mb,
                   dist_timeout_s=dist_timeout_s, keys=keys, limits=limits, lora=lora)

    def application(self) -> web.Application:
        from tandem.engines.server.openai_api import add_openai_routes

        app = web.Application(client_max_size=self.limits.max_body_bytes, middlewares=[auth_middleware(self.keys)])
        r = app.router
        for method in ("POST", "PUT"):
            r.add_route(method, "/generate", self.generate)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/update_weights_from_tensor", self.update_weights_from_tensor)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/tandem/update_weights_from_shm", self.update_weights_from_shm)
        r.add_post("/load_lora_adapter", self.load_lora_adapter)
        r.add_post("/unload_lora_adapter", self.unload_lora_adapter)
        r.add_post("/tandem/probe_logprobs", self.probe_logprobs)
        for method in ("GET", "POST"):
            r.add_route(method, "/flush_cache", self.flush_cache)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        r.add_get("/get_model_info", self.get_model_info)
        r.add_get("/get_weight_version", self.get_weight_version)
        self.conversations = add_openai_routes(app, self)
        self.on_generated.append(self.conversations.record)  # a /generate call naming a conversation is filed too
        return app

    def close(self) -> None:
        for running in list(self.running.values()):
            self.engine.cancel(running)
        self.updates.close()  # first: weights served from a segment are copied out while the gate still opens
        self.engine.close()

    # -------------------------------------------------------------------- generation core

    def admitted(self, requests: list[GenerationRequest]) -> contextlib.AbstractContextManager[None]:
        """Hold ``requests`` against the server's caps while the caller serves them: ValueError
        (a 400) when they could never fit, :class:`BusyError` (a 429) when they do not fit now."""
        tokens = sum(len(r.prompt_ids) + r.params.max_new_tokens for r in requests)
        self.admission.check_fits(len(requests), tokens)
        return self.admission.admitted(len(requests), tokens)

    async def start(self, rid: str, request: GenerationRequest, listener: Callable[[], None] | None = None) -> Running:
        await self._unpaused.wait()
        running = self.engine.submit(request, listener=listener)
        self.running[rid] = running
        running.outcome.add_done_callback(lambda _: self.running.pop(rid, None))
        return running

    async def complete(self, rid: str, request: GenerationRequest) -> Trajectory | Partial:
        """One request, already :meth:`admitted`, to its end (the OpenAI endpoints' backend call)."""
        running = await self.start(rid, request)
        return await self.outcome(rid, running)

    async def outcome(self, rid: str, running: Running, conversation_id: str | None = None) -> Trajectory | Partial:
        """Await one request; a cancelled caller (disconnected client) drops it from the engine."""
        try:
            result = await asyncio.shield(running.outcome)
        except asyncio.CancelledError:
            self.engine.cancel(running)
            raise
        for hook in self.on_generated:
            hook(conversation_id, rid, running.request, result)
        return result

    def answer(self, rid: str, request: GenerationRequest, result: Trajectory | Partial, params: SamplingParams,
               *, return_logprob: bool, text_in_logprobs: bool, started: float) -> GenerateResponse:
        """A finished or aborted request as sglang's /generate answer."""
        if isinstance(result, Trajectory):
            ids, lps, versions, resumed = result.payload.response_ids, result.behaviour_logprobs, result.versions, result.resumed
        else:
            ids, lps, versions, resumed = result.response_ids, result.logprobs, result.versions, result.resumed
        text = self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
        finish = self._finish_reason(result, ids, request, text, params)
        if finish is not None and finish["type"] == "stop" and isinstance(finish.get("matched"), str) and not params.no_stop_trim:
            text = text[: text.find(finish["matched"])]
        meta = MetaInfo(
            id=rid, finish_reason=finish, prompt_tokens=len(request.prompt_ids), completion_tokens=len(ids),
            cached_tokens=0, weight_version=str(self.engine.version), e2e_latency=time.perf_counter() - started,
            output_token_logprobs=[
                (lp, tok, self.tokenizer.decode([tok]) if text_in_logprobs else None) for lp, tok in zip(lps, ids, strict=True)
            ] if return_logprob else None,
            output_token_versions=list(versions), resumed=None if resumed is None else resumed.value,
        )
        return GenerateResponse(text=text, output_ids=list(ids), meta_info=meta)

    def _finish_reason(self, result: Trajectory | Partial, ids: list[int], request: GenerationRequest, text: str,
                       params: SamplingParams) -> dict[str, Any] | None:
        if isinstance(result, Partial):
            return {"type": "abort", "message": "Abort before the request finished"}
        if result.finish_reason is FinishReason.LENGTH:
            return {"type": "length", "length": len(ids)}
        if ids and ids[-1] in self.engine._eos_ids:
            return {"type": "stop", "matched": ids[-1]}
        matched = next((s for s in request.params.stop if s in text), None)
        return {"type": "stop", "matched": matched}

    # ---------------------------------------------------------------------- /generate

    async def generate(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        req: GenerateReqInput = await parse(request, GenerateReqInput, context=self.request_context)
        if (unknown := self._unknown_adapter(req.lora_path)) is not None:
            return error_response(400, unknown)
        single = (req.input_ids is not None and isinstance(req.input_ids[0], int)) or isinstance(req.text, str)
        prompts: list[list[int]]
        if req.input_ids is not None:
            prompts = [req.input_ids] if single else list(req.input_ids)  # type: ignore[list-item]
        else:
            texts = [req.text] if single else list(req.text or [])
            prompts = [list(self.tokenizer(t)["input_ids"]) for t in texts]  # type: ignore[arg-type]
        params_list = self._per_prompt(req.sampling_params or SamplingParams(), len(prompts), "sampling_params")
        logprob_list = self._per_prompt(req.return_logprob or False, len(prompts), "return_logprob")
        n = params_list[0].n
        if any(p.n != n for p in params_list):
            raise web.HTTPBadRequest(text=json.dumps(error_body("sampling_params.n must be the same for every prompt")),
                                     content_type="application/json")
        try:
            # before any per-request object exists: a huge n is refused, not allocated
            self.admission.check_fits(len(prompts) * n, 0)
            rids = self._rids(req.rid, len(prompts) * n, single and n == 1)
            jobs = [
                (rids[j * len(prompts) + i],
                 engine_request(prompts[i], params_list[i], self._seed(params_list[i], j), context=self.context, index=j),
                 params_list[i], logprob_list[i])
                for j in range(n) for i in range(len(prompts))
            ]
            admitted = self.admitted([gen for _, gen, _, _ in jobs])
        except ValueError as exc:
            return error_response(400, str(exc))
        if req.stream and len(jobs) != 1:
            return error_response(400, "stream: only a single prompt with n = 1 can be streamed by this server")
        try:
            with admitted:
                if req.stream:
                    return await self._stream(request, req, *jobs[0], started)
                return await self._generate_all(req, jobs, single and n == 1, started)
        except BusyError as exc:
            return busy_response(exc)

    def _unknown_adapter(self, lora_path: str | list[str | None] | None) -> str | None:
        """The error for a ``lora_path`` naming no loaded adapter (None: every name is loaded)."""
        loaded = self.adapter.loaded if self.adapter is not None else {}
        names = lora_path if isinstance(lora_path, list) else [lora_path]
        unknown = next((name for name in names if name is not None and name not in loaded), None)
        return None if unknown is None else f"lora_path: no adapter named {unknown!r} is loaded (loaded: {sorted(loaded)})"

    async def _generate_all(self, req: GenerateReqInput, jobs: list[tuple[str, GenerationRequest, SamplingParams, bool]],
                            single: bool, started: float) -> web.Response:
        runnings = [await self.start(rid, gen) for rid, gen, _, _ in jobs]
        try:
            results = await asyncio.gather(*(self.outcome(rid, run, req.conversation_id)
                                             for (rid, _, _, _), run in zip(jobs, runnings, strict=True)))
        except asyncio.CancelledError:
            for running in runnings:
                self.engine.cancel(running)
            raise
        except Exception as exc:  # the engine failed the work: sglang answers 400 with the message
            return error_response(400, f"{type(exc).__name__}: {exc}")
        answers = [
            _body(self.answer(rid, gen, result, params, return_logprob=lp, text_in_logprobs=req.return_text_in_logprobs,
                              started=started))
            for (rid, gen, params, lp), result in zip(jobs, results, strict=True)
        ]
        return web.json_response(answers[0] if single else answers)

    async def _stream(self, request: web.Request, req: GenerateReqInput, rid: str, gen: GenerationRequest,
                      params: SamplingParams, return_logprob: bool, started: float) -> web.StreamResponse:
        """Server-sent events as sglang sends them: each ``data:`` the whole output so far, the
        last one with its finish reason, then ``data: [DONE]``."""
        more = asyncio.Event()
        running = await self.start(rid, gen, listener=more.set)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        finished = asyncio.ensure_future(self.outcome(rid, running, req.conversation_id))
        try:
            while not finished.done():
                waiter = asyncio.ensure_future(more.wait())
                await asyncio.wait([finished, waiter], return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                if finished.done():
                    break
                more.clear()
                chunk = self.answer(rid, gen, self.engine.snapshot(running), params, return_logprob=return_logprob,
                                    text_in_logprobs=req.return_text_in_logprobs, started=started)
                await response.write(_sse(_body(chunk, finished=False)))
            try:
                result = finished.result()
                body = _body(self.answer(rid, gen, result, params, return_logprob=return_logprob,
                                         text_in_logprobs=req.return_text_in_logprobs, started=started))
            except Exception as exc:
                body = {"error": {"message": f"{type(exc).__name__}: {exc}"}}
            await response.write(_sse(body))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        finally:
            if not finished.done():
                finished.cancel()
                self.engine.cancel(running)
        return response

    @staticmethod
    def _per_prompt(value: Any, count: int, name: str) -> list[Any]:
        if isinstance(value, list):
            if len(value) != count:
                raise web.HTTPBadRequest(text=json.dumps(error_body(f"{name}: {len(value)} values for {count} prompts")),
                                         content_type="application/json")
            return value
        return [value] * count

    @staticmethod
    def _rids(rid: str | list[str] | None, count: int, single: bool) -> list[str]:
        """sglang's normalisation: a string is the id of a single request, the prefix of a batch's."""
        if isinstance(rid, list):
            if len(rid) != count:
                raise web.HTTPBadRequest(text=json.dumps(error_body(f"rid: {len(rid)} ids for {count} requests")),
                                         content_type="application/json")
            return rid
        if rid is None:
            return [uuid.uuid4().hex for _ in range(count)]
        return [rid] if single else [f"{rid}_{i}" for i in range(count)]

    @staticmethod
    def _seed(params: SamplingParams, sample: int) -> int | None:
        return None if params.sampling_seed is None else params.sampling_seed + sample

    # --------------------------------------------------------------- control endpoints

    async def abort_request(self, request: web.Request) -> web.Response:
        req: AbortReq = await parse(request, AbortReq)
        await self._abort([r for rid, r in self.running.items() if req.abort_all or rid.startswith(req.rid)])
        return web.Response(status=200)

    async def _abort(self, runnings: list[Running]) -> int:
        if not runnings:
            return 0
        partials = await asyncio.to_thread(self.engine.abort, runnings)
        return sum(p is not None for p in partials)

    async def pause_generation(self, request: web.Request) -> web.Response:
        req: PauseGenerationReqInput = await parse(request, PauseGenerationReqInput, empty_ok=True)
        if req.mode == "retract":
            return error_response(400, "pause_generation mode 'retract' is not supported by this server (use abort or in_place)")
        self._unpaused.clear()
        if req.mode == "abort":
            await self._abort(list(self.running.values()))
        else:
            await asyncio.to_thread(self.engine.freeze)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await asyncio.to_thread(self.engine.thaw)
        self._unpaused.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        # Nothing to flush: a request's KV cache lives only while it runs (no radix cache).
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. "
                            "(When there are running or waiting requests, the operation will not be performed.)\n")

    async def health(self, request: web.Request) -> web.Response:
        alive = self.engine._thread.is_alive() and not self.engine._closing
        return web.Response(status=200 if alive else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        """Generate one token (a paused server answers from its liveness alone, as the request
        would wait for ``/continue_generation``)."""
        if not self._unpaused.is_set():
            return await self.health(request)
        gen = engine_request([0], SamplingParams(max_new_tokens=1, temperature=0.0), 0, context=self.context)
        rid = f"HEALTH_CHECK_{time.time()}"
        try:
            running = await self.start(rid, gen)
            await asyncio.wait_for(self.outcome(rid, running), _HEALTH_TIMEOUT_S)
        except Exception:
            return web.Response(status=503)
        return web.Response(status=200)

    async def get_model_info(self, request: web.Request) -> web.Response:
        info = ModelInfo(model_path=self.model_path, tokenizer_path=self.model_path, is_generation=True,
                         weight_version=str(self.engine.version),
                         tandem={"live_weight_updates": True, "version": self.engine.version, "name": self.name,
                                 "pid": os.getpid()})
        return web.json_response(info.model_dump(mode="json"))

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": str(self.engine.version)})

    # ---------------------------------------------------------------- weight updates

    async def _update(self, abort_all: bool, work: Callable[[], LoadReport]) -> web.Response:
        """Run one weight update on a worker thread; sglang's ``{success, message}`` answer."""
        if abort_all:
            await self._abort(list(self.running.values()))
        async with self._weights:
            try:
                report = await asyncio.to_thread(work)
            except Exception as exc:
                return web.json_response(SuccessResponse(success=False, message=f"{type(exc).__name__}: {exc}").model_dump(),
                                         status=400)
        body = SuccessResponse(success=report.ok, num_paused_requests=0,
                               message=f"Loaded weight version {report.version}." if report.ok else report.error)
        return web.json_response(body.model_dump(exclude_none=True), status=200 if report.ok else 400)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        req: UpdateWeightFromDiskReqInput = await parse(request, UpdateWeightFromDiskReqInput)
        try:
            self.updates.check_folder(req.model_path)
        except PermissionError as exc:
            return web.json_response(SuccessResponse(success=False, message=str(exc)).model_dump(exclude_none=True), status=403)
        return await self._update(req.abort_all_requests, lambda: self.updates.from_disk(req.model_path, req.weight_version))

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        await parse(request, UpdateWeightsFromTensorReqInput)
        message = ("update_weights_from_tensor carries CUDA IPC handles of a colocated trainer; this server takes "
                   "same-host weights through /tandem/update_weights_from_shm")
        return web.json_response(SuccessResponse(success=False, message=message).model_dump(exclude_none=True), status=400)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        req: InitWeightsUpdateGroupReqInput = await parse(request, InitWeightsUpdateGroupReqInput)
        try:
            self.updates.check_address(req.master_address)
        except PermissionError as exc:
            return web.json_response({"success": False, "message": str(exc)}, status=403)
        async with self._weights:
            try:
                await asyncio.to_thread(self.updates.init_group, req)
            except Exception as exc:
                return web.json_response({"success": False, "message": f"{type(exc).__name__}: {exc}"}, status=400)
        return web.json_response({"success": True, "message": f"Joined {req.group_name} as rank {req.rank_offset}."})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        req: UpdateWeightsFromDistributedReqInput = await parse(request, UpdateWeightsFromDistributedReqInput)
        return await self._update(req.abort_all_requests, lambda: self.updates.from_distributed(req))

    async def update_weights_from_shm(self, request: web.Request) -> web.Response:
        """The body is NDJSON: ``begin``, ``bucket``\\*, ``end`` | ``abort``, each line handled as
        it arrives (the trainer is still gathering later buckets). Answers the load report."""
        async with self._weights:
            report = await shm_transfer(request.content, self.updates, self.name)
        # a failed transfer (a malformed or cut-short message, bytes that fail their checksum) is the request's fault
        return web.json_response(LoadReportBody(**report_body(report)).model_dump(), status=200 if report.ok else 400)

    # ------------------------------------------------------------------ LoRA adapters

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        req: LoadLoRAAdapterReqInput = await parse(request, LoadLoRAAdapterReqInput)
        return await self._adapter_update(lambda slot: slot.load(req))

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        req: UnloadLoRAAdapterReqInput = await parse(request, UnloadLoRAAdapterReqInput)
        return await self._adapter_update(lambda slot: slot.unload(req))

    async def _adapter_update(self, work: Callable[[AdapterSlot], LoadReport]) -> web.Response:
        """Run one adapter load or unload as a weight update; sglang's ``LoRAUpdateResult`` answer
        (400 with ``error_message`` naming the field when refused, 403 for a folder outside ``--weight-dir``)."""
        slot = self.adapter
        if slot is None:
            message = "lora_name: this server was started without an adapter (--lora-rank); it serves its base model only"
            return web.json_response({"success": False, "error_message": message, "loaded_adapters": {}}, status=400)
        async with self._weights:
            try:
                report = await asyncio.to_thread(work, slot)
            except PermissionError as exc:
                return web.json_response(slot.result(ok=False, error=str(exc)).model_dump(), status=403)
            except AdapterRequestError as exc:
                return web.json_response(slot.result(ok=False, error=str(exc)).model_dump(), status=400)
        return web.json_response(slot.result(ok=report.ok, error=report.error or None).model_dump(),
                                 status=200 if report.ok else 400)

    async def probe_logprobs(self, request: web.Request) -> web.Response:
        """tandem's extension: the weight probe scored under the weights serving now (the
        trainer compares it with its own after each sync, ``engines.shared.probe``)."""
        req: ProbeReqInput = await parse(request, ProbeReqInput, context=self.request_context)
        version = self.engine.version
        logprobs = await asyncio.to_thread(self.engine.probe_logprobs, req.input_ids)
        return web.json_response(ProbeResponse(name=self.name, weight_version=version, logprobs=logprobs).model_dump())


async def shm_transfer(lines: Any, updates: WeightUpdates, name: str) -> LoadReport:
    """Apply one shared-memory transfer whose NDJSON messages arrive on ``lines`` (an aiohttp
    stream), each handled on a worker thread as it comes; never raises: a bad or cut-short
    transfer aborts (the old weights keep serving) and the report says why."""
    begun = False
    try:
        while True:
            line = await lines.readline()
            if not line:
                break
            message = ShmMessage.model_validate_json(line)
            if message.type == "begin":
                assert message.segment is not None and message.manifest is not None  # the schema requires them
                await asyncio.to_thread(updates.shm_begin, message.segment, manifest_from_json(message.manifest))
                begun = True
            elif message.type == "bucket":
                assert message.header is not None  # the schema requires it
                await asyncio.to_thread(updates.shm_bucket, header_from_json(message.header))
            else:
                return await asyncio.to_thread(updates.shm_finish, ok=message.type == "end", reason=message.reason)
        reason = "the trainer's request ended before the transfer did"
    except Exception as exc:
        reason = f"bad transfer message: {type(exc).__name__}: {exc}"
    if begun:
        return await asyncio.to_thread(updates.shm_finish, ok=False, reason=reason)
    return LoadReport(name, updates.version, False, reason)


def report_body(report: LoadReport) -> dict[str, Any]:
    return {"engine": report.engine, "version": report.version, "ok": report.ok, "error": report.error,
            "verify_s": report.verify_s, "load_s": report.load_s, "stall_s": report.stall_s}


def _body(answer: GenerateResponse, *, finished: bool = True) -> dict[str, Any]:
    """An answer as JSON: optional fields left out as sglang leaves them out, but
    ``finish_reason`` always there (null while a streamed request runs), as clients read it."""
    body = answer.model_dump(mode="json", exclude_none=True)
    if not finished:
        body["meta_info"]["finish_reason"] = None
    body["meta_info"].setdefault("finish_reason", None)
    return body


def _sse(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


# ------------------------------------------------------------------------------ process


async def serve(server: RolloutServer, host: str, port: int, *, ready: Callable[[int], Awaitable[None] | None] | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` is set (or SIGTERM/SIGINT when ``stop`` is None); closes the server."""
    runner = web.AppRunner(server.application(), handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        log.info("serving", name=server.name, host=host, port=bound, model=server.model_path, pid=os.getpid())
        if ready is not None:
            maybe = ready(bound)
            if maybe is not None:
                await maybe
        if stop is None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()
        await asyncio.to_thread(server.close)


def run(args: argparse.Namespace) -> int:
    """Run ``tandem serve`` with parsed ``args`` (``engines.server.options``) until SIGTERM or SIGINT."""
    import torch

    try:  # before the model loads
        keys = keys_from(args)
        check_bind(args.host, keys, allow_unauthenticated=args.allow_unauthenticated)
    except ValueError as err:
        print(f"tandem serve: {err}", file=sys.stderr)
        return 2
    server = RolloutServer.create(
        str(args.model_path), name=args.name, device=args.device, dtype=getattr(torch, args.dtype),
        max_batch_size=args.max_batch_size, num_threads=args.threads, resume_policy=args.resume_policy,
        consume_bucket_mb=args.consume_bucket_mb, dist_timeout_s=args.weight_timeout_s, keys=keys,
        limits=limits_from(args), lora=lora_from(args),
    )

    def ready(port: int) -> None:
        if args.port_file is not None:
            tmp = args.port_file.with_suffix(".tmp")
            tmp.write_text(str(port))
            tmp.replace(args.port_file)

    asyncio.run(serve(server, args.host, args.port, ready=ready))
    return 0


def keys_from(args: argparse.Namespace) -> ApiKeys:
    """The keys from the options, else from the environment; an empty key is refused (it would
    look like protection and be none)."""
    keys = {}
    for option, env in (("api_key", API_KEY_ENV), ("admin_api_key", ADMIN_KEY_ENV)):
        value = getattr(args, option) if getattr(args, option) is not None else os.environ.get(env)
        if value is not None and not value.strip():
            raise ValueError(f"--{option.replace('_', '-')} (or ${env}) is empty")
        keys[option] = SecretStr(value) if value is not None else None
    return ApiKeys(api_key=keys["api_key"], admin_key=keys["admin_api_key"])


def lora_from(args: argparse.Namespace) -> peft.LoraConfig | None:
    """peft's settings for ``--lora-*`` on the model (None without ``--lora-rank``), checked as the trainer's are."""
    if args.lora_rank is None:
        return None
    from tandem.core.config import LoraConfig
    from tandem.engines.shared.lora import lora_settings

    spec = LoraConfig(rank=args.lora_rank, alpha=args.lora_alpha, target_modules=args.lora_target_modules)
    return lora_settings(spec, args.model_path)


def limits_from(args: argparse.Namespace) -> ServerLimits:
    default = ServerLimits()
    return ServerLimits(
        max_body_bytes=int(args.max_body_mb * (1 << 20)), max_top_logprobs=args.max_top_logprobs,
        max_running_requests=args.max_running_requests, max_queued_tokens=args.max_queued_tokens,
        weight_dirs=tuple(args.weight_dir or ()), group_addresses=tuple(args.weight_group_address or default.group_addresses),
        connect_timeout_s=args.connect_timeout_s,
    )
