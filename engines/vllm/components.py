"""Builds vLLM in process as the rollout engine of a torch bundle (``engines.rollout: vllm``).

What it owns: turning the config into a :class:`~engines.vllm.engine.VllmRolloutEngine` (its KV
cache and the cores its threads bind to) and the weight sync into it: the trainer's gather
into a dual buffer of shared-memory halves (``param_sync``), loaded by vLLM's workers in place,
each sync proven by the probe (``engines.vllm.sync``) and its gap reported as ``logprob_gap``.

Thread budget (2 cores here): vLLM binds one OpenMP thread per core it is given. Generation
gets the last ``generation_threads`` cores of this process's affinity (all of them at k = 0,
when the phases take turns; half when generation overlaps training), the trainer's threads
(``torch.set_num_threads``) run on the rest.
"""

from __future__ import annotations

import os

from core.config import TandemConfig, TorchEnginesConfig
from core.protocols import SyncReport
from engines.torch_sync import TorchWeightSync, TrainerSyncSource
from engines.vllm.engine import VllmRolloutEngine, VllmSettings
from engines.vllm.sync import VllmShmTransport, WeightProbe
from param_sync import ParamSyncer

__all__ = ["VllmWeightSync", "generation_cpus", "vllm_rollout"]


def generation_cpus(threads: int) -> list[int]:
    """The cores vLLM's threads bind to: the last ``threads`` of this process's affinity."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return cores[-threads:]


class VllmWeightSync:
    """The flow's ``WeightSync`` into vLLM: the trainer's param_sync path, with each sync's probe
    gap added to its metrics (``logprob_gap``, nats)."""

    def __init__(self, inner: TorchWeightSync, probe: WeightProbe) -> None:
        self._inner = inner
        self._probe = probe

    async def sync(self, version: int) -> SyncReport:
        report = await self._inner.sync(version)
        gap = self._probe.last_gap
        return SyncReport(report.version, {**report.metrics, **({"logprob_gap": gap} if gap is not None else {})})

    def close(self) -> None:
        self._inner.close()


def vllm_rollout(config: TandemConfig, trainer: object, threads: int) -> tuple[VllmRolloutEngine, VllmWeightSync]:
    """vLLM serving ``engines.model_path`` on ``threads`` cores, and the weight sync into it from ``trainer``."""
    from engines.torch_components import TORCH_DTYPES, resolve_model_path

    spec = config.engines
    assert isinstance(spec, TorchEnginesConfig)
    model_path = resolve_model_path(spec.model_path)
    settings = VllmSettings(kv_cache_gib=spec.vllm.kv_cache_gib, cpus=generation_cpus(threads))
    engine = VllmRolloutEngine(
        model_path, device=spec.device, dtype=spec.dtype, max_batch_size=spec.max_batch_size, settings=settings,
        enforce_eager=spec.vllm.enforce_eager, update_timeout_s=spec.vllm.update_timeout_s,
    )  # fmt: skip
    try:
        probe = WeightProbe(model_path, max_gap=spec.vllm.max_gap(spec.dtype), dtype=TORCH_DTYPES[spec.dtype])
        source = TrainerSyncSource(trainer)  # type: ignore[arg-type]
        syncer = ParamSyncer(source, VllmShmTransport(engine, probe), produce_bucket_mb=config.param_sync.produce_bucket_mb)
        return engine, VllmWeightSync(TorchWeightSync(source, syncer), probe)
    except BaseException:
        engine.close()
        raise
