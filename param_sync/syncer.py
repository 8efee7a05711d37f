"""ParamSyncer: the trainer-side driver of a weight sync (``core.protocols.WeightSync``).

One ``sync(version)`` runs the path gather -> bucketize -> dual buffer -> transport -> load:
a gather thread copies each full tensor from the :class:`SyncSource` into the inactive half of
the :class:`DualBuffer` (a host tensor in cache-sized parts, spread over ``gather_threads``
copy threads and each checksummed right after its copy) and hands each finished bucket (with
its checksum) to a send thread,
which streams it through the :class:`Transport` to every receiver while the next bucket is
gathered. The event loop only awaits the two threads, which the syncer owns (its own pool of
two, so work elsewhere on the loop's default executor can never starve a transfer).

Invariants:
- syncs run one at a time, in call order: the gather of ``v + 1`` starts only once the
  transfer of ``v`` has ended. Within a sync the gather and the transfer overlap, bucket by
  bucket. Not overlapping syncs is what lets receivers serve straight from the buffer
  (:class:`~param_sync.protocols.MappableTarget`): ``v + 1`` is written into the half that
  ``v - 1`` was sent in, which such receivers serve from until the transfer of ``v`` commits
  (and which they copy out of if it aborts);
- versions only move forward: the buffer rejects a version older than the newest gathered,
  and each target rejects one older than the one it serves;
- a sync that fails raises a :class:`SyncError` after every receiver has either committed the
  whole version or aborted it: each engine serves one complete version, and the next sync
  starts from scratch. A cancelled caller does not cancel the sync: it runs to its end in the
  background, so the buffer and the receivers stay consistent;
- the layout (names, dtypes, shapes, offsets) is planned on the first sync by walking the
  source once, and re-planned on the sync after the source's layout changed.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from tandem.param_sync.bucket import ALIGN, FUSE_NBYTES, U64, BucketHeader, Manifest, MiB, checksum, plan_manifest, tensor_bytes
from tandem.param_sync.buffer import BufferHalf, DualBuffer
from tandem.param_sync.errors import GatherError, LayoutError, SyncError, TransferError
from tandem.param_sync.feed import BucketFeed
from tandem.param_sync.protocols import SyncSource, Transport
from tandem.param_sync.receiver import LoadReport

__all__ = ["ParamSyncer"]

_T = TypeVar("_T")


@dataclass(slots=True, frozen=True)
class _Gathered:
    gather_s: float  # wall time: reading the source, copying into the buffer, checksumming
    checksum_s: float  # seconds spent checksumming, summed over the gather threads


@dataclass(slots=True, frozen=True)
class _Sent:
    reports: list[LoadReport]
    send_s: float  # wall time of the transfer, overlapping the gather and the loads


class _BucketSums:
    """Checksums the buckets of a stream as it is written front to back, and hands each on
    (header and checksum) as soon as its last byte is written.

    ``advance(written)`` sums the bytes written since the last call, so a caller that calls it
    after every cache-sized copy reads each byte back from cache rather than from memory. Parts
    are cut at whole 64-bit words from the bucket's start, which makes their sums add up to the
    bucket's :func:`checksum`.
    """

    def __init__(self, manifest: Manifest, stream: np.ndarray, feed: BucketFeed) -> None:
        self._manifest = manifest
        self._stream = stream
        self._feed = feed
        self._seq = 0
        self._summed = 0  # bytes of the stream already in a sum
        self._sum = 0  # of the current bucket's bytes in [its start, _summed)
        self.spent_s = 0.0

    def advance(self, written: int) -> None:
        """Every byte of the stream before ``written`` is final."""
        manifest = self._manifest
        while self._seq < manifest.bucket_count:
            start, stop = manifest.bucket_range(self._seq)
            upto = stop if written >= stop else start + (written - start) // 8 * 8
            if upto > self._summed:
                t0 = time.perf_counter()
                self._sum += checksum(self._stream[self._summed : upto])
                self.spent_s += time.perf_counter() - t0
                self._summed = upto
            if self._summed < stop:
                return
            header = BucketHeader(manifest.version, self._seq, manifest.bucket_count, start, stop - start, self._sum % U64)
            self._feed.put(header)
            self._seq, self._sum = self._seq + 1, 0

    def add_part(self, part: _Part, part_sum: int, spent_s: float) -> None:
        """``part``'s bytes are final and summed elsewhere (``part_sum``, in ``spent_s``); parts
        must come in stream order. Bytes between the previous part and this one are summed here."""
        self.advance(part.lo)
        self._sum += part_sum
        self._summed = part.sum_hi
        self.spent_s += spent_s
        self.advance(part.sum_hi)


@dataclass(slots=True, frozen=True)
class _Part:
    """Bytes ``[lo, hi)`` of the stream, copied from ``[lo - base, hi - base)`` of one tensor's
    bytes, and checksummed over ``[lo, sum_hi)``: ``hi`` rounded up to a whole word from the
    bucket's start (the padding after the tensor's last byte), within the bucket. Never spans
    two buckets, so parts checksummed apart add up to each bucket's checksum."""

    lo: int
    hi: int
    sum_hi: int
    base: int


def _host_parts(manifest: Manifest, offset: int, nbytes: int) -> list[_Part]:
    """A host tensor at ``offset`` cut into parts of at most ``FUSE_NBYTES`` that never span
    two buckets (bucket sizes are whole words, so every cut but the tensor's end is one)."""
    parts: list[_Part] = []
    pos, end = offset, offset + nbytes
    while pos < end:
        bucket_stop = manifest.bucket_range(pos // manifest.bucket_nbytes)[1]
        stop = min(end, pos + FUSE_NBYTES, bucket_stop)
        parts.append(_Part(pos, stop, min(-(-stop // 8) * 8, bucket_stop), offset))
        pos = stop
    return parts


def _copy_and_sum(stream: np.ndarray, host: np.ndarray, part: _Part) -> tuple[int, float]:
    """Copy one part into the stream and checksum it while it is still in cache."""
    np.copyto(stream[part.lo : part.hi], host[part.lo - part.base : part.hi - part.base])
    t0 = time.perf_counter()
    value = checksum(stream[part.lo : part.sum_hi])
    return value, time.perf_counter() - t0


class _PartPipeline:
    """Host parts copied (and checksummed) by the gather threads as they come, handed to the
    bucket sums in stream order.

    Why not one batch per tensor: waiting for each tensor's parts before starting the next
    idles a thread at every tensor's end and costs a round trip per tensor; measured on 2
    cores, 1 GiB of 8 MiB tensors gathered at 7.9 GB/s that way against 12.9 for two threads
    copying without a pause. So the gather thread only submits, and retires parts in order as
    they finish.

    Invariants: parts are retired (``sums.add_part``) in submission order, which is stream
    order; at most ``WINDOW_NBYTES`` of submitted parts are unretired, which bounds how long a
    source tensor (possibly a temporary, e.g. a gathered shard) is kept alive; once
    :meth:`drain` or :meth:`abandon` returns, no copy is running.
    """

    WINDOW_NBYTES = 32 * MiB

    def __init__(self, copiers: ThreadPoolExecutor | None, stream: np.ndarray, sums: _BucketSums) -> None:
        self._copiers = copiers
        self._stream = stream
        self._sums = sums
        self._pending: deque[tuple[_Part, Future[tuple[int, float]]]] = deque()
        self._pending_nbytes = 0

    def submit(self, host: np.ndarray, parts: list[_Part]) -> None:
        """Copy ``parts`` of ``host`` into the stream; returns once they are under way. Without
        gather threads, or when one part makes the whole tensor, the copy runs here: handing a
        small tensor to a thread costs more than copying it (a 1M-parameter model of 38
        tensors: 1.9 ms here against 3.7 ms through two threads)."""
        if self._copiers is None or len(parts) == 1:
            for part in parts:
                result = _copy_and_sum(self._stream, host, part)
                if not self._pending:  # nothing before it is unretired
                    self._sums.add_part(part, *result)
                    continue
                copied: Future[tuple[int, float]] = Future()
                copied.set_result(result)
                self._enqueue(part, copied)
            return
        for part in parts:
            self._enqueue(part, self._copiers.submit(_copy_and_sum, self._stream, host, part))

    def _enqueue(self, part: _Part, future: Future[tuple[int, float]]) -> None:
        self._pending.append((part, future))
        self._pending_nbytes += part.hi - part.lo
        while self._pending and (self._pending_nbytes > self.WINDOW_NBYTES or self._pending[0][1].done()):
            self._retire()

    def drain(self) -> None:
        """Wait for every submitted part and retire it."""
        while self._pending:
            self._retire()

    def abandon(self) -> None:
        """Wait for every submitted copy to end, keeping none of their results."""
        futures = [future for _, future in self._pending]
        self._pending.clear()
        wait(futures)

    def _retire(self) -> None:
        part, future = self._pending.popleft()
        self._pending_nbytes -= part.hi - part.lo
        self._sums.add_part(part, *future.result())


def _close_walk(walk: Iterator[tuple[str, torch.Tensor]]) -> None:
    """End a source's walk early or late alike (a generator releases what it holds)."""
    close = getattr(walk, "close", None)
    if close is not None:
        close()


class ParamSyncer:
    """Moves the source's weights into every receiver of ``transport``, version by version.

    ``produce_bucket_mb`` (MiB, rounded up to whole 64-byte lines) is the unit of checksumming
    and streaming; ``name_map`` turns trainer names into rollout names (names it lacks pass
    unchanged). ``gather_threads`` copy host tensors' parts into the buffer in parallel: one
    thread gathers 1 GiB of 8 MiB tensors at 6.6 GB/s on the 2-core machine measured here, two
    at 9.7 (a copy with ordinary stores runs at about half of one non-temporal memcpy); the
    trainer waits for the gather anyway (its weights lock), so these threads take no core
    training could use.
    """

    def __init__(
        self,
        source: SyncSource,
        transport: Transport,
        *,
        produce_bucket_mb: float = 64.0,
        name_map: Mapping[str, str] | None = None,
        gather_threads: int = 2,
    ) -> None:
        if produce_bucket_mb <= 0:
            raise ValueError(f"produce_bucket_mb must be positive, got {produce_bucket_mb}")
        if gather_threads < 1:
            raise ValueError(f"gather_threads must be at least 1, got {gather_threads}")
        self.source = source
        self.transport = transport
        # Whole lines: every cut between parts of a bucket then falls on a whole word.
        self._bucket_nbytes = -(-max(1, int(produce_bucket_mb * MiB)) // ALIGN) * ALIGN
        self._copiers = ThreadPoolExecutor(gather_threads, thread_name_prefix="param-gather") if gather_threads > 1 else None
        self._name_map = dict(name_map or {})
        self._manifest: Manifest | None = None
        self._buffer: DualBuffer | None = None
        self._lock = asyncio.Lock()  # one sync at a time
        self._tasks: set[asyncio.Task[dict[str, float]]] = set()
        # One sync at a time: its gather and its send, so two threads suffice.
        self._threads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="param-sync")
        self._loaded: dict[str, int] = {}

    @property
    def loaded_versions(self) -> dict[str, int]:
        """The version each engine reported serving after the last transfer it answered."""
        return dict(self._loaded)

    async def sync(self, version: int) -> dict[str, float]:
        """Make ``version`` the one every engine serves; return bytes and seconds per phase.

        Raises :class:`SyncError` (the engines keep their previous weights) on failure.
        """
        task = asyncio.get_running_loop().create_task(self._sync(version), name=f"param-sync-v{version}")
        self._tasks.add(task)
        task.add_done_callback(self._settled)
        return await asyncio.shield(task)

    async def aclose(self) -> None:
        """Wait for syncs in flight, free the buffer and close the transport."""
        if self._tasks:
            await asyncio.wait(set(self._tasks))
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None
        await self._in_thread(self.transport.close)
        self._threads.shutdown()
        if self._copiers is not None:
            self._copiers.shutdown()

    def _settled(self, task: asyncio.Task[dict[str, float]]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            # Marks the error retrieved: a cancelled caller has stopped waiting for it.
            task.exception()

    async def _sync(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        async with self._lock:
            manifest, buffer = await self._prepare()
            half = buffer.inactive(version)
            manifest = manifest.with_version(version)
            feed = BucketFeed()
            gathering = self._in_thread(self._gather, manifest, half, feed)
            sending = self._in_thread(self._send, manifest, half, feed)
            try:
                gathered = await gathering
            except BaseException as exc:
                # The transfer is aborting; it must end before the next sync writes this half.
                await asyncio.wait([sending])
                if not sending.cancelled():
                    sending.exception()  # the gather's failure is the one to report
                if isinstance(exc, LayoutError):
                    self._manifest = None  # re-plan on the next sync
                if isinstance(exc, SyncError):
                    raise
                raise GatherError(f"gathering version {version} failed: {exc}") from exc
            buffer.publish(version)
            try:
                sent = await sending
            except SyncError:
                raise
            except Exception as exc:
                raise TransferError(f"transfer of version {version} failed: {type(exc).__name__}: {exc}") from exc
        return self._metrics(manifest, gathered, sent, time.perf_counter() - start)

    async def _prepare(self) -> tuple[Manifest, DualBuffer]:
        """The layout and a buffer that fits it, planned and allocated when missing."""
        if self._manifest is None:
            try:
                manifest = await self._in_thread(self._plan)
            except SyncError:
                raise
            except Exception as exc:
                raise GatherError(f"reading the trainer's weights to plan the layout failed: {exc}") from exc
            if self._buffer is None or self._buffer.nbytes != manifest.total_nbytes:
                halves = await self._in_thread(self._allocate, manifest.total_nbytes)
                old = self._buffer
                # The version carries over: a new layout does not let versions go back.
                self._buffer = DualBuffer(halves, version=None if old is None else old.version)
                if old is not None:
                    old.close()
            self._manifest = manifest
        assert self._buffer is not None
        return self._manifest, self._buffer

    def _in_thread(self, fn: Callable[..., _T], *args: object) -> asyncio.Future[_T]:
        return asyncio.get_running_loop().run_in_executor(self._threads, fn, *args)

    def _allocate(self, nbytes: int) -> tuple[BufferHalf, BufferHalf]:
        first = self.transport.allocate(nbytes)
        try:
            return first, self.transport.allocate(nbytes)
        except BaseException:
            first.release()
            raise

    def _plan(self) -> Manifest:
        entries = (
            (self._name_map.get(name, name), t.dtype, tuple(t.shape), t.numel() * t.element_size())
            for name, t in self.source.named_tensors_for_sync()
        )
        return plan_manifest(entries, bucket_nbytes=self._bucket_nbytes, version=-1)

    def _gather(self, manifest: Manifest, half: BufferHalf, feed: BucketFeed) -> _Gathered:
        """Copy each tensor into ``half`` at its offset; hand on each bucket once it is full."""
        t0 = time.perf_counter()
        stream = half.array
        out = torch.from_numpy(stream)
        sums = _BucketSums(manifest, stream, feed)
        parts = _PartPipeline(self._copiers, stream, sums)
        metas = manifest.tensors
        count = 0
        # Held here, not by the loop: a source may guard its weights until its walk ends (the
        # trainer's weights lock), so the walk is closed only once no copy from it is running.
        walk = self.source.named_tensors_for_sync()
        try:
            for count, (name, tensor) in enumerate(walk, 1):
                name = self._name_map.get(name, name)
                if count > len(metas) or not metas[count - 1].matches(name, tensor):
                    raise LayoutError(f"the trainer's weights changed layout at {name!r} (tensor {count})")
                meta = metas[count - 1]
                data = tensor_bytes(tensor)
                if data.device.type == "cpu":
                    parts.submit(data.numpy(), _host_parts(manifest, meta.offset, meta.nbytes))
                    if count == len(metas):  # asking for more may end the walk and free the weights
                        parts.drain()
                    continue
                # A device tensor goes in whole buckets, as each copy from the device has a
                # fixed cost of its own; it is checksummed from the buffer afterwards, so every
                # host part before it must be in.
                parts.drain()
                pos, end = meta.offset, meta.offset + meta.nbytes
                while pos < end:
                    stop = min(end, (pos // manifest.bucket_nbytes + 1) * manifest.bucket_nbytes)
                    out[pos:stop].copy_(data[pos - meta.offset : stop - meta.offset])
                    sums.advance(stop)
                    pos = stop
            parts.drain()
            if count != len(metas):
                raise LayoutError(f"the trainer now has {count} weights, the layout {len(metas)}")
            # Buckets that end in the alignment padding before a trailing empty tensor.
            sums.advance(manifest.total_nbytes)
        except BaseException as exc:
            parts.abandon()  # no copy may write the half after the gather has ended
            feed.fail(exc)
            raise
        finally:
            _close_walk(walk)
            checksum_s = sums.spent_s
            # No view of the buffer may outlive the gather (shared memory must unmap).
            del stream, out, sums, parts
        feed.close()
        return _Gathered(time.perf_counter() - t0, checksum_s)

    def _send(self, manifest: Manifest, half: BufferHalf, feed: BucketFeed) -> _Sent:
        t0 = time.perf_counter()
        reports = self.transport.send(manifest, half, feed)
        return _Sent(reports, time.perf_counter() - t0)

    def _metrics(self, manifest: Manifest, gathered: _Gathered, sent: _Sent, total_s: float) -> dict[str, float]:
        reports = sent.reports
        for report in reports:
            self._loaded[report.engine] = report.version
        failed = [r for r in reports if not r.ok]
        if failed:
            detail = "; ".join(f"{r.engine} (serving {r.version}): {r.error}" for r in failed)
            raise TransferError(f"version {manifest.version} not loaded by {len(failed)} of {len(reports)} engines: {detail}")
        metrics = {
            "version": float(manifest.version),
            "bytes": float(manifest.total_nbytes),
            "buckets": float(manifest.bucket_count),
            "gather_s": gathered.gather_s,
            "checksum_s": gathered.checksum_s,
            "send_s": sent.send_s,
            "verify_s": max((r.verify_s for r in reports), default=0.0),
            "load_s": max((r.load_s for r in reports), default=0.0),
            "stall_s": max((r.stall_s for r in reports), default=0.0),
            "total_s": total_s,
            "gb_per_s": manifest.total_nbytes / total_s / 1e9 if total_s > 0 else 0.0,
        }
        metrics.update({f"loaded_version/{r.engine}": float(r.version) for r in reports})
        return metrics
