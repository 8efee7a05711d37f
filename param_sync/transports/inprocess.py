"""In-process transport: receivers in this process read the trainer's buffer directly.

Nothing is copied in transit: each receiver verifies and loads straight from the half the
gather is writing, bucket by bucket, so the only copies are gather (weights -> buffer) and
load (buffer -> engine), and a target that maps the half skips the load. Receivers are served
one after the other in the send thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tandem.param_sync.bucket import BucketHeader, Manifest
from tandem.param_sync.buffer import BufferHalf, host_half
from tandem.param_sync.receiver import LoadReport, Receiver

__all__ = ["InProcessTransport"]


class InProcessTransport:
    def __init__(self, receivers: Sequence[Receiver]) -> None:
        if not receivers:
            raise ValueError("an in-process transport needs at least one receiver")
        self.receivers = list(receivers)

    def allocate(self, nbytes: int) -> BufferHalf:
        return host_half(nbytes)

    def send(self, manifest: Manifest, half: BufferHalf, buckets: Iterable[BucketHeader]) -> list[LoadReport]:
        for receiver in self.receivers:
            receiver.begin(manifest, half.array, persistent=True)
        try:
            for header in buckets:
                for receiver in self.receivers:
                    receiver.bucket(header)
        except BaseException as exc:
            for receiver in self.receivers:
                receiver.abort(str(exc))
            raise
        return [receiver.end() for receiver in self.receivers]

    def close(self) -> None:
        """The halves are about to be freed: receivers serving from one copy their weights out."""
        for receiver in self.receivers:
            receiver.close()
