"""Pushing given weights into a rollout engine through the real sync path (as a sync would)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator, Mapping

import torch

from tandem.param_sync import InProcessTransport, ModuleTarget, ParamSyncer, Receiver


class TensorSource:
    """A sync source over fixed tensors (a snapshot of some weights)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def named_tensors_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.tensors.items()


async def push(target: ModuleTarget, tensors: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
    """Load ``tensors`` into ``target`` as ``version``: gather, checksummed buckets, receiver,
    commit between two decode steps. Raises the sync's error (the old weights keep serving)."""
    syncer = ParamSyncer(TensorSource(tensors), InProcessTransport([Receiver(target)]), produce_bucket_mb=0.5)
    try:
        return await syncer.sync(version)
    finally:
        await syncer.aclose()  # the target copies its weights out of the buffer it served from


def push_from_inside_a_step(target: ModuleTarget, tensors: Mapping[str, torch.Tensor], version: int) -> threading.Thread:
    """Called from inside a decode step (a forward hook): start pushing ``tensors`` and return
    once the commit waits for this step to end, so the new version serves from the next step."""
    done = threading.Thread(target=lambda: asyncio.run(push(target, tensors, version)), name="push")
    done.start()
    deadline = time.monotonic() + 30
    while target.gate.waiting_holds == 0:  # the commit queues behind the step this call is in
        assert done.is_alive() and time.monotonic() < deadline, "the push never reached its commit"
        time.sleep(0.001)
    return done
