"""Adapters that make any ``torch.nn.Module`` a sync source (trainer) or target (rollout).

The weights are the module's ``state_dict``: parameters and persistent buffers, each storage
once (a tied weight travels under its first name and lands in every alias on the other side).
A target may instead be given the part of its module that updates carry (a LoRA adapter's
tensors): updates then name exactly those, and the rest of the module is never written.

:class:`StepGate` is the decode-step boundary. The generator runs each decode step inside
``target.decode_step()``; the target changes weights only while it holds the gate, which it
takes between two steps. So a decode step never sees two versions, and a generator waits
for at most the time the gate is held: the whole copy in ``pause`` mode, the pointer swap in
``swap`` mode (the update itself waits for the running step to finish, the generator does not).

Invariants of :class:`ModuleTarget`:
- ``loaded_version`` only moves forward and names the weights every decode step since the last
  commit has seen;
- ``swap`` mode keeps a second, idle copy of every weight; updates are written only there and
  become live by swapping each tensor's storage (``tensor.data``) under the gate, so an aborted
  update never touches the live weights. The generator must read the weights through the
  module on every step (a CUDA graph or compiled kernel that captured data pointers would
  keep the old ones: use ``pause`` mode there);
- ``swap`` mode on host weights may instead *map* an update (:meth:`ModuleTarget.map_update`):
  the idle set is then the transport's buffer half itself, so nothing is copied on this side
  and the commit repoints each weight into that half. While it serves from a half the target
  holds no weight memory of its own; the sender must not write that half until the target
  has moved on, which it guarantees by writing a half only after the previous transfer ended
  and by having the target :meth:`~ModuleTarget.detach` (copy its live weights out) whenever an
  update is aborted, as the half it serves from is then the next one to be written;
- ``pause`` mode copies into the live weights while holding the gate; an update aborted after
  its first copy keeps generation paused (a half-loaded model never serves) until the next
  update commits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager

import numpy as np
import torch
from torch import nn

from tandem.param_sync.bucket import Manifest, TensorSlice
from tandem.param_sync.errors import GateClosedError, LayoutError, StaleVersionError, SyncError
from tandem.param_sync.protocols import LoadMode

__all__ = ["ModuleSource", "ModuleTarget", "StepGate", "unique_weights"]


def unique_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """A module's weights for syncing: its ``state_dict`` (parameters and persistent buffers)
    with each storage once, first name wins, detached (views of the live storage).

    A tied weight (embeddings shared with the LM head) travels under its first name and, loaded
    there, is seen through every alias. The one rule trainer sources and rollout targets share.
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out[name] = tensor.detach()
    return out


class ModuleSource:
    """A :class:`~param_sync.protocols.SyncSource` over a module that holds full tensors."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def named_tensors_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from unique_weights(self.module).items()


class StepGate:
    """Decode steps and weight changes exclude each other; a waiting weight change goes first.

    Waits need no timeout of their own: ``hold`` waits for at most the running decode steps,
    ``step`` for at most one hold, and ``close`` ends every wait (an aborted ``pause``-mode
    update keeps the gate held until the next commit, which a stopping engine cannot wait for).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._steps = 0  # decode steps running now
        self._held = False
        self._waiting = 0  # holds waiting for the running steps to end; they block new steps
        self._closed = False

    def close(self) -> None:
        """Refuse new steps and holds from now on, waking every wait with :class:`GateClosedError`."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @contextmanager
    def step(self) -> Iterator[None]:
        """Run one decode step; waits while weights are being changed."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or (not self._held and not self._waiting))
            if self._closed:
                raise GateClosedError("the step gate is closed")
            self._steps += 1
        try:
            yield
        finally:
            with self._cond:
                self._steps -= 1
                self._cond.notify_all()

    def hold(self) -> None:
        """Wait for the running decode steps to end and keep new ones from starting."""
        with self._cond:
            self._waiting += 1
            try:
                self._cond.wait_for(lambda: self._closed or (not self._steps and not self._held))
            finally:
                self._waiting -= 1
            if self._closed:
                raise GateClosedError("the step gate is closed")
            self._held = True

    def release(self) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()

    @property
    def held(self) -> bool:
        return self._held

    @property
    def waiting_holds(self) -> int:
        """Holds queued behind the running decode steps (the next step waits for them)."""
        return self._waiting


class ModuleTarget:
    """A :class:`~param_sync.protocols.SyncTarget` that loads into a module's own tensors:
    ``weights`` (live tensors of ``module`` by the names updates use; default its whole
    ``state_dict``), which every update must name exactly."""

    def __init__(
        self, module: nn.Module, *, load_mode: LoadMode = "swap", version: int = 0,
        weights: Mapping[str, torch.Tensor] | None = None,
    ) -> None:  # fmt: skip
        if load_mode not in ("pause", "swap"):
            raise ValueError(f"load_mode must be 'pause' or 'swap', got {load_mode!r}")
        self.module = module
        self.gate = StepGate()
        self._mode: LoadMode = load_mode
        self._version = version
        # Every name (tied aliases included) -> the live tensor object; its .data may be swapped.
        self._by_name: dict[str, torch.Tensor] = dict(module.state_dict(keep_vars=True) if weights is None else weights)
        # Each distinct tensor -> its first name (built in reverse so the first name wins).
        self._first_name = {id(t): name for name, t in reversed(list(self._by_name.items()))}
        for name, tensor in self._by_name.items():
            if not tensor.is_contiguous():
                raise ValueError(f"weight {name!r} is not contiguous; it cannot be loaded as raw bytes")
        # A copy, not empty_like: its pages are touched now rather than faulted in (slowly) by
        # the first update. Empty while the live weights are mapped (see map_update).
        self._idle: dict[int, torch.Tensor] = self._copies() if load_mode == "swap" else {}
        self._mapped = False  # the live weights are views of a transport's buffer half
        self._mapped_update = False  # the update in progress was begun by map_update
        self._pending: int | None = None  # version of the update in progress
        # name -> uint8 view of the tensor being loaded: a numpy view when it is in host memory,
        # as numpy's copy costs less per call than torch's and loads come in cache-sized pieces.
        self._dst: dict[str, np.ndarray | torch.Tensor] = {}
        self._held_at = 0.0
        self._dirty = False  # pause mode: live weights partly overwritten by an unfinished update

    @property
    def load_mode(self) -> LoadMode:
        return self._mode

    @property
    def loaded_version(self) -> int:
        return self._version

    @property
    def can_map(self) -> bool:
        """Whether :meth:`map_update` applies: ``swap`` mode with every weight in host memory."""
        return self._mode == "swap" and all(t.device.type == "cpu" for t in self._by_name.values())

    def decode_step(self) -> AbstractContextManager[None]:
        """Wrap each decode step in this: weights never change inside it."""
        return self.gate.step()

    def begin_update(self, manifest: Manifest) -> None:
        live = self._check_update(manifest)
        if self._mode == "swap" and not self._idle:
            self._idle = self._copies()  # the last update was mapped: the idle set went with it
        dst: dict[str, np.ndarray | torch.Tensor] = {}
        for meta in manifest.tensors:
            tensor = live[meta.name]
            into = self._idle[id(tensor)] if self._mode == "swap" else tensor.detach()
            flat = into.reshape(-1).view(torch.uint8)
            dst[meta.name] = flat.numpy() if flat.device.type == "cpu" else flat
        if self._mode == "swap":
            self._wait_for_device()  # the idle set was live until the last swap
        elif not self.gate.held:  # held already if an aborted update left the weights dirty
            self.gate.hold()
            self._held_at = time.perf_counter()
        self._dst, self._pending = dst, manifest.version

    def map_update(self, manifest: Manifest, stream: np.ndarray) -> None:
        """Begin an update whose weights are ``stream``'s bytes where they lie: no
        ``load_bucket`` calls follow, and the commit serves straight from ``stream``.

        ``stream`` must stay unwritten from now until this target has committed a later update
        or has been detached; the caller checks its bytes before committing.
        """
        if not self.can_map:
            raise SyncError("map_update needs swap mode and weights in host memory")
        live = self._check_update(manifest)
        flat = torch.from_numpy(stream)
        views: dict[int, torch.Tensor] = {}
        for meta in manifest.tensors:
            tensor = live[meta.name]
            raw = flat[meta.offset : meta.offset + meta.nbytes]
            views[id(tensor)] = raw.view(tensor.dtype).view(tensor.shape)
        self._idle, self._pending = views, manifest.version
        self._mapped_update = True

    def detach(self) -> None:
        """Serve from weights of this target's own again: copy the live weights out of the
        transport's buffer they are mapped from (generation keeps running during the copy and
        stalls only for the repointing). A no-op unless the live weights are mapped."""
        if not self._mapped:
            return
        copies = self._copies()
        with self._held():
            for tid, copy in copies.items():
                self._by_name[self._first_name[tid]].data = copy
            self._mapped = False

    def load_bucket(self, slices: Sequence[TensorSlice]) -> None:
        if self._pending is None:
            raise SyncError("load_bucket outside an update")
        if self._mode == "pause":
            self._dirty = True
        for piece in slices:
            into = self._dst[piece.name][piece.start : piece.start + piece.data.size]
            if isinstance(into, np.ndarray):
                np.copyto(into, piece.data)
            else:
                into.copy_(torch.from_numpy(piece.data))

    def commit(self, version: int) -> float:
        if self._pending != version:
            raise SyncError(f"commit of version {version}, but the update in progress is {self._pending}")
        if self._mode == "swap":
            self.gate.hold()
            self._held_at = time.perf_counter()
            for tid, idle in self._idle.items():
                live = self._by_name[self._first_name[tid]]
                self._idle[tid], live.data = live.data, idle
            if self._mapped_update:
                # What served until now is either a half the sender will write next or memory
                # of our own that mapping makes redundant: keep neither.
                self._idle, self._mapped = {}, True
        self._version = version
        self._pending, self._dst, self._dirty, self._mapped_update = None, {}, False, False
        held_s = time.perf_counter() - self._held_at
        self.gate.release()
        return held_s

    def abort(self) -> None:
        if self._mapped_update:
            self._idle = {}  # views of the half being abandoned, never served
        self._pending, self._dst, self._mapped_update = None, {}, False
        if self._mode == "pause" and not self._dirty:
            self.gate.release()
        # An aborted transfer was written into the other half; the next one goes into the half
        # the live weights may be mapped from.
        self.detach()

    def _check_update(self, manifest: Manifest) -> dict[str, torch.Tensor]:
        """The live tensor each of ``manifest``'s names loads into, once the manifest is known
        to name every weight exactly once with its dtype and shape, and to move forward."""
        if self._pending is not None:
            raise SyncError(f"update to version {self._pending} is still in progress")
        if manifest.version < self._version:
            raise StaleVersionError(f"version {manifest.version} is older than loaded version {self._version}")
        live: dict[str, torch.Tensor] = {}
        covered: dict[int, str] = {}
        for meta in manifest.tensors:
            tensor = self._by_name.get(meta.name)
            if tensor is None:
                raise LayoutError(f"the rollout module has no weight {meta.name!r}")
            meta.check_lands_in(tensor)
            if id(tensor) in covered:
                raise LayoutError(f"{meta.name!r} and {covered[id(tensor)]!r} share one tensor here but were sent apart")
            covered[id(tensor)] = meta.name
            live[meta.name] = tensor
        missing = [name for tid, name in self._first_name.items() if tid not in covered]
        if missing:
            raise LayoutError(f"the transfer leaves {len(missing)} weights unset, e.g. {missing[:3]}")
        return live

    def _copies(self) -> dict[int, torch.Tensor]:
        """A private copy of every distinct live weight."""
        return {tid: self._by_name[name].detach().clone() for tid, name in self._first_name.items()}

    @contextmanager
    def _held(self) -> Iterator[None]:
        """Hold the gate (unless an unfinished pause-mode update holds it already)."""
        if self.gate.held:
            yield
            return
        self.gate.hold()
        try:
            yield
        finally:
            self.gate.release()

    def _wait_for_device(self) -> None:
        devices = {t.device for t in self._idle.values() if t.device.type == "cuda"}
        for device in devices:
            torch.cuda.synchronize(device)
