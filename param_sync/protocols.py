"""The seams of weight sync: where the trainer's weights come from, where they go, and the wire.

- :class:`SyncSource` (trainer side): yields full weights one at a time (gather).
- :class:`SyncTarget` (rollout side): takes an update in pieces and applies it atomically.
- :class:`Transport`: owns the buffer halves' memory and moves buckets from the trainer's
  buffer to every :class:`~param_sync.receiver.Receiver`.

:class:`~param_sync.module.ModuleSource` and :class:`~param_sync.module.ModuleTarget` adapt any
``torch.nn.Module``; real engines implement the same methods.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

import numpy as np
import torch

from tandem.param_sync.bucket import BucketHeader, Manifest, TensorSlice

if TYPE_CHECKING:
    from tandem.param_sync.buffer import BufferHalf
    from tandem.param_sync.receiver import LoadReport

__all__ = ["LoadMode", "MappableTarget", "SyncSource", "SyncTarget", "Transport"]

# pause: generation pauses between two decode steps, the weights are copied in place, it resumes.
# swap: the engine keeps a second weight set, loads into it while generating from the first,
#       and swaps the two between decode steps.
LoadMode = Literal["pause", "swap"]


@runtime_checkable
class SyncSource(Protocol):
    """The trainer's side of a sync."""

    def named_tensors_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield every weight as a full (unsharded) tensor, one at a time, in the same order on
        every call; yield a tied weight once. The caller may still be copying a tensor after
        asking for the next (it holds a reference, so a sharded engine may gather one tensor,
        yield it and drop it, but must not reuse its storage within the walk), and finishes
        every copy before the walk ends, so a source may hold its weights still (a lock) from
        the first tensor until it returns or is closed."""
        ...


@runtime_checkable
class SyncTarget(Protocol):
    """The rollout engine's side of a sync. Calls come from one thread, in the order
    ``begin_update``, ``load_bucket``\\*, then ``commit`` or ``abort``.

    Invariant: between two decode steps the engine serves exactly one version; a failed or
    aborted update leaves the previous weights serving.
    """

    @property
    def load_mode(self) -> LoadMode: ...

    @property
    def loaded_version(self) -> int:
        """The version serving new tokens."""
        ...

    def begin_update(self, manifest: Manifest) -> None:
        """Check that ``manifest`` names exactly this engine's weights with their dtypes and shapes
        (raise :class:`~param_sync.errors.LayoutError` otherwise) and that its version is not
        older than ``loaded_version`` (raise :class:`~param_sync.errors.StaleVersionError`).
        In ``pause`` mode, pause generation after the current decode step; it stays paused
        until ``commit`` or ``abort``. The receiver calls this in ``pause`` mode only once the
        whole transfer is verified."""
        ...

    def load_bucket(self, slices: Sequence[TensorSlice]) -> None:
        """Copy these byte ranges into the weights being loaded (the live ones in ``pause`` mode,
        the idle set in ``swap`` mode). The slices' arrays are only valid during the call."""
        ...

    def commit(self, version: int) -> float:
        """Serve ``version`` from the next decode step on (``swap``: swap the weight sets between
        two decode steps; ``pause``: resume). Returns the seconds generation was held."""
        ...

    def abort(self) -> None:
        """Drop the update; the previous weights keep serving."""
        ...


@runtime_checkable
class MappableTarget(SyncTarget, Protocol):
    """A target that can serve an update straight from the transport's buffer half, so the
    rollout side copies nothing (the receiver still checks every bucket before the commit).

    The half must then stay unwritten for as long as the target serves from it. Senders keep
    that promise by writing a half only after the previous transfer has ended; targets keep
    theirs by detaching on every abort (the aborted transfer used the other half, so the half
    they serve from is the next to be written) and when the transport closes.
    """

    @property
    def can_map(self) -> bool:
        """Whether ``map_update`` applies now (``swap`` mode, weights in host memory)."""
        ...

    def map_update(self, manifest: Manifest, stream: np.ndarray) -> None:
        """Like ``begin_update``, but the update's weights are ``stream``'s bytes where they lie;
        no ``load_bucket`` calls follow."""
        ...

    def detach(self) -> None:
        """Copy the live weights out of a transport's buffer into memory of the target's own."""
        ...


@runtime_checkable
class Transport(Protocol):
    """Moves a transfer from the trainer's buffer to every receiver."""

    def allocate(self, nbytes: int) -> BufferHalf:
        """One half of the dual buffer, in memory this transport's receivers can reach."""
        ...

    def send(self, manifest: Manifest, half: BufferHalf, buckets: Iterable[BucketHeader]) -> list[LoadReport]:
        """Deliver ``manifest``, then each bucket of ``half`` as its header arrives from ``buckets``
        (the gather may still be writing later buckets), then collect one report per receiver.
        If ``buckets`` raises, tell every receiver to abort, collect their reports, and re-raise.
        Blocking: runs in a worker thread, never on the event loop."""
        ...

    def close(self) -> None:
        """Tell the receivers to stop serving and free this transport's resources."""
        ...
