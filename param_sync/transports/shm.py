"""Shared-memory transport: rollout processes on this machine map the trainer's buffer.

The dual buffer's halves are ``multiprocessing.shared_memory`` segments. The trainer announces
a transfer and each finished bucket over a pipe per rollout process; the rollout process
(:func:`serve_shm`) verifies and loads each bucket straight from the segment while the trainer
gathers the next one, so the two processes work in parallel. A rollout whose weights are in
host memory maps the segment instead of loading it (:class:`~param_sync.protocols.MappableTarget`):
the bytes are then copied once in all (the gather) and read twice (both checksums).

Invariants:
- the trainer owns the segments: it creates them, and unlinks them when the buffer is
  released; a rollout process only maps them, and unmaps them when it stops;
- every transfer ends with exactly one answer per rollout process, a report from that process
  or a failed report written here when it is gone or does not answer within ``timeout_s``;
- a closed pipe in the middle of a transfer aborts it on the rollout side: old weights serve;
- a rollout process that does not answer within ``timeout_s`` is given up: its pipe is closed
  and it gets no more transfers. It must not serve again (restart it), because the trainer
  goes on to write the half it may still be mapped from;
- the rollout process keeps a segment mapped as long as it may serve from it: it unmaps only
  segments older than the two newest, after the transfer into the newest has ended.

Rollout processes must be started by the trainer's process (``multiprocessing`` spawn or fork)
so that they share its resource tracker; an unrelated process would have its own tracker
unlink the segments when it exits.
"""

from __future__ import annotations

import mmap
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory

import numpy as np

from tandem.param_sync.bucket import BucketHeader, Manifest
from tandem.param_sync.buffer import BufferHalf
from tandem.param_sync.receiver import LoadReport, Receiver
from tandem.param_sync.transports.messages import Abort, Ack, Begin, Close, End

__all__ = ["SEGMENT_PREFIX", "ShmTransport", "segment_half", "serve_shm"]

SEGMENT_PREFIX = "tandem-"


def segment_half(nbytes: int) -> BufferHalf:
    """A buffer half in a shared-memory segment of this process's own (unlinked when released),
    which other processes on the host map by ``half.segment``."""
    name = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    # A segment cannot be empty; the array shows only the bytes asked for.
    segment = SharedMemory(name=name, create=True, size=max(nbytes, 1))
    array = np.ndarray((nbytes,), dtype=np.uint8, buffer=segment.buf)
    # Fault every page in now: a first write into fresh shared memory runs at ~1 GB/s.
    array.fill(0)

    def release() -> None:
        segment.unlink()
        segment.close()

    return BufferHalf(array, segment=segment.name, release=release)
_PAGE = mmap.PAGESIZE


class ShmTransport:
    """The trainer's end: one duplex pipe per rollout process running :func:`serve_shm`."""

    def __init__(self, connections: Sequence[Connection], *, timeout_s: float = 60.0) -> None:
        if not connections:
            raise ValueError("a shared-memory transport needs at least one rollout connection")
        self._conns = list(connections)
        self._timeout_s = timeout_s
        self._transfer = 0
        self._dead: dict[int, str] = {}  # connection index -> why it is no longer usable
        # Names and versions the rollout processes reported last, for reports written here.
        self._engines = [f"shm{i}" for i in range(len(self._conns))]
        self._versions = [-1] * len(self._conns)

    def allocate(self, nbytes: int) -> BufferHalf:
        return segment_half(nbytes)

    def send(self, manifest: Manifest, half: BufferHalf, buckets: Iterable[BucketHeader]) -> list[LoadReport]:
        if half.segment is None:
            raise ValueError("the shared-memory transport sends only halves it allocated")
        self._transfer += 1
        self._post(Begin(self._transfer, manifest, half.segment))
        try:
            for header in buckets:
                self._post(header)
        except BaseException as exc:
            self._post(Abort(str(exc)))
            self._collect()
            raise
        self._post(End())
        return self._collect()

    def close(self) -> None:
        self._post(Close())
        for i, conn in enumerate(self._conns):
            if i not in self._dead:
                conn.close()

    def _post(self, message: object) -> None:
        for i, conn in enumerate(self._conns):
            if i in self._dead:
                continue
            try:
                conn.send(message)
            except OSError as exc:
                self._dead[i] = f"rollout process gone ({type(exc).__name__})"

    def _collect(self) -> list[LoadReport]:
        deadline = time.monotonic() + self._timeout_s
        return [self._answer(i, deadline) for i in range(len(self._conns))]

    def _answer(self, i: int, deadline: float) -> LoadReport:
        conn = self._conns[i]
        while i not in self._dead:
            try:
                if not conn.poll(max(0.0, deadline - time.monotonic())):
                    self._dead[i] = f"no answer within {self._timeout_s:g} s"
                    conn.close()
                    break
                message = conn.recv()
            except (EOFError, OSError) as exc:
                self._dead[i] = f"rollout process gone ({type(exc).__name__})"
                break
            if isinstance(message, Ack) and message.transfer == self._transfer:
                self._engines[i], self._versions[i] = message.report.engine, message.report.version
                return message.report
        return self._failed(i, self._dead[i])

    def _failed(self, i: int, error: str) -> LoadReport:
        return LoadReport(self._engines[i], self._versions[i], ok=False, error=error)


def serve_shm(conn: Connection, receiver: Receiver) -> None:
    """The rollout process's loop: apply each transfer announced on ``conn`` until ``Close``
    or until the trainer's end of the pipe closes (a transfer in flight is then aborted).
    On the way out the receiver copies mapped weights into memory of its own, then the
    segments are unmapped."""
    segments: OrderedDict[str, SharedMemory] = OrderedDict()
    transfer = 0
    try:
        while True:
            try:
                message = conn.recv()
            except EOFError:
                receiver.abort("the trainer's connection closed")
                return
            if isinstance(message, BucketHeader):
                receiver.bucket(message)
            elif isinstance(message, Begin):
                transfer = message.transfer
                stream = _map(segments, message.segment, message.manifest.total_nbytes)
                receiver.begin(message.manifest, stream, persistent=True)
                del stream
            elif isinstance(message, (End, Abort)):
                report = receiver.end() if isinstance(message, End) else receiver.abort(message.reason)
                # The target now serves from the newest segment or from its own memory.
                _unmap_older(segments, keep=2)
                conn.send(Ack(transfer, report))
            elif isinstance(message, Close):
                return
            else:
                raise TypeError(f"unexpected message {type(message).__name__}")
    finally:
        receiver.close()
        for segment in segments.values():
            segment.close()


def _map(segments: OrderedDict[str, SharedMemory], name: str | None, nbytes: int) -> np.ndarray:
    """A view of the first ``nbytes`` of segment ``name``, mapped once and kept while the
    trainer may still use it; an empty view if it cannot be."""
    if name is None:
        return np.empty(0, np.uint8)
    if name not in segments:
        try:
            segments[name] = SharedMemory(name=name)
        except FileNotFoundError:
            return np.empty(0, np.uint8)
        # Map every page now (one read each) rather than fault them in during the first load.
        np.frombuffer(segments[name].buf, np.uint8)[::_PAGE].sum()
    segments.move_to_end(name)
    segment = segments[name]
    if segment.size < nbytes:
        return np.empty(0, np.uint8)
    return np.ndarray((nbytes,), dtype=np.uint8, buffer=segment.buf)


def _unmap_older(segments: OrderedDict[str, SharedMemory], *, keep: int) -> None:
    """Unmap all but the ``keep`` most recently announced segments (a new buffer replaced them)."""
    while len(segments) > keep:
        segments.popitem(last=False)[1].close()
