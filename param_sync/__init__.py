"""Weight sync from the trainer to the rollout engines without stopping generation.

gather (:class:`SyncSource`) -> bucketize (:class:`Manifest`, :class:`BucketHeader`) ->
:class:`DualBuffer` -> :class:`Transport` -> :class:`Receiver` -> load (:class:`SyncTarget`),
driven by :class:`ParamSyncer`, which is the flow's ``WeightSync``.

What it may import: ``core`` (the protocols), torch and numpy; never ``engines``,
``state_machines``, ``tasks`` or ``pipeline`` (engines adapt themselves to its protocols).
"""

from __future__ import annotations

from tandem.param_sync.bucket import BucketHeader, Manifest, TensorMeta, TensorSlice, checksum
from tandem.param_sync.buffer import BufferHalf, DualBuffer
from tandem.param_sync.errors import GateClosedError, GatherError, LayoutError, StaleVersionError, SyncError, TransferError
from tandem.param_sync.module import ModuleSource, ModuleTarget, StepGate, unique_weights
from tandem.param_sync.protocols import LoadMode, MappableTarget, SyncSource, SyncTarget, Transport
from tandem.param_sync.receiver import LoadReport, Receiver
from tandem.param_sync.syncer import ParamSyncer
from tandem.param_sync.transports import DistTransport, InProcessTransport, ShmTransport, serve_dist, serve_shm

__all__ = [
    "BucketHeader",
    "BufferHalf",
    "DistTransport",
    "DualBuffer",
    "GateClosedError",
    "GatherError",
    "InProcessTransport",
    "LayoutError",
    "LoadMode",
    "LoadReport",
    "Manifest",
    "MappableTarget",
    "ModuleSource",
    "ModuleTarget",
    "ParamSyncer",
    "Receiver",
    "ShmTransport",
    "StaleVersionError",
    "StepGate",
    "SyncError",
    "SyncSource",
    "SyncTarget",
    "TensorMeta",
    "TensorSlice",
    "TransferError",
    "Transport",
    "checksum",
    "serve_dist",
    "serve_shm",
    "unique_weights",
]
