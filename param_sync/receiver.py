"""The rollout side of every transport: verifies a transfer bucket by bucket and loads it.

A transport calls ``begin(manifest, stream, persistent=...)``, then ``bucket(header)`` once the
header's bytes are in ``stream``, then ``end()`` (or ``abort(reason)``), and ships the returned
:class:`LoadReport` back to the trainer; ``close()`` when it stops. ``stream`` is wherever the
bytes land on this side: the trainer's buffer half itself (in-process, shared memory:
``persistent``, as the half is not written again before the next transfer begins) or a local
staging buffer (broadcast). A ``swap`` target that can map (:class:`MappableTarget`) serves a
persistent stream where it lies, so the rollout side only checks the bytes and copies none.

Invariants:
- a bucket is accepted only if it carries the transfer's version, the next sequence number,
  the planned byte range, and a matching checksum; after the first rejected bucket the rest of
  the transfer is ignored and the whole update is aborted;
- ``pause`` targets see ``begin_update`` only once every bucket has been verified, so the
  copies that run while generation is paused come from bytes already known good and cannot
  leave a half-loaded model; ``swap`` targets load each bucket into their idle set while
  generating, a cache-sized chunk at a time right after checksumming it, and commit only a
  complete transfer whose every bucket checked out; a mapping target is handed the stream at
  ``begin`` and, likewise, commits only a complete, verified transfer;
- the receiver never raises into the transport: every failure becomes a report with
  ``ok=False``, and the target keeps serving its previous version.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from tandem.param_sync.bucket import FUSE_NBYTES, U64, BucketHeader, Manifest, MiB, checksum
from tandem.param_sync.errors import StaleVersionError, TransferError
from tandem.param_sync.protocols import MappableTarget, SyncTarget

__all__ = ["LoadReport", "Receiver"]


@dataclass(slots=True, frozen=True)
class LoadReport:
    """How one engine's part of a transfer went. ``version`` is what it serves afterwards."""

    engine: str
    version: int
    ok: bool
    error: str = ""
    verify_s: float = 0.0
    load_s: float = 0.0
    stall_s: float = 0.0


class Receiver:
    """Checks and applies transfers to one :class:`SyncTarget`, in ``consume_bucket_mb`` pieces
    (in ``swap`` mode pieces of at most :data:`~param_sync.bucket.FUSE_NBYTES`, each loaded while
    the checksum has just brought it into cache)."""

    def __init__(self, target: SyncTarget, *, consume_bucket_mb: float = 64.0, engine: str = "rollout") -> None:
        if consume_bucket_mb <= 0:
            raise ValueError(f"consume_bucket_mb must be positive, got {consume_bucket_mb}")
        self.target = target
        self.engine = engine
        self._piece_nbytes = max(1, int(consume_bucket_mb * MiB))
        self._manifest: Manifest | None = None
        self._stream: np.ndarray | None = None
        self._next_seq = 0
        self._error = ""
        self._begun = False  # target.begin_update succeeded; an abort must reach the target
        self._mapped = False  # this transfer is served from the stream where it lies
        self._verify_s = 0.0
        self._load_s = 0.0

    def begin(self, manifest: Manifest, stream: np.ndarray, *, persistent: bool = False) -> None:
        if self._manifest is not None:
            # The previous transfer never ended (its sender vanished): drop it whole.
            self._abort_target()
        self._manifest, self._stream = manifest, stream
        self._next_seq, self._error, self._begun, self._mapped = 0, "", False, False
        self._verify_s = self._load_s = 0.0
        try:
            if manifest.version < self.target.loaded_version:
                raise StaleVersionError(
                    f"version {manifest.version} is older than loaded version {self.target.loaded_version}"
                )
            if stream.size < manifest.total_nbytes:
                raise TransferError(f"stream holds {stream.size} bytes, manifest needs {manifest.total_nbytes}")
            target = self.target
            if persistent and isinstance(target, MappableTarget) and target.can_map:
                target.map_update(manifest, stream)
                self._begun = self._mapped = True
            elif target.load_mode == "swap":
                target.begin_update(manifest)
                self._begun = True
        except Exception as exc:
            self._fail(exc)

    def bucket(self, header: BucketHeader) -> None:
        if self._error:
            return
        try:
            self._accept(header)
        except Exception as exc:
            self._fail(exc)

    def end(self) -> LoadReport:
        manifest = self._manifest
        if manifest is None:
            return self._report(ok=False, error="end of a transfer that never began")
        if not self._error and self._next_seq != manifest.bucket_count:
            self._fail(TransferError(f"incomplete transfer: {self._next_seq} of {manifest.bucket_count} buckets"))
        if self._error:
            return self._finish(ok=False)
        try:
            if self.target.load_mode == "pause":
                self.target.begin_update(manifest)
                self._begun = True
                self._load(0, manifest.total_nbytes)
            stall_s = self.target.commit(manifest.version)
        except Exception as exc:
            self._fail(exc)
            return self._finish(ok=False)
        self._begun = False
        return self._finish(ok=True, stall_s=stall_s)

    def abort(self, reason: str) -> LoadReport:
        if not self._error:
            self._fail(TransferError(f"sender aborted the transfer: {reason}"))
        return self._finish(ok=False)

    def close(self) -> None:
        """The transport stops: a target serving from its memory copies its weights out."""
        if self._manifest is not None:
            self.abort("the transport closed")
        if isinstance(self.target, MappableTarget):
            self.target.detach()

    def _accept(self, header: BucketHeader) -> None:
        manifest, stream = self._manifest, self._stream
        if manifest is None or stream is None:
            raise TransferError(f"bucket {header.seq} arrived outside a transfer")
        if header.version != manifest.version:
            raise TransferError(f"bucket {header.seq} is for version {header.version}, not {manifest.version}")
        if header.seq != self._next_seq or header.count != manifest.bucket_count:
            raise TransferError(
                f"out-of-order bucket: got {header.seq}/{header.count}, expected {self._next_seq}/{manifest.bucket_count}"
            )
        start, stop = manifest.bucket_range(header.seq)
        if (header.offset, header.offset + header.nbytes) != (start, stop):
            raise TransferError(f"bucket {header.seq} covers [{header.offset}, +{header.nbytes}), expected [{start}, {stop})")
        if self.target.load_mode == "swap" and not self._mapped:
            value = self._verify_and_load(start, stop)
        else:
            t0 = time.perf_counter()
            value = checksum(stream[start:stop])
            self._verify_s += time.perf_counter() - t0
        if value != header.checksum:
            raise TransferError(f"bucket {header.seq} of version {header.version} is corrupt (checksum mismatch)")
        self._next_seq += 1

    def _verify_and_load(self, start: int, stop: int) -> int:
        """Checksum bucket ``[start, stop)`` chunk by chunk, loading each chunk into the idle set
        right after it is summed, while it is still in cache; returns the bucket's checksum.

        Swap mode only: the idle set may hold bytes of a bucket that turns out corrupt, as
        nothing serves from it before a commit, and a commit needs every bucket verified.
        """
        assert self._manifest is not None and self._stream is not None
        manifest, stream = self._manifest, self._stream
        step = min(self._piece_nbytes, FUSE_NBYTES)

        def word(at: int) -> int:
            """Parts of a checksum must be whole 64-bit words from the bucket's start."""
            return stop if at == stop else start + (at - start) // 8 * 8

        total = 0
        for lo in range(start, stop, step):
            hi = min(lo + step, stop)
            t0 = time.perf_counter()
            total += checksum(stream[word(lo) : word(hi)])
            t1 = time.perf_counter()
            self.target.load_bucket(manifest.slices(stream, lo, hi))
            self._verify_s += t1 - t0
            self._load_s += time.perf_counter() - t1
        return total % U64

    def _load(self, start: int, stop: int) -> None:
        assert self._manifest is not None and self._stream is not None
        t0 = time.perf_counter()
        for lo in range(start, stop, self._piece_nbytes):
            self.target.load_bucket(self._manifest.slices(self._stream, lo, min(lo + self._piece_nbytes, stop)))
        self._load_s += time.perf_counter() - t0

    def _fail(self, exc: Exception) -> None:
        self._error = f"{type(exc).__name__}: {exc}"
        self._abort_target()

    def _abort_target(self) -> None:
        if self._begun:
            self._begun = False
            try:
                self.target.abort()
            except Exception as exc:
                self._error += f"; abort failed: {type(exc).__name__}: {exc}"

    def _finish(self, *, ok: bool, stall_s: float = 0.0) -> LoadReport:
        report = self._report(ok=ok, error=self._error, stall_s=stall_s)
        # Drop the stream view: a shared-memory segment cannot be unmapped while one exists.
        self._manifest, self._stream = None, None
        return report

    def _report(self, *, ok: bool, error: str = "", stall_s: float = 0.0) -> LoadReport:
        return LoadReport(
            self.engine,
            self.target.loaded_version,
            ok,
            error,
            verify_s=self._verify_s,
            load_s=self._load_s,
            stall_s=stall_s,
        )
