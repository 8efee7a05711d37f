"""Proof that a weight sync landed: a fixed sequence scored where generation runs, compared with the trainer.

Why: a transfer's checksums prove the bytes arrived, not that the engine computes with them. A
load into the wrong tensor, a packed copy left stale (vLLM's CPU backend), or a LoRA adapter
that never reached the rollout engine all pass them; the last looked like staleness in every
other metric for weeks in three peers' runs (verl #7495, ms-swift #9855, TRL #7017). Log-probs
of one short sequence catch each in milliseconds.

What it owns: the text probe, a token sequence, and the one computation of its log-probs every
side runs (:func:`probe_sequence`, :func:`probe_logprobs`, :func:`probe_gap`); for engines in
this process, whatever their probe's input (a token sequence here, a denoising trajectory in
``engines.diffusion.probe``), the trainer's record of its log-probs per version
(:class:`ProbeRecord`) and the transport wrapper that checks every committed load against it
(:class:`ProbedTransport`; ``tandem serve``'s too, scored over HTTP); and the weight sync that
reports each sync's gap as ``logprob_gap`` (:class:`ProbedWeightSync`, vLLM's too).

Invariants:
- the trainer records version ``v``'s log-probs under the lock that makes ``v`` (its weights
  lock), so a record never pairs a version with another version's weights;
- a sync whose gap exceeds the bound fails (its report ``ok=False``, the error naming the gap
  and saying the weights did not land), so the flow's sync-failure policy applies to it as to
  any failed sync; every probed sync's gap is kept for the run's metrics.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Generic, Protocol, TypeVar

import numpy as np
import torch

from tandem.core.protocols import SyncReport
from tandem.engines.shared.weight_sync import LoadsWeights, SyncedTrainer, TorchWeightSync, in_process_transport
from tandem.param_sync import BucketHeader, BufferHalf, LoadReport, Manifest, SyncError, Transport

__all__ = [
    "ProbeRecord",
    "ProbedTransport",
    "ProbedWeightSync",
    "ScoresProbe",
    "probe_gap",
    "probe_logprobs",
    "probe_sequence",
    "probed_in_process",
]

# What a probe scores: the same fixed input on both sides of a sync.
ProbeInput = TypeVar("ProbeInput")


def probe_sequence(vocab_size: int, length: int = 32, seed: int = 0) -> list[int]:
    """A fixed sequence of token ids, the same on every call: random ids make every row of the
    output projection matter, so a stale or misplaced weight shows in their log-probs."""
    return np.random.default_rng(seed).integers(0, vocab_size, size=length).tolist()


def probe_logprobs(
    model: torch.nn.Module, token_ids: Sequence[int], weights: Mapping[str, torch.Tensor] | None = None
) -> list[float]:
    """Log-probs (temperature 1) of ``token_ids[1:]``, each given the tokens before it, under
    ``model``, or under ``weights`` in place of its own (``torch.func.functional_call``: no copy)."""
    ids = torch.tensor([list(token_ids)], device=next(model.parameters()).device)
    with torch.no_grad():
        if weights is None:
            output = model(input_ids=ids)
        else:
            output = torch.func.functional_call(model, dict(weights), args=(ids,), strict=False)
    logprobs = torch.log_softmax(output.logits[0, :-1].float(), dim=-1)
    return logprobs.gather(1, ids[0, 1:, None]).squeeze(1).tolist()


def probe_gap(served: Sequence[float], expected: Sequence[float]) -> float:
    """The largest gap (nats) between two scorings of the probe, action by action (token or denoising step)."""
    return max(abs(a - b) for a, b in zip(served, expected, strict=True))


class ProbeRecord(Generic[ProbeInput]):
    """The probe's fixed ``inputs`` and the trainer's log-probs of them at each version it
    reached, kept until a sync asks for a newer one. The trainer calls :meth:`record` under its
    weights lock each time its weights change; the sync's check reads :meth:`expected` from
    another thread. What it holds is bounded by the flow's staleness bound: the trainer runs at
    most ``k + 1`` versions ahead of the one the rollout engine serves, and each sync drops the
    records older than its version."""

    def __init__(self, inputs: ProbeInput) -> None:
        self.inputs = inputs
        self._by_version: dict[int, list[float]] = {}
        self._lock = threading.Lock()

    def record(self, version: int, logprobs: list[float]) -> None:
        with self._lock:
            self._by_version[version] = logprobs

    def expected(self, version: int) -> list[float]:
        """The trainer's log-probs at ``version``; older records are dropped (syncs only move forward)."""
        with self._lock:
            self._by_version = {v: lp for v, lp in self._by_version.items() if v >= version}
            if version not in self._by_version:
                raise SyncError(f"weight probe: the trainer recorded no log-probs at version {version}")
            return self._by_version[version]


class ProbedTransport(Generic[ProbeInput]):
    """A :class:`~param_sync.Transport` into rollout engines whose every committed load is
    proven by the probe: ``score(inputs, engine)`` (the scoring of the probe's inputs by the
    engine a report names, under the weights it serves) against the trainer's
    :class:`ProbeRecord` at the transfer's version."""

    def __init__(
        self, inner: Transport, record: ProbeRecord[ProbeInput], score: Callable[[ProbeInput, str], list[float]], *,
        max_gap: float, what: str,
    ) -> None:  # fmt: skip
        if max_gap <= 0:
            raise ValueError(f"max_gap must be > 0, got {max_gap}")
        self._inner = inner
        self._record = record
        self._score = score
        self.max_gap = max_gap
        self._what = what  # what the transfer carries, for the error: "the adapter"
        self.last_gap: float | None = None

    def allocate(self, nbytes: int) -> BufferHalf:
        return self._inner.allocate(nbytes)

    def send(self, manifest: Manifest, half: BufferHalf, buckets: Iterable[BucketHeader]) -> list[LoadReport]:
        reports = self._inner.send(manifest, half, buckets)
        self.last_gap = None
        return [self._checked(report, manifest.version) if report.ok else report for report in reports]

    def close(self) -> None:
        self._inner.close()

    def _checked(self, report: LoadReport, version: int) -> LoadReport:
        gap = probe_gap(self._score(self._record.inputs, report.engine), self._record.expected(version))
        self.last_gap = gap if self.last_gap is None else max(self.last_gap, gap)  # several engines: the worst
        if gap <= self.max_gap:
            return report
        error = (
            f"weight probe: the rollout engine's log-probs at version {version} differ from the trainer's by up to "
            f"{gap:.3g} nats (bound {self.max_gap:g}): {self._what} did not land"
        )
        return dataclasses.replace(report, ok=False, error=error)


class GapSource(Protocol):
    """A probe that keeps the gap of the last sync it checked (None: it checked none)."""

    last_gap: float | None


class ProbedWeightSync:
    """The flow's ``WeightSync``: the trainer's param_sync path (``inner``) with each sync's probe
    gap added to its report's metrics as ``logprob_gap`` (nats)."""

    def __init__(self, inner: TorchWeightSync, probe: GapSource) -> None:
        self._inner = inner
        self._probe = probe

    async def sync(self, version: int) -> SyncReport:
        report = await self._inner.sync(version)
        gap = self._probe.last_gap
        return SyncReport(report.version, {**report.metrics, **({"logprob_gap": gap} if gap is not None else {})})

    def close(self) -> None:
        self._inner.close()


class ScoresProbe(LoadsWeights, Protocol[ProbeInput]):
    """A rollout engine in this process that scores the probe's inputs under the weights it serves."""

    def probe_logprobs(self, inputs: ProbeInput, /) -> list[float]: ...


def probed_in_process(
    trainer: SyncedTrainer, rollout: ScoresProbe[ProbeInput], record: ProbeRecord[ProbeInput], *, max_gap: float,
    what: str, produce_bucket_mb: float, consume_bucket_mb: float,
) -> ProbedWeightSync:  # fmt: skip
    """``TorchWeightSync.in_process`` with every load probed against the trainer's ``record``:
    a gap above ``max_gap`` fails the sync, saying ``what`` did not land."""
    transport = ProbedTransport(
        in_process_transport(rollout, consume_bucket_mb), record, lambda inputs, _engine: rollout.probe_logprobs(inputs),
        max_gap=max_gap, what=what,
    )  # fmt: skip
    return ProbedWeightSync(TorchWeightSync.through(trainer, transport, produce_bucket_mb=produce_bucket_mb), transport)
