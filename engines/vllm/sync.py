"""Weight sync into vLLM in process, with proof that each sync landed.

What it owns: :class:`VllmShmTransport`, the :class:`~param_sync.Transport` from the trainer's
dual buffer (halves in shared memory) into a :class:`~engines.vllm.engine.VllmRolloutEngine`,
and :class:`WeightProbe`, which after every load scores a fixed short sequence in vLLM and,
with the transformers model, under the very weights that were sent (the buffer half, read in
place), and compares the two (the probe's sequence and scoring: ``engines.shared.probe``).

Why the probe: the transfer's checksums prove the bytes reached vLLM's worker, not that vLLM
computes with them. vLLM's CPU backend keeps packed copies of weights that an in-place
reload can leave stale (the tied LM head, ``engines.vllm.worker``); a load into the wrong
parameter, a dtype cast gone wrong or a kept KV cache would all pass the checksums. Log-probs
of one sequence catch each of these in milliseconds.

With a LoRA adapter the transfer is the adapter's tensors alone (:func:`adapter_sync`), and the
probe compares vLLM's scoring under its current adapter with the trainer's own record at
the synced version (``engines.shared.probe.ProbedTransport``, as for the embedded engine): the
reference is the trainer's peft model, not a second model here.

Invariants: a sync whose probe gap exceeds the bound fails (``LoadReport.ok`` False, the error
naming the gap), so the flow's degradation policy applies as for any failed sync; the gap of
every sync is recorded (``WeightProbe.last_gap``) for the run's metrics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from tandem.engines.shared.probe import (
    ProbedTransport,
    ProbedWeightSync,
    ProbeRecord,
    probe_gap,
    probe_logprobs,
    probe_sequence,
)
from tandem.engines.shared.weight_sync import SyncedTrainer, TorchWeightSync
from tandem.param_sync import BucketHeader, BufferHalf, LoadReport, Manifest
from tandem.param_sync.bucket import dtype_from_name
from tandem.param_sync.transports.shm import segment_half

__all__ = ["VllmEndpoint", "VllmShmTransport", "WeightProbe", "adapter_sync"]


class WeightProbe:
    """Scores the probe sequence (``engines.shared.probe``) under the weights of a transfer (the reference) and in vLLM.

    The reference is the transformers model of the checkpoint, run with the transfer's tensors
    in place of its own (``torch.func.functional_call`` over views of the buffer half: no copy).
    It holds one copy of the model in host memory for its buffers and structure.
    """

    def __init__(self, model_path: str | Path, *, max_gap: float, dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoModelForCausalLM

        if max_gap <= 0:
            raise ValueError(f"max_gap must be > 0, got {max_gap}")
        self.max_gap = max_gap
        self._model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype).eval().requires_grad_(False)
        self.token_ids = probe_sequence(self._model.config.vocab_size)
        self.last_gap: float | None = None

    def reference(self, manifest: Manifest, stream: np.ndarray) -> list[float]:
        """Log-probs of ``token_ids[1:]`` (temperature 1) under the weights laid out in ``stream``."""
        flat = torch.from_numpy(stream)
        weights = {
            meta.name: flat[meta.offset : meta.offset + meta.nbytes].view(dtype_from_name(meta.dtype)).view(meta.shape)
            for meta in manifest.tensors
        }
        return probe_logprobs(self._model, self.token_ids, weights)

    def check(self, endpoint: VllmEndpoint, expected: Sequence[float], version: int) -> tuple[float, str]:
        """Score the probe in ``endpoint``; its largest gap to ``expected`` (:meth:`reference`), and
        an error message if that is above the bound, else ''."""
        served = endpoint.score(self.token_ids)
        gap = probe_gap(served, expected)
        if gap > self.max_gap:
            return gap, (
                f"weight probe: vLLM's log-probs at version {version} differ from the trainer's weights' "
                f"by up to {gap:.3g} nats (bound {self.max_gap:g}): the update did not land as sent"
            )
        return gap, ""


class VllmEndpoint(Protocol):
    """A vLLM that loads transfers from shared memory and scores a sequence: the engine in this
    process (:class:`~engines.vllm.engine.VllmRolloutEngine`) or a server
    (:class:`~engines.vllm.server.VllmHttpEndpoint`). Both calls block."""

    def load_from_shm(self, segment: str, manifest: Manifest, headers: Sequence[BucketHeader]) -> LoadReport: ...

    def score(self, token_ids: Sequence[int]) -> list[float]: ...


class VllmShmTransport:
    """The trainer's buffer halves, in shared memory, loaded in place by each vLLM's workers,
    then probed against ``probe`` (full weights); ``endpoints`` is asked per transfer (the servers
    in service may change). ``probe=None``: the caller proves each load, as :func:`adapter_sync`'s
    ``ProbedTransport`` does against the trainer's own record."""

    def __init__(self, endpoints: Callable[[], Sequence[VllmEndpoint]], probe: WeightProbe | None) -> None:
        self._endpoints = endpoints
        self._probe = probe

    def allocate(self, nbytes: int) -> BufferHalf:
        return segment_half(nbytes)

    def send(self, manifest: Manifest, half: BufferHalf, buckets: Iterable[BucketHeader]) -> list[LoadReport]:
        if half.segment is None:
            raise ValueError("the vLLM transport sends only halves it allocated")
        headers: Sequence[BucketHeader] = list(buckets)  # the gather's walk has ended: every checksum is known
        expected: list[float] | None = None
        gaps: list[float] = []
        reports = []
        # One after the other: each endpoint stands still only for its own load (~50 ms here).
        for endpoint in self._endpoints():
            report = endpoint.load_from_shm(half.segment, manifest, headers)
            if report.ok and self._probe is not None:
                if expected is None:
                    expected = self._probe.reference(manifest, half.array)
                gap, error = self._probe.check(endpoint, expected, manifest.version)
                gaps.append(gap)
                report = dataclasses.replace(report, ok=False, error=error) if error else report
            reports.append(report)
        if self._probe is not None:
            self._probe.last_gap = max(gaps) if gaps else None
        return reports

    def close(self) -> None:
        """Nothing held between transfers: the workers unmap each segment when its load ends."""


def adapter_sync(
    trainer: SyncedTrainer, record: ProbeRecord[list[int]], engine: VllmEndpoint, *, max_gap: float,
    produce_bucket_mb: float,
) -> ProbedWeightSync:  # fmt: skip
    """The weight sync of a LoRA ``trainer`` into ``engine``: the adapter's tensors alone, each
    load proven against the trainer's probe ``record`` (a gap above ``max_gap`` fails the sync:
    the adapter did not land), the gap reported as ``logprob_gap``."""

    def score(token_ids: list[int], _name: str) -> list[float]:  # one engine: every report is its own
        return engine.score(token_ids)

    transport = ProbedTransport(VllmShmTransport(lambda: [engine], None), record, score, max_gap=max_gap, what="the adapter")
    return ProbedWeightSync(TorchWeightSync.through(trainer, transport, produce_bucket_mb=produce_bucket_mb), transport)
