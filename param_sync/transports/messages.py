"""Control messages between a trainer-side transport and a rollout-side serve loop.

A transfer is ``Begin``, one :class:`~param_sync.bucket.BucketHeader` per bucket in order, then
``End`` or ``Abort``; the rollout side answers either with one ``Ack``. ``Close`` ends the
serve loop. ``Begin.transfer`` numbers transfers so a late answer to an earlier one (after a
timeout) is never taken for the current one.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.param_sync.bucket import Manifest
from tandem.param_sync.receiver import LoadReport

__all__ = ["Abort", "Ack", "Begin", "Close", "End"]


@dataclass(slots=True, frozen=True)
class Begin:
    transfer: int
    manifest: Manifest
    segment: str | None  # shared-memory segment holding the stream; None: it arrives inline


@dataclass(slots=True, frozen=True)
class End:
    pass


@dataclass(slots=True, frozen=True)
class Abort:
    reason: str


@dataclass(slots=True, frozen=True)
class Ack:
    transfer: int
    report: LoadReport


@dataclass(slots=True, frozen=True)
class Close:
    pass
