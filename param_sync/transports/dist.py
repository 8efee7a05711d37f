"""torch.distributed transport: the trainer rank broadcasts each bucket to every rollout rank.

The trainer rank runs :class:`DistTransport`; every other rank of the group runs
:func:`serve_dist`, which receives each bucket into a local staging buffer, verifies it and
loads it. Control messages travel with ``broadcast_object_list``, bucket bytes with
``broadcast`` of a uint8 tensor, and the reports come back with ``gather_object``. Built for
gloo over CPU tensors (the buffer lives in host memory).

Invariants:
- every rank takes part in every collective in the same order (``Begin``, then per bucket its
  header and its bytes, then ``End`` or ``Abort`` and the report gather), so a failure on
  one side never leaves the group waiting: a gather that fails midway sends ``Abort``, a bad
  bucket is still received in full and then rejected by the receiver;
- the staging buffer is this rank's own memory: the trainer's buffer may be rewritten as soon
  as the transfer's broadcasts end.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
import torch.distributed as dist

from tandem.param_sync.bucket import BucketHeader, Manifest
from tandem.param_sync.buffer import BufferHalf, host_half
from tandem.param_sync.receiver import LoadReport, Receiver
from tandem.param_sync.transports.messages import Abort, Begin, Close, End

__all__ = ["DistTransport", "serve_dist"]


class DistTransport:
    """The trainer rank's end. ``src`` is this rank; ``group`` defaults to the world."""

    def __init__(self, *, src: int = 0, group: dist.ProcessGroup | None = None) -> None:
        if dist.get_rank(group) != src:
            raise ValueError(f"DistTransport runs on the source rank {src}, not rank {dist.get_rank(group)}")
        self._src = src
        self._group = group
        self._transfer = 0

    def allocate(self, nbytes: int) -> BufferHalf:
        return host_half(nbytes)

    def send(self, manifest: Manifest, half: BufferHalf, buckets: Iterable[BucketHeader]) -> list[LoadReport]:
        self._transfer += 1
        self._post(Begin(self._transfer, manifest, None))
        try:
            for header in buckets:
                self._post(header)
                chunk = half.array[header.offset : header.offset + header.nbytes]
                dist.broadcast(torch.from_numpy(chunk), self._src, group=self._group)
        except BaseException as exc:
            self._post(Abort(str(exc)))
            self._reports()
            raise
        self._post(End())
        return self._reports()

    def close(self) -> None:
        self._post(Close())

    def _post(self, message: object) -> None:
        dist.broadcast_object_list([message], self._src, group=self._group)

    def _reports(self) -> list[LoadReport]:
        gathered: list[LoadReport | None] = [None] * dist.get_world_size(self._group)
        dist.gather_object(None, gathered, dst=self._src, group=self._group)
        return [report for report in gathered if report is not None]


def serve_dist(receiver: Receiver, *, src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """A rollout rank's loop: apply each transfer broadcast from ``src`` until ``Close``."""
    staging = np.empty(0, np.uint8)
    while True:
        box: list[object] = [None]
        dist.broadcast_object_list(box, src, group=group)
        message = box[0]
        if isinstance(message, BucketHeader):
            end = message.offset + message.nbytes
            # An out-of-range header still has its bytes broadcast: take them, then reject it.
            fits = 0 <= message.offset <= end <= staging.size
            chunk = staging[message.offset : end] if fits else np.empty(message.nbytes, np.uint8)
            dist.broadcast(torch.from_numpy(chunk), src, group=group)
            receiver.bucket(message)
        elif isinstance(message, Begin):
            if staging.size < message.manifest.total_nbytes:
                staging = np.empty(message.manifest.total_nbytes, np.uint8)
            receiver.begin(message.manifest, staging)
        elif isinstance(message, End):
            dist.gather_object(receiver.end(), None, dst=src, group=group)
        elif isinstance(message, Abort):
            dist.gather_object(receiver.abort(message.reason), None, dst=src, group=group)
        elif isinstance(message, Close):
            return
        else:
            raise TypeError(f"unexpected message {type(message).__name__}")
