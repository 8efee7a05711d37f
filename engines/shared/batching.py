"""The one continuous-batching loop the embedded rollout engines run (text decoding, image denoising).

What it owns: :class:`ContinuousBatcher`, the request side and the compute thread of an engine
that serves many concurrent ``generate()`` calls from one running batch. Requests are queued from
any event loop; one compute thread admits waiting rows into the batch between steps, advances the
batch one step (a decode step, a denoising step) under the weight target's step gate, and
delivers each finished trajectory to the loop of the call that asked for it. A workload's engine
says what a row is and what one step does (:meth:`ContinuousBatcher._advance`); the queueing,
admission, cancellation, failure and shutdown rules are here once.

Invariants:
- a row is owned by the compute thread from admission to delivery; callers only flag
  ``cancelled`` (a plain bool: one late step is the worst a race costs);
- a step that raises fails the rows it touched (and those joining), never the engine;
- ``close()`` fails every unfinished row with :class:`EngineClosedError`, and a weight update
  holding the step gate cannot keep it waiting;
- a caller that stops listening (closes its stream) cancels its unfinished rows.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import torch

from tandem.core.records import Trajectory
from tandem.core.threadsafe import post_to_loop
from tandem.engines.shared.threads import ClosesOnAThread, apply_thread_budget
from tandem.param_sync import GateClosedError, ModuleTarget

__all__ = ["BatchRow", "Call", "ContinuousBatcher", "EngineClosedError"]


class EngineClosedError(RuntimeError):
    """The engine was closed before this work could finish."""


class BatchRow(Protocol):
    """A request from submission to delivery, as the loop sees it."""

    call: Call[Any]
    cancelled: bool


RowT = TypeVar("RowT", bound=BatchRow)
RequestT = TypeVar("RequestT")
BatchT = TypeVar("BatchT")


@dataclass(slots=True)
class Call(Generic[RowT]):
    """One ``generate()`` call: the loop and queue its trajectories are delivered to, and its rows."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Trajectory | BaseException]
    rows: list[RowT] = field(default_factory=list)

    def deliver(self, item: Trajectory | BaseException) -> None:
        if not post_to_loop(self.loop, self.queue.put_nowait, item):  # nobody will read the rest
            self.cancel()

    def cancel(self) -> None:
        for row in self.rows:
            row.cancelled = True


class ContinuousBatcher(ClosesOnAThread, Generic[RequestT, RowT, BatchT]):
    """The request side and the compute thread of a continuously batched engine.

    A subclass sets up its model and ``self.target`` and then calls :meth:`_start`; it provides
    :meth:`_validate`, :meth:`_new_row`, :meth:`_empty`, :meth:`_rows` and :meth:`_advance`, and
    may refine :meth:`_take_waiting` (when rows join the batch).
    """

    target: ModuleTarget

    def __init__(self, *, max_batch_size: int, num_threads: int) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self._max_batch_size = max_batch_size
        self._num_threads = num_threads
        # Shared with the compute thread, guarded by _cond.
        self._cond = threading.Condition()
        self._waiting: deque[RowT] = deque()
        self._closing = False
        self._thread: threading.Thread | None = None

    def _start(self, thread_name: str) -> None:
        """Start the compute thread (once the model and ``target`` are ready)."""
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------------------- public API

    def generate(self, requests: Sequence[RequestT]) -> AsyncIterator[Trajectory]:
        """Queue every request now; the returned stream yields trajectories as they finish.

        Closing the stream early (``aclose()``, cancellation) drops its unfinished requests.
        Must be called from a running event loop, which is where the trajectories are delivered.
        """
        for request in requests:
            self._validate(request)
        call: Call[RowT] = Call(asyncio.get_running_loop(), asyncio.Queue())
        call.rows = [self._new_row(request, call) for request in requests]
        self._enqueue(call.rows, "generate()")
        return self._stream(call)

    def close(self) -> None:
        """Stop the compute thread; unfinished requests fail with EngineClosedError. A weight
        update holding the step gate (an aborted ``pause``-mode load) cannot keep it waiting."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self.target.gate.close()
        if self._thread is not None:
            self._thread.join()

    # ----------------------------------------------------------------------- what a workload says

    def _validate(self, request: RequestT) -> None:
        """Raise ``ValueError`` naming the field of a request that cannot be served."""
        raise NotImplementedError

    def _new_row(self, request: RequestT, call: Call[RowT]) -> RowT:
        raise NotImplementedError

    def _empty(self) -> BatchT:
        """The batch with no rows."""
        raise NotImplementedError

    def _rows(self, batch: BatchT) -> list[RowT]:
        """The rows of ``batch``, in order."""
        raise NotImplementedError

    def _advance(self, batch: BatchT, joining: list[RowT]) -> BatchT:
        """Drop cancelled rows, admit ``joining``, take one step and deliver what finished; the
        batch that goes on. Runs on the compute thread under the target's step gate."""
        raise NotImplementedError

    def _take_waiting(self, free: int) -> list[RowT]:
        """Waiting rows to join the batch now (at most ``free``; cancelled ones dropped). Called
        with ``_cond`` held."""
        taken: list[RowT] = []
        while self._waiting and len(taken) < free:
            row = self._waiting.popleft()
            if not row.cancelled:
                taken.append(row)
        return taken

    # ----------------------------------------------------------------------- caller side

    def _enqueue(self, rows: list[RowT], what: str) -> None:
        with self._cond:
            if self._closing:
                raise EngineClosedError(f"{what} on a closed engine")
            self._waiting.extend(rows)
            self._cond.notify()

    async def _stream(self, call: Call[RowT]) -> AsyncIterator[Trajectory]:
        try:
            for _ in range(len(call.rows)):
                item = await call.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            call.cancel()  # a no-op for finished rows; frees the slots of the rest

    # ----------------------------------------------------------------------- compute thread

    def _run(self) -> None:
        apply_thread_budget(self._num_threads)
        batch = self._empty()
        joining: list[RowT] = []
        while True:
            with self._cond:
                while not (self._closing or self._waiting or self._rows(batch)):
                    self._cond.wait()
                if self._closing:
                    break
                joining = self._take_waiting(self._max_batch_size - len(self._rows(batch)))
            try:
                with torch.no_grad(), self.target.decode_step():
                    batch = self._advance(batch, joining)
                joining = []
            except GateClosedError:  # closing while a weight update held the gate
                break
            except Exception as exc:  # a failed step fails the work it touched, not the engine
                for row in self._rows(batch) + joining:
                    row.call.deliver(exc)
                batch, joining = self._empty(), []
        closed = EngineClosedError("engine closed")
        with self._cond:
            leftovers, self._waiting = list(self._waiting), deque()
        for row in self._rows(batch) + joining + leftovers:
            row.call.deliver(closed)
