"""Shared-memory transport between this process (trainer) and a spawned rollout process."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
from param_sync_models import (
    FaultyTransport,
    FlakySource,
    Net,
    _broken_then_good,
    fill_random,
    raw_state,
    shm_rollout_worker,
)

from tandem.param_sync import ModuleSource, ModuleTarget, ParamSyncer, Receiver, ShmTransport, TransferError, serve_shm
from tandem.param_sync.bucket import plan_manifest
from tandem.param_sync.transports.messages import Begin
from tandem.param_sync.transports.shm import SEGMENT_PREFIX

CTX = mp.get_context("spawn")


def our_segments() -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"{SEGMENT_PREFIX}{os.getpid()}-")]


@dataclass
class Rollout:
    process: mp.process.BaseProcess
    results: mp.connection.Connection

    def final_state(self) -> tuple[int, dict[str, bytes]]:
        assert self.results.poll(20), "the rollout process did not report"
        return self.results.recv()


@contextmanager
def rollout_process(mode: str, seed: int = 99) -> Iterator[tuple[Rollout, mp.connection.Connection]]:
    ours, theirs = CTX.Pipe()
    results_in, results_out = CTX.Pipe(duplex=False)
    process = CTX.Process(target=shm_rollout_worker, args=(theirs, results_out, mode, seed), daemon=True)
    process.start()
    theirs.close()  # so the rollout side sees EOF if we go away
    results_out.close()
    try:
        yield Rollout(process, results_in), ours
    finally:
        process.join(20)
        if process.is_alive():
            process.kill()
            process.join(5)


@pytest.mark.parametrize("mode", ["swap", "pause"])
async def test_shm_sync_is_bit_identical_and_leaves_no_segments(mode: str) -> None:
    trainer = Net()
    with rollout_process(mode) as (rollout, conn):
        syncer = ParamSyncer(ModuleSource(trainer), ShmTransport([conn], timeout_s=20), produce_bucket_mb=256 / 2**20)
        for version in (1, 2):
            fill_random(trainer, version)
            metrics = await syncer.sync(version)
            assert metrics["loaded_version/shm-rollout"] == version
        assert len(our_segments()) == 2  # the two halves of the dual buffer
        await syncer.aclose()
        version, state = rollout.final_state()
    assert version == 2 and state == raw_state(trainer)
    assert rollout.process.exitcode == 0
    assert our_segments() == []


async def test_shm_broken_transfers_leave_the_old_weights_and_the_next_one_succeeds() -> None:
    trainer = Net()
    source = FlakySource(trainer)
    with rollout_process("swap") as (rollout, conn):
        transport = FaultyTransport(ShmTransport([conn], timeout_s=20))
        syncer = ParamSyncer(source, transport, produce_bucket_mb=256 / 2**20)
        await _broken_then_good(syncer, trainer, source, transport)
        await syncer.aclose()
        version, state = rollout.final_state()
    assert version == 5 and state == raw_state(trainer)
    assert our_segments() == []


async def test_a_dead_rollout_process_fails_the_sync_instead_of_hanging() -> None:
    trainer = Net()
    with rollout_process("swap") as (rollout, conn):
        syncer = ParamSyncer(ModuleSource(trainer), ShmTransport([conn], timeout_s=5), produce_bucket_mb=256 / 2**20)
        await syncer.sync(1)
        rollout.process.kill()
        rollout.process.join(5)
        with pytest.raises(TransferError, match="shm-rollout.*gone"):
            await syncer.sync(2)
        assert syncer.loaded_versions == {"shm-rollout": 1}
        await syncer.aclose()
    assert our_segments() == []


def test_the_rollout_side_aborts_when_the_trainer_vanishes_midway() -> None:
    trainer, rollout = Net(), Net()
    fill_random(trainer, 1)
    fill_random(rollout, 2)
    served = raw_state(rollout)
    target = ModuleTarget(rollout, load_mode="swap")
    ours, theirs = CTX.Pipe()
    server = threading.Thread(target=serve_shm, args=(theirs, Receiver(target)))
    server.start()
    transport = ShmTransport([ours])
    half = transport.allocate(1 << 12)
    try:
        named = ModuleSource(trainer).named_tensors_for_sync()
        entries = [(n, t.dtype, tuple(t.shape), t.numel() * t.element_size()) for n, t in named]
        ours.send(Begin(1, plan_manifest(entries, bucket_nbytes=64, version=1), half.segment))
        ours.close()  # the trainer is gone before the first bucket
        server.join(10)
        assert not server.is_alive()
        assert raw_state(rollout) == served and target.loaded_version == 0
    finally:
        half.array = half.array[:0]
        half.release()


def test_a_rollout_that_misses_the_timeout_is_given_up_and_its_pipe_closed() -> None:
    """It may still serve from the half the next transfer writes, so it must get no more
    transfers, and its end of the pipe tells it the trainer is gone."""
    trainer = Net()
    ours, theirs = CTX.Pipe()
    transport = ShmTransport([ours], timeout_s=0.2)
    named = list(ModuleSource(trainer).named_tensors_for_sync())
    entries = [(n, t.dtype, tuple(t.shape), t.numel() * t.element_size()) for n, t in named]
    manifest = plan_manifest(entries, bucket_nbytes=64, version=1)
    half = transport.allocate(manifest.total_nbytes)
    try:
        (first,) = transport.send(manifest, half, [])
        (second,) = transport.send(manifest.with_version(2), half, [])
        assert not first.ok and "no answer within 0.2 s" in first.error
        assert not second.ok and "no answer" in second.error
        received: list[object] = []
        with pytest.raises(EOFError):  # the trainer's end is gone ...
            while theirs.poll(5):
                received.append(theirs.recv())
        # ... and nothing of the second transfer was sent to it
        assert not [m for m in received if isinstance(m, Begin) and m.transfer == 2]
    finally:
        half.array = half.array[:0]
        half.release()
        transport.close()
