"""Why a weight sync failed.

Every failure here leaves the rollout engines serving the weights they had before the sync
began (never a mix of two versions); the next sync starts from scratch and may succeed.
"""

from __future__ import annotations

__all__ = ["GateClosedError", "GatherError", "LayoutError", "StaleVersionError", "SyncError", "TransferError"]


class SyncError(RuntimeError):
    """A sync did not complete; the old weights keep serving."""


class StaleVersionError(SyncError):
    """The version is older than one already held: versions only move forward."""


class LayoutError(SyncError):
    """Names, dtypes or shapes of the sent weights do not match what the receiver holds."""


class TransferError(SyncError):
    """A transfer was incomplete, out of order or corrupt, or a receiver did not answer."""


class GatherError(SyncError):
    """Reading the trainer's weights failed midway; the partial transfer was aborted."""


class GateClosedError(SyncError):
    """The step gate was closed (its engine is stopping): no decode step or weight change may start."""
