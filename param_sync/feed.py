"""The handoff from the gather thread to the send thread: bucket headers in the order written.

The gather puts a bucket's header once its bytes are in the buffer, so the transport streams
bucket ``k`` while bucket ``k + 1`` is being gathered.

Invariants: headers come out in the order they went in; the feed ends exactly once, either
closed (the transfer is complete) or failed, in which case iterating raises
:class:`~param_sync.errors.GatherError` chained to the gather's exception. The gather always
ends the feed (in a ``finally``), which is what bounds the consumer's blocking wait.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from dataclasses import dataclass

from tandem.param_sync.bucket import BucketHeader
from tandem.param_sync.errors import GatherError

__all__ = ["BucketFeed"]


@dataclass(slots=True, frozen=True)
class _End:
    error: BaseException | None


class BucketFeed:
    def __init__(self) -> None:
        # Unbounded on purpose: it holds at most one small header per bucket of one transfer.
        self._queue: queue.SimpleQueue[BucketHeader | _End] = queue.SimpleQueue()

    def put(self, header: BucketHeader) -> None:
        self._queue.put(header)

    def close(self) -> None:
        self._queue.put(_End(None))

    def fail(self, error: BaseException) -> None:
        self._queue.put(_End(error))

    def __iter__(self) -> Iterator[BucketHeader]:
        while True:
            item = self._queue.get()
            if isinstance(item, _End):
                if item.error is not None:
                    raise GatherError(f"gathering the weights failed: {item.error}") from item.error
                return
            yield item
