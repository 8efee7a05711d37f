"""vLLM's own OpenAI-compatible server as a rollout server behind tandem's router
(``engines.rollout: vllm_server``).

What it owns: the command that starts one (``python -m vllm.entrypoints.openai.api_server``:
the ``vllm`` console script of the CPU build is broken), its environment, and two ways to
talk to it:

- :class:`VllmServerClient`, the router's client: token in, token out through vLLM's
  ``POST /inference/v1/generate`` (``--enable-scale-out``), answered in the router's (sglang's)
  schema, each token with its log-prob and the weight version that produced it (vLLM's
  ``weight_versions`` spans), so the router treats it as a server that updates weights under
  running requests; ``/health``; the served version from ``GET /weight_info``;
- :class:`VllmHttpEndpoint`, the weight sync's (blocking, on the sync's send thread): pause
  with ``mode=keep`` and the caches cleared, ``POST /collective_rpc`` into the worker extension
  (``engines.vllm.worker``) that maps the trainer's shared-memory half, the version, resume;
  and the probe's score (prompt log-probs). These routes need ``VLLM_SERVER_DEV_MODE=1``.

An OpenAI-client agent (``engines.servers.agent``) does not call vLLM's own ``/v1``: its answers
carry token ids and log-probs but no weight versions, and it keeps no per-conversation record.
The run serves its agents tandem's OpenAI endpoint instead (``engines.server.agent_proxy``),
which generates each call through :class:`VllmServerClient` and records it as ``tandem serve``
does.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from tandem.engines.server.auth import ApiKeys
from tandem.engines.server.client import ServerClient, ServerError
from tandem.engines.server.schemas import GenerateResponse, ModelInfo, header_to_json, manifest_to_json
from tandem.engines.server.weights import post_json
from tandem.engines.vllm.engine import WORKER_EXTENSION, InFlight, VllmSettings, token_versions
from tandem.param_sync import BucketHeader, LoadReport, Manifest

__all__ = ["VllmHttpEndpoint", "VllmServerClient", "vllm_command", "vllm_key_env", "vllm_server_env"]


def vllm_command(model_path: str, host: str, port: int, *, dtype: str, max_batch_size: int, max_model_len: int,
                 enforce_eager: bool, device: str) -> list[str]:
    """vLLM's server for RL: processed log-probs, tandem's worker extension, token in/out."""
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path, "--host", host,
        "--port", str(port), "--dtype", dtype, "--max-num-seqs", str(max_batch_size), "--max-model-len", str(max_model_len),
        "--logprobs-mode", "processed_logprobs", "--worker-extension-cls", WORKER_EXTENSION, "--enable-scale-out",
        "--generation-config", "auto",
    ]  # fmt: skip
    if device == "cpu":  # a whole prefill per step: see VllmRolloutEngine (seeded requests crash otherwise)
        command += ["--max-num-batched-tokens", str(max_model_len * max_batch_size)]
    if enforce_eager:
        command.append("--enforce-eager")
    return command


def vllm_server_env(settings: VllmSettings, *, enforce_eager: bool) -> dict[str, str]:
    """The server's environment: the engine's (KV cache, cores, compilation) and the RL routes."""
    return {**settings.environment(enforce_eager=enforce_eager), "VLLM_SERVER_DEV_MODE": "1"}


def vllm_key_env(keys: ApiKeys) -> dict[str, str]:
    """vLLM's ``--api-key``, given as the variable that option reads (``VLLM_API_KEY``): on the
    command line the key would show in the process list and the launch log. vLLM checks it on
    its ``/v1`` routes; the client sends it on every call."""
    return {} if keys.api_key is None else {"VLLM_API_KEY": keys.api_key.get_secret_value()}


class VllmServerClient(ServerClient):
    """The router's client for a vLLM server: sglang-shaped answers from vLLM's routes."""

    def __init__(self, url: str, session: aiohttp.ClientSession, *, request_timeout_s: float,
                 stop_token_ids: Sequence[int] = (), keys: ApiKeys | None = None) -> None:
        super().__init__(url, session, request_timeout_s=request_timeout_s, keys=keys)
        self._stop_token_ids = list(stop_token_ids)

    async def generate(self, body: dict[str, Any]) -> GenerateResponse:
        sp = body["sampling_params"]
        request = {
            "request_id": body["rid"],
            "token_ids": body["input_ids"],
            "sampling_params": {
                "max_tokens": sp["max_new_tokens"], "temperature": sp["temperature"], "top_p": sp["top_p"],
                "top_k": max(0, sp["top_k"]), "seed": sp["sampling_seed"], "stop": sp.get("stop") or [],
                "include_stop_str_in_output": True, "ignore_eos": True, "stop_token_ids": self._stop_token_ids,
                "logprobs": 0,
            },
        }  # fmt: skip
        _, text = await self._call("POST", "/inference/v1/generate", request)
        answer = _parsed(text)
        choice = answer["choices"][0]
        ids = list(choice.get("token_ids") or [])
        content = (choice.get("logprobs") or {}).get("content") or []
        if len(content) != len(ids):
            raise ServerError(self.url, 200, f"{len(ids)} tokens but {len(content)} log-probs")
        spans = choice.get("weight_versions")
        versions = token_versions([(sp["version"], int(sp["start"]), int(sp["end"])) for sp in spans or []], len(ids), 0)
        reason = choice.get("finish_reason") or "abort"
        return GenerateResponse.model_validate({
            "text": "", "output_ids": ids,
            "meta_info": {
                "id": body["rid"], "finish_reason": {"type": reason}, "prompt_tokens": len(body["input_ids"]),
                "completion_tokens": len(ids), "weight_version": str(versions[-1]) if versions else None,
                "output_token_logprobs": [(c["logprob"], c["token_id"], None) for c in content],
                "output_token_versions": versions,
                "resumed": "recompute" if versions and versions[0] != versions[-1] else None,
            },
        })  # fmt: skip

    async def model_info(self) -> ModelInfo:
        _, text = await self._call("GET", "/weight_info")
        return ModelInfo(model_path=self.url, weight_version=_parsed(text).get("weight_version"))

    async def pause_generation(self, mode: str = "keep") -> None:
        await self._call("POST", f"/pause?mode={mode}&clear_cache=true")

    async def continue_generation(self) -> None:
        await self._call("POST", "/resume")


def _parsed(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text[:200]!r}")
    return value


class VllmHttpEndpoint:
    """One vLLM server as the weight sync sees it (blocking calls, from the sync's send thread)."""

    def __init__(self, url: str, *, timeout_s: float, keys: ApiKeys | None = None, in_flight: InFlight = "keep") -> None:
        self.url = url
        self._timeout_s = timeout_s
        self._keys = keys
        self._in_flight = in_flight

    def _post(self, path: str, body: Any) -> Any:
        status, answer = post_json(self.url, path, body, self._timeout_s, self._keys)
        if status != 200:
            raise ServerError(self.url, status, str(answer))
        return answer

    def load_from_shm(self, segment: str, manifest: Manifest, headers: Sequence[BucketHeader]) -> LoadReport:
        t0 = time.perf_counter()
        try:
            self._post(f"/pause?mode={self._in_flight}&clear_cache=true", {})
        except (OSError, ServerError) as exc:
            return LoadReport(self.url, -1, False, f"server gone: {exc}")
        resume = True
        try:
            kwargs = {"segment": segment, "manifest": manifest_to_json(manifest), "headers": [header_to_json(h) for h in headers]}
            # No timeout inside vLLM (a late answer kills its engine core): the HTTP call is bounded.
            answer = self._post("/collective_rpc", {"method": "tandem_load_shm", "kwargs": kwargs})
            reports = [LoadReport(**r) for r in answer["results"]]
            failed = [r for r in reports if not r.ok]
            if not failed:
                self._post("/update_weight_version", {"new_version": str(manifest.version)})
        except TimeoutError:
            # The load may still land, under the old version's label: the server stays paused (it
            # samples nothing) until a later sync loads, labels and resumes it.
            resume = False
            return LoadReport(self.url, -1, False, f"no answer within {self._timeout_s:g} s; left paused")
        except (OSError, ServerError, KeyError, TypeError) as exc:
            return LoadReport(self.url, -1, False, f"{type(exc).__name__}: {exc}")
        finally:
            if resume:
                try:
                    self._post("/resume", {})
                except (OSError, ServerError):
                    pass  # gone: its report says so, and the router takes it out of service
        stall_s = time.perf_counter() - t0
        if failed:
            return LoadReport(self.url, -1, False, "; ".join(r.error for r in failed), stall_s=stall_s)
        return LoadReport(self.url, manifest.version, True, load_s=max(r.load_s for r in reports), stall_s=stall_s)

    def score(self, token_ids: Sequence[int]) -> list[float]:
        answer = self._post("/inference/v1/generate", {
            "token_ids": list(token_ids), "sampling_params": {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0},
        })  # fmt: skip
        scored = answer["prompt_logprobs"]
        return [float(entry[str(token)]["logprob"]) for token, entry in zip(token_ids[1:], scored[1:], strict=True)]
