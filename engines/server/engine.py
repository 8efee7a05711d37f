"""The embedded rollout engine as a server drives it: one request at a time, abortable, observable.

What it owns: :class:`ServedEngine`, an :class:`~engines.text.rollout.HFRolloutEngine` that also
- takes requests one by one (:meth:`ServedEngine.submit`) and hands back a :class:`Running`
  handle per request, whose result the HTTP handler awaits;
- aborts requests with their partial output (sglang's ``/abort_request`` and
  ``/pause_generation`` answer an aborted request with the tokens it had so far);
- tells a listener after every decode step that appended tokens to its request (streaming);
- freezes generation in place between two decode steps (``pause_generation`` mode ``in_place``).

It holds the engine's request records (``shared.batching.Call``, ``text.rollout.DecodeRow``):
they are the one place a request's tokens live.

Invariants:
- an abort or a snapshot reads a request's tokens while holding the target's step gate, so it
  never sees a decode step half-way (``response_ids``, ``logprobs`` and ``versions`` always
  agree in length); a request that finished before the abort took the gate keeps its result;
- a request yields exactly one outcome: its finished trajectory, its partial output (aborted),
  or the engine's error.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tandem.core.protocols import GenerationRequest
from tandem.core.records import FinishReason, ResumePolicy, Trajectory
from tandem.core.threadsafe import post_to_loop
from tandem.engines.shared.batching import Call
from tandem.engines.text.rollout import DecodeBatch, DecodeRow, HFRolloutEngine, validate_request
from tandem.param_sync import GateClosedError

__all__ = ["Partial", "Running", "ServedEngine"]


@dataclass(slots=True, frozen=True)
class Partial:
    """A request's tokens at a point in time (its whole output once finished)."""

    response_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    resumed: ResumePolicy | None
    finish_reason: FinishReason | None  # None: still running or aborted


@dataclass(slots=True, eq=False)
class Running:
    """One request in the engine. ``outcome`` resolves to its trajectory, its partial output
    (aborted), or raises the engine's error."""

    request: GenerationRequest
    seq: DecodeRow
    outcome: asyncio.Future[Trajectory | Partial]
    listener: Callable[[], None] | None = None
    aborted: bool = False
    settler: asyncio.Task[None] | None = field(default=None, repr=False)


class ServedEngine(HFRolloutEngine):
    """:class:`HFRolloutEngine` plus per-request handles, aborts, token listeners and an in-place pause."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self._listened: dict[int, tuple[asyncio.AbstractEventLoop, Callable[[], None]]] = {}
        self._listen_lock = threading.Lock()
        self._frozen = False
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def submit(self, request: GenerationRequest, *, listener: Callable[[], None] | None = None) -> Running:
        """Queue one request; ``listener`` (called on this loop) hears of every token it gets."""
        validate_request(request)
        loop = asyncio.get_running_loop()
        call: Call[DecodeRow] = Call(loop, asyncio.Queue())
        seq = self._new_row(request, call)
        call.rows = [seq]
        running = Running(request, seq, loop.create_future(), listener)
        running.settler = loop.create_task(self._settle(running, call))
        if listener is not None:
            with self._listen_lock:
                self._listened[id(seq)] = (loop, listener)
        self._enqueue([seq], "submit()")
        return running

    def cancel(self, running: Running) -> None:
        """Stop working on ``running`` (its client went away); it yields nothing more."""
        running.seq.call.cancel()
        self._forget(running)
        if running.settler is not None:
            running.settler.cancel()
        if not running.outcome.done():
            running.outcome.cancel()

    def snapshot(self, running: Running) -> Partial:
        """The tokens ``running`` has so far. Lock-free: the decode thread only appends, and
        ``versions`` is appended last, so its length bounds what is complete in the others."""
        seq = running.seq
        n = len(seq.versions)
        return Partial(seq.response_ids[:n], seq.logprobs[:n], seq.versions[:n], seq.resumed, None)

    def abort(self, runnings: list[Running]) -> list[Partial | None]:
        """Abort each request between two decode steps; returns its partial output, or None for
        one that had already finished (its result stands). Blocking: call it off the loop."""
        try:
            self.target.gate.hold()
        except GateClosedError:
            return [None] * len(runnings)
        try:
            out: list[Partial | None] = []
            for running in runnings:
                seq = running.seq
                if seq.cancelled or (seq.response_ids and self._finish_reason(seq) is not None):
                    out.append(None)
                    continue
                seq.call.cancel()
                running.aborted = True
                out.append(Partial(list(seq.response_ids), list(seq.logprobs), list(seq.versions), seq.resumed, None))
        finally:
            self.target.gate.release()
        for running, partial in zip(runnings, out, strict=True):
            if partial is not None:
                self._forget(running)
                post_to_loop(running.seq.call.loop, _resolve, running, partial)  # a closed loop awaits nothing
        return out

    def freeze(self) -> None:
        """Hold generation between two decode steps until :meth:`thaw` (blocking)."""
        if not self._frozen:
            self.target.gate.hold()
            self._frozen = True

    def thaw(self) -> None:
        if self._frozen:
            self._frozen = False
            self.target.gate.release()

    @property
    def frozen(self) -> bool:
        return self._frozen

    # ----------------------------------------------------------------------- internals

    async def _settle(self, running: Running, call: Call[DecodeRow]) -> None:
        """Move the engine's one delivery for this request into its outcome future."""
        try:
            item = await call.queue.get()
        except asyncio.CancelledError:
            return
        self._forget(running)
        if running.outcome.done():  # aborted or cancelled first: the late result is dropped
            return
        if isinstance(item, BaseException):
            running.outcome.set_exception(item)
        else:
            running.outcome.set_result(item)

    def _forget(self, running: Running) -> None:
        if running.listener is not None:
            with self._listen_lock:
                self._listened.pop(id(running.seq), None)

    def _append_tokens(self, batch: DecodeBatch, logits: torch.Tensor) -> list[int]:
        keep = super()._append_tokens(batch, logits)
        if self._listened:
            with self._listen_lock:
                heard = [self._listened[id(seq)] for seq in batch.rows if id(seq) in self._listened]
            for loop, listener in heard:
                post_to_loop(loop, listener)  # a closed listener's loop has nobody to tell
        return keep


def _resolve(running: Running, value: Partial) -> None:
    """On the request's loop: the aborted request's outcome is its partial output."""
    if running.settler is not None:
        running.settler.cancel()  # nothing more will be delivered for it
    if not running.outcome.done():
        running.outcome.set_result(value)
