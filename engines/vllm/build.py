"""Builds vLLM in process as the rollout engine of a torch bundle (``engines.rollout: vllm``).

What it owns: turning the config into a :class:`~engines.vllm.engine.VllmRolloutEngine` (its KV
cache and the cores its threads bind to) and the weight sync into it: the trainer's gather
into a dual buffer of shared-memory halves (``param_sync``), loaded by vLLM's workers in place,
each sync proven by the probe (``engines.vllm.sync``) and its gap reported as ``logprob_gap``.
With ``engines.lora``, the trainer's adapter alone, added to vLLM as a LoRA adapter, each sync
proven against the trainer's own probe record (``engines.shared.probe``).

Thread budget (2 cores here): vLLM binds one OpenMP thread per core it is given. Generation
gets the last ``generation_threads`` cores of this process's affinity (all of them at k = 0,
when the phases take turns; half when generation overlaps training), the trainer's threads
(``torch.set_num_threads``) run on the rest.
"""

from __future__ import annotations

import os

from tandem.core.components import Components, TaskSetup
from tandem.core.config import TandemConfig, TorchEnginesConfig
from tandem.engines.server.router import ServerRolloutEngine
from tandem.engines.shared.probe import ProbedWeightSync
from tandem.engines.shared.weight_sync import SyncedTrainer, TorchWeightSync
from tandem.engines.text.build import TORCH_DTYPES, lora_of, resolve_model_path
from tandem.engines.vllm.engine import VllmRolloutEngine, VllmSettings, eos_token_ids
from tandem.engines.vllm.server import VllmHttpEndpoint, VllmServerClient, vllm_command, vllm_key_env, vllm_server_env
from tandem.engines.vllm.sync import VllmShmTransport, WeightProbe, adapter_sync

__all__ = ["build_vllm_server_components", "generation_cpus", "vllm_rollout"]


def generation_cpus(threads: int) -> list[int]:
    """The cores vLLM's threads bind to: the last ``threads`` of this process's affinity."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return cores[-threads:]


def vllm_rollout(config: TandemConfig, trainer: SyncedTrainer, threads: int) -> tuple[VllmRolloutEngine, ProbedWeightSync]:
    """vLLM serving ``engines.model_path`` on ``threads`` cores, and the weight sync into it from
    ``trainer`` (a ``text.build.RolloutPlacement``)."""
    spec = config.engines
    assert isinstance(spec, TorchEnginesConfig)
    model_path = resolve_model_path(spec.model_path)
    settings = VllmSettings(kv_cache_gib=spec.vllm.kv_cache_gib, cpus=generation_cpus(threads))
    # With an adapter, requests keep theirs to the end: the k + 1 versions in flight (engines.vllm.engine).
    max_loras = config.staleness.k + 1
    engine = VllmRolloutEngine(
        model_path, device=spec.device, dtype=spec.dtype, max_batch_size=spec.max_batch_size, settings=settings,
        enforce_eager=spec.vllm.enforce_eager, update_timeout_s=spec.vllm.update_timeout_s, in_flight=spec.vllm.in_flight,
        lora=lora_of(config), max_loras=max_loras,
    )  # fmt: skip
    try:
        if spec.lora is not None:
            assert trainer.probe is not None  # a LoRA trainer records the probe, one process's or a group's
            return engine, adapter_sync(trainer, trainer.probe, engine, max_gap=spec.lora.max_gap(spec.dtype),
                                        produce_bucket_mb=config.param_sync.produce_bucket_mb)  # fmt: skip
        probe = WeightProbe(model_path, max_gap=spec.vllm.max_gap(spec.dtype), dtype=TORCH_DTYPES[spec.dtype])
        transport = VllmShmTransport(lambda: [engine], probe)
        sync = TorchWeightSync.through(trainer, transport, produce_bucket_mb=config.param_sync.produce_bucket_mb)
        return engine, ProbedWeightSync(sync, probe)
    except BaseException:
        engine.close()
        raise


def build_vllm_server_components(config: TandemConfig, setup: TaskSetup) -> Components:
    """The text workload with generation in vLLM servers behind the router (``engines.rollout:
    vllm_server``): the server bundle, with vLLM's command, client and shared-memory weight sync."""
    from transformers import AutoConfig

    from tandem.engines.server.build import ServerKind, build_server_components, server_keys

    spec = config.engines
    assert isinstance(spec, TorchEnginesConfig)
    servers, model_path = spec.servers, resolve_model_path(spec.model_path)
    keys = server_keys(servers)
    max_model_len = int(AutoConfig.from_pretrained(str(model_path)).max_position_embeddings)
    stop_ids = sorted(eos_token_ids(model_path))
    probe = WeightProbe(model_path, max_gap=spec.vllm.max_gap(spec.dtype), dtype=TORCH_DTYPES[spec.dtype])

    def command(path: str, host: str, port: int, name: str, threads: int) -> tuple[list[str], dict[str, str]]:
        argv = vllm_command(path, host, port, dtype=spec.dtype, max_batch_size=spec.max_batch_size,
                            max_model_len=max_model_len, enforce_eager=spec.vllm.enforce_eager, device=spec.device)
        settings = VllmSettings(kv_cache_gib=spec.vllm.kv_cache_gib, cpus=generation_cpus(threads))
        return argv, vllm_server_env(settings, enforce_eager=spec.vllm.enforce_eager)

    def transport(router: ServerRolloutEngine) -> VllmShmTransport:
        def endpoints() -> list[VllmHttpEndpoint]:
            return [VllmHttpEndpoint(url, timeout_s=spec.vllm.update_timeout_s, keys=keys, in_flight=spec.vllm.in_flight)
                    for url in router.receivers()]

        return VllmShmTransport(endpoints, probe)

    kind = ServerKind(
        command=command,
        live_updates=True,  # vLLM keeps requests across an update; each token's version comes back
        client=lambda url, session: VllmServerClient(url, session, request_timeout_s=servers.request_timeout_s,
                                                     stop_token_ids=stop_ids, keys=keys),
        transport=transport,
        wrap_sync=lambda inner: ProbedWeightSync(inner, probe),
        key_env=vllm_key_env,
        records_agents=False,  # its /v1 answers carry no weight versions: agents get the run's recording proxy
    )
    return build_server_components(config, setup, kind)
