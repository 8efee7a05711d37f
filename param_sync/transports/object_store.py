"""Ray object-store transport: the trainer actor puts each bucket in the object store, every
rollout actor copies it into a staging buffer and loads it.

The trainer side (:class:`ObjectStoreTransport`) runs in the trainer actor's send thread: it
``ray.put``\\s a numpy view of each finished bucket of the buffer half (numpy, not a torch
tensor: Ray stores numpy arrays with one memcpy, measured ~9 GB/s here, but pickles tensors at
~0.4 GB/s), and passes the reference to each receiver's ``bucket`` method, so Ray hands the
actor a read-only zero-copy view of the stored bytes. The rollout side
(:class:`ObjectStoreEndpoint`) lives in the rollout actor.

Invariants:
- a receiver's calls of one transfer run one at a time in the order they were sent: Ray does
  not order an async actor's calls (a bucket waits for its object, a later ``end`` does not),
  so each call carries its place and the endpoint holds it until its turn; the
  :class:`~param_sync.receiver.Receiver` still checks every bucket's sequence number;
- the staging buffer is the actor's own memory: the object and the trainer's half may be freed
  or rewritten once ``end`` has answered;
- a receiver whose actor died answers with a failed report naming it (``version`` -1: unknown),
  so the sync fails as a whole and the other engines keep a consistent version.

Blocking on a result is fine here: ``send`` runs on a worker thread, never on an event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
from ray.exceptions import RayActorError

from tandem.param_sync.bucket import BucketHeader, Manifest
from tandem.param_sync.buffer import BufferHalf, host_half
from tandem.param_sync.errors import TransferError
from tandem.param_sync.receiver import LoadReport, Receiver

__all__ = ["ObjectStoreEndpoint", "ObjectStoreTransport", "RemoteReceiver"]


@dataclass(slots=True, frozen=True)
class RemoteReceiver:
    """A rollout actor as the transport sees it: its name and a handle whose ``begin``,
    ``bucket``, ``end`` and ``abort`` methods forward to an :class:`ObjectStoreEndpoint`."""

    name: str
    handle: Any  # ray.actor.ActorHandle


class ObjectStoreTransport:
    """The trainer's end: one ``ray.put`` per bucket, shared by every receiver. Calls carry
    (transfer, index) so the endpoint runs them in order (Ray does not order an async actor's
    calls)."""

    def __init__(self, receivers: Sequence[RemoteReceiver]) -> None:
        if not receivers:
            raise ValueError("an object-store transport needs at least one receiver")
        self.receivers = list(receivers)
        self._transfer = 0

    def allocate(self, nbytes: int) -> BufferHalf:
        return host_half(nbytes)

    def send(self, manifest: Manifest, half: BufferHalf, buckets: Iterable[BucketHeader]) -> list[LoadReport]:
        self._transfer += 1
        transfer, index = self._transfer, 1
        for r in self.receivers:
            r.handle.begin.remote(transfer, manifest)
        try:
            for header in buckets:
                ref = ray.put(half.array[header.offset : header.offset + header.nbytes])
                for r in self.receivers:
                    r.handle.bucket.remote(transfer, index, header, ref)
                index += 1
        except BaseException as exc:
            self._collect([r.handle.abort.remote(transfer, index, str(exc)) for r in self.receivers])
            raise
        return self._collect([r.handle.end.remote(transfer, index) for r in self.receivers])

    def close(self) -> None:
        """Nothing to free: the receivers are actors the backend owns."""

    def _collect(self, refs: list[Any]) -> list[LoadReport]:
        reports = []
        for receiver, ref in zip(self.receivers, refs, strict=True):
            try:
                reports.append(ref.future().result())  # ray.get, minus its warning in async actors
            except RayActorError as exc:
                reports.append(LoadReport(receiver.name, -1, False, f"actor {receiver.name!r} died: {exc}"))
        return reports


class ObjectStoreEndpoint:
    """The rollout actor's end: runs a transfer's calls in order, stages each bucket's bytes
    and feeds them to ``receiver``. Its methods run on one event loop (the actor's ``weights``
    concurrency group), which they block while they copy: that loop serves nothing else.

    Call ``index`` 0 is ``begin``; a call waits until every earlier call of its transfer ran.
    A ``begin`` of a newer transfer starts at once (a restarted actor never saw the older
    ones); a call of a transfer older than the current one is refused.
    """

    def __init__(self, receiver: Receiver) -> None:
        self.receiver = receiver
        self._staging = np.empty(0, np.uint8)
        self._transfer = 0
        self._next = 0  # index of the current transfer's next call
        self._turns: asyncio.Condition | None = None  # made on the loop that uses it

    async def begin(self, transfer: int, manifest: Manifest) -> None:
        async with self._turn(transfer, 0):
            if self._staging.size < manifest.total_nbytes:
                self._staging = np.empty(manifest.total_nbytes, np.uint8)
            self.receiver.begin(manifest, self._staging)

    async def bucket(self, transfer: int, index: int, header: BucketHeader, chunk: np.ndarray) -> None:
        async with self._turn(transfer, index):
            end = header.offset + header.nbytes
            if 0 <= header.offset <= end <= self._staging.size and chunk.size == header.nbytes:
                self._staging[header.offset : end] = chunk
            # A header that does not fit still goes to the receiver, which rejects it by name.
            self.receiver.bucket(header)

    async def end(self, transfer: int, index: int) -> LoadReport:
        async with self._turn(transfer, index):
            return self.receiver.end()

    async def abort(self, transfer: int, index: int, reason: str) -> LoadReport:
        async with self._turn(transfer, index):
            return self.receiver.abort(reason)

    @contextlib.asynccontextmanager
    async def _turn(self, transfer: int, index: int) -> AsyncIterator[None]:
        if self._turns is None:
            self._turns = asyncio.Condition()
        async with self._turns:
            await self._turns.wait_for(
                lambda: transfer < self._transfer
                or (transfer == self._transfer and index == self._next)
                or (transfer > self._transfer and index == 0)
            )
            if transfer < self._transfer:
                raise TransferError(f"call {index} of transfer {transfer} came after transfer {self._transfer} began")
            self._transfer, self._next = transfer, index + 1
            try:
                yield
            finally:
                self._turns.notify_all()
