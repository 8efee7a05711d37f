"""Weight sync between the embedded torch engines: ``TorchTrainEngine`` -> param_sync -> ``HFRolloutEngine``.

What it owns: the trainer-side :class:`~param_sync.SyncSource` (:class:`TrainerSyncSource`)
and the flow's ``WeightSync`` (:class:`TorchWeightSync`), which drives a
:class:`~param_sync.ParamSyncer` on an event loop of its own. The rollout side is
the rollout engine's own ``target`` (a :class:`~param_sync.ModuleTarget`).

Invariants:
- a gather never sees a torn optimizer step: it reads the trainer's live weights while holding
  the trainer's weights lock (``TorchTrainEngine.weights_for_sync``), which the optimizer step
  also takes; training waits at its next step for at most one gather (a copy into the buffer,
  not the transfer or the load);
- the version a sync reports is exactly the one its weights belong to: each sync labels the
  transfer with the trainer's version read just before, and the gather checks under the lock
  that the trainer is still there; if a step landed in between, the gather fails before a
  byte is loaded (:class:`TrainerMovedOnError`) and the sync starts over at the new version;
- syncs through one :class:`TorchWeightSync` run one at a time, in call order, each to its
  end even when its caller is cancelled (so the engines stay consistent);
- ``close()`` is synchronous and may be called from any thread, with or without a running
  event loop: it waits for the sync in flight, then frees the buffer and the loop thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Protocol

import torch

from tandem.core.protocols import SyncReport
from tandem.param_sync import GatherError, InProcessTransport, ModuleTarget, ParamSyncer, Receiver, Transport

__all__ = [
    "LoadsWeights",
    "SyncedTrainer",
    "TorchWeightSync",
    "TrainerMovedOnError",
    "TrainerSyncSource",
    "in_process_transport",
]


class SyncedTrainer(Protocol):
    """What a sync reads of a trainer (``TorchTrainEngine``, the diffusion trainer, a trainer
    group, a Ray actor's staged weights): its version, and its weights under the lock that keeps
    them and their version together."""

    @property
    def version(self) -> int: ...

    def weights_for_sync(self) -> AbstractContextManager[tuple[int, Mapping[str, torch.Tensor]]]: ...


class LoadsWeights(Protocol):
    """A rollout engine in this process, loading through a ``param_sync.ModuleTarget``."""

    @property
    def target(self) -> ModuleTarget: ...


class TrainerMovedOnError(GatherError):
    """The trainer stepped past the version a gather was labelled with before the gather began."""


class TrainerSyncSource:
    """The trainer's weights as a :class:`~param_sync.SyncSource`, read under its weights lock."""

    def __init__(self, trainer: SyncedTrainer) -> None:
        self.trainer = trainer
        self._expected: int | None = None

    def expect(self, version: int) -> None:
        """Gathers from now on must find the trainer at ``version`` (the transfer's label)."""
        self._expected = version

    def named_tensors_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        # The lock is held until the walk ends or the generator is dropped (ParamSyncer walks it
        # to the end or raises out of the loop, which closes it and so releases the lock).
        with self.trainer.weights_for_sync() as (version, weights):
            if self._expected is not None and version != self._expected:
                raise TrainerMovedOnError(f"the trainer reached version {version} before version {self._expected} was gathered")
            yield from weights.items()


class TorchWeightSync:
    """``core.protocols.WeightSync`` over a :class:`~param_sync.ParamSyncer` whose source is
    a :class:`TrainerSyncSource`. Loads the trainer's version at the time of the sync, which
    may be newer than the one asked for, and reports it.

    Why an event loop of its own (one idle thread): the syncer's asyncio locks and tasks then
    live on one loop for the syncer's whole life, whichever loops call ``sync``, and ``close``
    can wait for a sync in flight from plain synchronous code (the components' close callbacks).
    """

    def __init__(self, source: TrainerSyncSource, syncer: ParamSyncer) -> None:
        if syncer.source is not source:
            raise ValueError("the syncer must gather from the given TrainerSyncSource")
        self._source = source
        self._syncer = syncer
        self._serial = asyncio.Lock()  # used on the private loop only
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="param-sync-loop", daemon=True)
        self._thread.start()

    @classmethod
    def through(cls, trainer: SyncedTrainer, transport: Transport, *, produce_bucket_mb: float) -> TorchWeightSync:
        """The trainer's weights gathered into its dual buffer and sent through ``transport``."""
        source = TrainerSyncSource(trainer)
        return cls(source, ParamSyncer(source, transport, produce_bucket_mb=produce_bucket_mb))

    @classmethod
    def in_process(
        cls,
        trainer: SyncedTrainer,
        rollout: LoadsWeights,
        *,
        produce_bucket_mb: float,
        consume_bucket_mb: float,
    ) -> TorchWeightSync:
        """Trainer and rollout engine in this process: the rollout reads the trainer's buffer (in
        ``swap`` mode it serves straight from it)."""
        return cls.through(trainer, in_process_transport(rollout, consume_bucket_mb), produce_bucket_mb=produce_bucket_mb)

    async def sync(self, version: int) -> SyncReport:
        """Load the trainer's current version (at least ``version``) into the rollout engines.

        Raises ``ValueError`` if the trainer is behind ``version``, a ``param_sync.SyncError``
        (old weights keep serving) if the transfer fails.
        """
        if self._closed:
            raise RuntimeError("sync() on a closed TorchWeightSync")
        future = asyncio.run_coroutine_threadsafe(self._sync(version), self._loop)
        # Shielded: a cancelled caller stops waiting, the sync still runs to its end.
        return await asyncio.shield(asyncio.wrap_future(future))

    def close(self) -> None:
        """Wait for the sync in flight, free the buffer, stop the loop thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    async def _close(self) -> None:
        async with self._serial:  # after every sync already called
            await self._syncer.aclose()

    async def _sync(self, asked: int) -> SyncReport:
        async with self._serial:
            retries = 0
            while True:
                version = self._source.trainer.version
                if version < asked:
                    raise ValueError(f"asked to sync version {asked}, but the trainer is at version {version}")
                self._source.expect(version)
                try:
                    metrics = await self._syncer.sync(version)
                except TrainerMovedOnError:
                    # A step landed between reading the version and the gather: nothing was
                    # loaded. Each retry is a newer version, so this ends with training.
                    retries += 1
                    continue
                return SyncReport(version, {**metrics, "gather_retries": float(retries)})


def in_process_transport(rollout: LoadsWeights, consume_bucket_mb: float) -> InProcessTransport:
    """A transport that loads straight into ``rollout``'s target, in this process."""
    return InProcessTransport([Receiver(rollout.target, consume_bucket_mb=consume_bucket_mb)])
