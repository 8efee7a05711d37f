"""The trainer-side dual buffer: two host-memory halves the gathered weights are written into.

The gather writes version ``v`` into the inactive half while receivers may still be reading
the other one; once every byte of ``v`` is written the buffer publishes it, which makes that
half the active one, tagged with ``v``. Where the halves live is the transport's choice
(process memory, pinned memory when a GPU is present, shared memory segments other processes
map), so a receiver on the same machine reads the buffer without a copy.

Invariants:
- the published version only moves forward: a version older than the newest one published is
  rejected before anything is written;
- a half is tagged with a version only once all of that version's bytes are in it.

Who may write when (a half is never written while a transfer still reads it) is the
:class:`~param_sync.syncer.ParamSyncer`'s job, which orders gathers and transfers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from tandem.param_sync.errors import StaleVersionError

__all__ = ["BufferHalf", "DualBuffer", "host_half"]


@dataclass(slots=True, eq=False)
class BufferHalf:
    """One half: its bytes, the shared-memory segment receivers attach to (None: this process
    only), the version it holds (None until published), and how to free it."""

    array: np.ndarray
    segment: str | None = None
    version: int | None = None
    release: Callable[[], None] = field(default=lambda: None, repr=False)


def host_half(nbytes: int) -> BufferHalf:
    """A half in this process's memory, pinned when a GPU is present so device copies run at
    full PCIe speed and can be asynchronous."""
    pinned = torch.cuda.is_available()
    # The numpy view keeps the tensor (and its memory) alive.
    return BufferHalf(torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pinned).numpy())


class DualBuffer:
    """Two equal halves; the inactive one is written, then published as the active one."""

    def __init__(self, halves: tuple[BufferHalf, BufferHalf], *, version: int | None = None) -> None:
        if halves[0].array.size != halves[1].array.size:
            raise ValueError("both halves of a dual buffer must have the same size")
        self._halves = halves
        self._active = 0
        self._version = version

    @property
    def nbytes(self) -> int:
        return int(self._halves[0].array.size)

    @property
    def version(self) -> int | None:
        """The newest published version (None before the first)."""
        return self._version

    @property
    def active(self) -> BufferHalf:
        return self._halves[self._active]

    def inactive(self, version: int) -> BufferHalf:
        """The half to write ``version`` into; rejects a version older than the one held."""
        self._check(version)
        return self._halves[1 - self._active]

    def publish(self, version: int) -> None:
        """Every byte of ``version`` is in the inactive half: make it the active one."""
        self._check(version)
        self._active = 1 - self._active
        self._halves[self._active].version = version
        self._version = version

    def close(self) -> None:
        for half in self._halves:
            # Drop our view first: a shared-memory segment cannot be closed while one exists.
            half.array = np.empty(0, np.uint8)
            half.release()

    def _check(self, version: int) -> None:
        if self._version is not None and version < self._version:
            raise StaleVersionError(f"version {version} is older than version {self._version} in the buffer")
