"""Transports: how a transfer gets from the trainer's buffer to the rollout engines.

Each implements :class:`~param_sync.protocols.Transport` on the trainer side; the rollout side
of the multi-process ones is a serve loop (:func:`serve_shm`, :func:`serve_dist`) around a
:class:`~param_sync.receiver.Receiver`.
"""

from __future__ import annotations

from tandem.param_sync.transports.dist import DistTransport, serve_dist
from tandem.param_sync.transports.inprocess import InProcessTransport
from tandem.param_sync.transports.shm import ShmTransport, serve_shm

__all__ = ["DistTransport", "InProcessTransport", "ShmTransport", "serve_dist", "serve_shm"]
