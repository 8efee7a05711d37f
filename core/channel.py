"""Bounded, typed channels between state machines, after trio's memory channels.

A channel has a send end and a receive end. Capacity is the backpressure: ``send`` waits while
the buffer is full, so no stage ever buffers without limit. Closing the send end is a clean
end-of-stream: receivers drain what is buffered and then see :class:`EndOfStream`. Aborting
(``abort(exc)``) breaks the channel instead: waiters on either end get :class:`BrokenChannel`.

Invariants:
- ``0 <= depth <= capacity`` at every instant (``statistics().max_depth`` records the peak);
- items come out in the order they went in, each exactly once;
- a closed or broken channel refuses sends with an error naming the channel.

Written here rather than using ``asyncio.Queue`` because the queue has no close semantics, no
batch receive with a linger timeout, and no wait-time statistics; all three are what the
flow needs.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

__all__ = [
    "BrokenChannel",
    "ChannelClosed",
    "ChannelStatistics",
    "EndOfStream",
    "ReceiveChannel",
    "SendChannel",
    "open_channel",
]


class EndOfStream(Exception):
    """The send end was closed and every buffered item has been received."""


class ChannelClosed(RuntimeError):
    """A send was attempted on a channel whose send end is closed."""


class BrokenChannel(RuntimeError):
    """The channel was aborted because a stage failed; the cause is chained."""


@dataclass(slots=True, frozen=True)
class ChannelStatistics:
    """A snapshot of one channel, for gauges and tests."""

    name: str
    capacity: int
    depth: int
    max_depth: int
    waiting_senders: int
    waiting_receivers: int
    items_sent: int
    items_received: int
    send_wait_s: float
    receive_wait_s: float
    closed: bool


class _State(Generic[T]):
    """Shared state of one channel. Waiters are futures, woken in FIFO order."""

    __slots__ = (
        "broken",
        "buffer",
        "capacity",
        "closed",
        "items_received",
        "items_sent",
        "max_depth",
        "name",
        "receive_wait_s",
        "receivers",
        "send_wait_s",
        "senders",
    )

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self.buffer: deque[T] = deque()
        self.closed = False
        self.broken: BaseException | None = None
        self.senders: deque[asyncio.Future[None]] = deque()
        self.receivers: deque[asyncio.Future[None]] = deque()
        self.max_depth = 0
        self.items_sent = 0
        self.items_received = 0
        self.send_wait_s = 0.0
        self.receive_wait_s = 0.0

    def wake_one(self, waiters: deque[asyncio.Future[None]]) -> None:
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    def wake_all(self) -> None:
        for waiters in (self.senders, self.receivers):
            while waiters:
                fut = waiters.popleft()
                if not fut.done():
                    fut.set_result(None)

    def append(self, item: T) -> None:
        """Buffer one item (the caller checked there is room) and wake one receiver."""
        self.buffer.append(item)
        self.items_sent += 1
        if len(self.buffer) > self.max_depth:
            self.max_depth = len(self.buffer)
        self.wake_one(self.receivers)

    def check_not_broken(self) -> None:
        if self.broken is not None:
            raise BrokenChannel(f"channel {self.name!r} is broken: {self.broken!r}") from self.broken

    async def wait(self, waiters: deque[asyncio.Future[None]], timeout: float | None = None) -> bool:
        """Park until woken; False if ``timeout`` passed first. Wait time is accounted."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        waiters.append(fut)
        started = loop.time()
        try:
            if timeout is None:
                await fut
                return True
            try:
                await asyncio.wait_for(fut, timeout)
                return True
            except TimeoutError:
                return False
        except asyncio.CancelledError:
            # A wake-up given to a cancelled waiter must pass on, or another waiter starves.
            if fut.done() and not fut.cancelled():
                self.wake_one(waiters)
            raise
        finally:
            elapsed = loop.time() - started
            if waiters is self.senders:
                self.send_wait_s += elapsed
            else:
                self.receive_wait_s += elapsed


class SendChannel(Generic[T]):
    """The producing end. Exactly one owner closes it when production ends."""

    __slots__ = ("_s",)

    def __init__(self, state: _State[T]) -> None:
        self._s = state

    @property
    def name(self) -> str:
        return self._s.name

    async def send(self, item: T) -> None:
        """Put one item, waiting while the channel is full."""
        s = self._s
        while True:
            s.check_not_broken()
            if s.closed:
                raise ChannelClosed(f"send on closed channel {s.name!r}")
            if len(s.buffer) < s.capacity:
                break
            await s.wait(s.senders)
        s.append(item)

    def try_send(self, item: T) -> bool:
        """Put one item if there is room now (True), without waiting; False if the channel is
        full. Raises as ``send`` does on a closed or broken channel."""
        s = self._s
        s.check_not_broken()
        if s.closed:
            raise ChannelClosed(f"send on closed channel {s.name!r}")
        if len(s.buffer) >= s.capacity:
            return False
        s.append(item)
        return True

    async def send_many(self, items: Iterable[T]) -> None:
        """Put items in order; each waits for room as ``send`` does, so capacity still holds."""
        s = self._s
        for item in items:
            if len(s.buffer) < s.capacity and not s.closed and s.broken is None:
                s.append(item)  # fast path: room now, no suspension needed
            else:
                await self.send(item)

    def close(self) -> None:
        """End the stream: receivers drain the buffer and then see ``EndOfStream``."""
        self._s.closed = True
        self._s.wake_all()

    def abort(self, exc: BaseException) -> None:
        """Break the channel: every waiter on either end gets ``BrokenChannel``."""
        self._s.broken = exc
        self._s.wake_all()

    def statistics(self) -> ChannelStatistics:
        return _statistics(self._s)


class ReceiveChannel(Generic[T]):
    """The consuming end."""

    __slots__ = ("_s",)

    def __init__(self, state: _State[T]) -> None:
        self._s = state

    @property
    def name(self) -> str:
        return self._s.name

    def _take(self, n: int, out: list[T]) -> None:
        s = self._s
        while s.buffer and len(out) < n:
            out.append(s.buffer.popleft())
            s.items_received += 1
            s.wake_one(s.senders)

    async def receive(self) -> T:
        """Take one item, waiting while the channel is empty."""
        batch = await self.receive_batch(1)
        return batch[0]

    async def receive_batch(self, max_items: int, linger_s: float = 0.0) -> list[T]:
        """Take between 1 and ``max_items`` items.

        Waits (without limit) for the first item, then up to ``linger_s`` more seconds for the
        batch to fill. Returns early when full or when the stream ends with a partial batch.
        Raises ``EndOfStream`` only when the channel is closed and empty.
        """
        s = self._s
        out: list[T] = []
        while not s.buffer:
            s.check_not_broken()
            if s.closed:
                raise EndOfStream(s.name)
            await s.wait(s.receivers)
        s.check_not_broken()
        self._take(max_items, out)
        if len(out) < max_items and linger_s > 0:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + linger_s
            while len(out) < max_items and not s.closed:
                remaining = deadline - loop.time()
                if remaining <= 0 or not await s.wait(s.receivers, remaining):
                    break
                s.check_not_broken()
                self._take(max_items, out)
            self._take(max_items, out)
        if s.buffer:
            # Items remain after this receiver filled up: pass the wake-up on.
            s.wake_one(s.receivers)
        return out

    def statistics(self) -> ChannelStatistics:
        return _statistics(self._s)

    def __aiter__(self) -> ReceiveChannel[T]:
        return self

    async def __anext__(self) -> T:
        try:
            return await self.receive()
        except EndOfStream:
            raise StopAsyncIteration from None


def _statistics(s: _State[T]) -> ChannelStatistics:
    return ChannelStatistics(
        name=s.name,
        capacity=s.capacity,
        depth=len(s.buffer),
        max_depth=s.max_depth,
        waiting_senders=sum(1 for f in s.senders if not f.done()),
        waiting_receivers=sum(1 for f in s.receivers if not f.done()),
        items_sent=s.items_sent,
        items_received=s.items_received,
        send_wait_s=s.send_wait_s,
        receive_wait_s=s.receive_wait_s,
        closed=s.closed,
    )


def open_channel(name: str, capacity: int) -> tuple[SendChannel[T], ReceiveChannel[T]]:
    """Create a bounded channel; ``capacity`` must be at least 1."""
    if capacity < 1:
        raise ValueError(f"channel {name!r}: capacity must be >= 1, got {capacity}")
    state: _State[T] = _State(name, capacity)
    return SendChannel(state), ReceiveChannel(state)
