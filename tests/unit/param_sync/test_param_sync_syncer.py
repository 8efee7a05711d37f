"""ParamSyncer end to end in one process: bit-identical weights, versions only forward, every
broken transfer rejected whole with the old weights serving, and generation never seeing two
versions in one decode step."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch
from param_sync_models import (
    DecodeLoop,
    FaultyTransport,
    FlakySource,
    Net,
    fill_random,
    fill_version,
    raw_state,
)

import tandem.param_sync.syncer as syncer_module
from tandem.core.protocols import WeightSync
from tandem.param_sync import (
    GatherError,
    InProcessTransport,
    LayoutError,
    ModuleSource,
    ModuleTarget,
    ParamSyncer,
    Receiver,
    StaleVersionError,
    TransferError,
)
from tandem.param_sync.bucket import MiB
from tandem.param_sync.syncer import _PartPipeline

TINY_MB = 256 / 2**20  # 256-byte buckets: the small test model spans many of them


def rig(
    mode: str = "swap", *, engines: int = 1, produce_mb: float = TINY_MB, consume_mb: float = 100 / 2**20, **net_kwargs
):
    trainer = Net(**net_kwargs)
    rollouts = [Net(**net_kwargs) for _ in range(engines)]
    for i, module in enumerate(rollouts):
        fill_random(module, 100 + i)
    targets = [ModuleTarget(m, load_mode=mode) for m in rollouts]
    receivers = [Receiver(t, consume_bucket_mb=consume_mb, engine=f"r{i}") for i, t in enumerate(targets)]
    transport = FaultyTransport(InProcessTransport(receivers))
    source = FlakySource(trainer)
    return trainer, rollouts, targets, transport, ParamSyncer(source, transport, produce_bucket_mb=produce_mb)


def test_the_syncer_is_the_flows_weight_sync() -> None:
    *_, syncer = rig()
    assert isinstance(syncer, WeightSync)


@pytest.mark.parametrize("mode", ["swap", "pause"])
@pytest.mark.parametrize(("produce_mb", "consume_mb"), [(TINY_MB, 100 / 2**20), (64.0, 64.0), (1 / 2**20, 7 / 2**20)])
async def test_weights_are_bit_identical_after_sync_for_every_dtype(mode: str, produce_mb: float, consume_mb: float) -> None:
    trainer, rollouts, targets, _, syncer = rig(mode, engines=2, produce_mb=produce_mb, consume_mb=consume_mb)
    dtypes = {t.dtype for t in trainer.state_dict().values()}
    assert {torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.float64} <= dtypes
    for version in (1, 2):
        fill_random(trainer, version)  # raw random bits: any cast would change some of them
        metrics = await syncer.sync(version)
        for rollout, target in zip(rollouts, targets, strict=True):
            assert raw_state(rollout) == raw_state(trainer)
            assert target.loaded_version == version
            assert rollout.head.weight is rollout.embed.weight  # still tied
        assert metrics["version"] == version and metrics["loaded_version/r1"] == version
    assert syncer.loaded_versions == {"r0": 2, "r1": 2}
    await syncer.aclose()


async def test_metrics_report_bytes_and_seconds_per_phase() -> None:
    trainer, _, _, _, syncer = rig()
    metrics = await syncer.sync(1)
    expected_bytes = sum(t.numel() * t.element_size() for _, t in ModuleSource(trainer).named_tensors_for_sync())
    assert metrics["bytes"] >= expected_bytes  # plus alignment padding
    for key in ("gather_s", "checksum_s", "send_s", "verify_s", "load_s", "stall_s", "total_s", "gb_per_s"):
        assert metrics[key] >= 0, key
    assert metrics["buckets"] > 1 and metrics["total_s"] >= metrics["gather_s"]


async def test_name_map_translates_trainer_names_to_rollout_names() -> None:
    trainer = torch.nn.ModuleDict({"layer": torch.nn.Linear(4, 4, dtype=torch.bfloat16)})
    rollout = torch.nn.ModuleDict({"block": torch.nn.Linear(4, 4, dtype=torch.bfloat16)})
    target = ModuleTarget(rollout)
    syncer = ParamSyncer(
        ModuleSource(trainer),
        InProcessTransport([Receiver(target)]),
        name_map={"layer.weight": "block.weight", "layer.bias": "block.bias"},
    )
    await syncer.sync(1)
    assert torch.equal(rollout["block"].weight, trainer["layer"].weight)
    assert torch.equal(rollout["block"].bias, trainer["layer"].bias)


async def test_versions_only_move_forward() -> None:
    trainer, (rollout,), (target,), _, syncer = rig()
    fill_random(trainer, 3)
    await syncer.sync(3)
    served = raw_state(rollout)
    fill_random(trainer, 2)
    with pytest.raises(StaleVersionError):
        await syncer.sync(2)
    assert target.loaded_version == 3 and raw_state(rollout) == served
    fill_random(trainer, 3)
    await syncer.sync(3)  # the same version again is a retry, not a step back
    assert target.loaded_version == 3


async def test_an_engine_ahead_of_the_trainer_rejects_the_older_version() -> None:
    trainer, rollout = Net(), Net()
    fill_random(rollout, 9)
    served = raw_state(rollout)
    target = ModuleTarget(rollout, version=5)
    syncer = ParamSyncer(ModuleSource(trainer), InProcessTransport([Receiver(target, engine="ahead")]))
    with pytest.raises(TransferError, match="ahead.*older than loaded version 5"):
        await syncer.sync(4)
    assert raw_state(rollout) == served and syncer.loaded_versions == {"ahead": 5}


@pytest.mark.parametrize("mode", ["swap", "pause"])
@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("drop_last", "incomplete"),
        ("reorder", "out-of-order"),
        ("corrupt", "corrupt"),
        ("wrong_version", "is for version"),
        ("killed", "sender killed midway"),
    ],
)
async def test_a_broken_transfer_is_rejected_whole_and_the_next_one_succeeds(mode: str, fault: str, message: str) -> None:
    trainer, (rollout,), (target,), transport, syncer = rig(mode)
    fill_random(trainer, 1)
    await syncer.sync(1)
    served = raw_state(rollout)
    fill_random(trainer, 2)
    transport.arm(fault)
    with pytest.raises(TransferError, match=message):
        await syncer.sync(2)
    assert raw_state(rollout) == served  # the old weights keep serving, untouched
    assert target.loaded_version == 1 and not target.gate.held
    await syncer.sync(2)
    assert raw_state(rollout) == raw_state(trainer) and target.loaded_version == 2


@pytest.mark.parametrize("mode", ["swap", "pause"])
async def test_a_gather_killed_midway_leaves_the_old_weights_and_the_next_sync_succeeds(mode: str) -> None:
    trainer, (rollout,), (target,), _, syncer = rig(mode)
    source = syncer.source
    assert isinstance(source, FlakySource)
    fill_random(trainer, 1)
    await syncer.sync(1)
    served = raw_state(rollout)
    fill_random(trainer, 2)
    source.arm(after=3)
    with pytest.raises(GatherError, match="trainer died"):
        await syncer.sync(2)
    assert raw_state(rollout) == served and target.loaded_version == 1 and not target.gate.held
    await syncer.sync(2)
    assert raw_state(rollout) == raw_state(trainer) and target.loaded_version == 2


async def test_one_failing_engine_does_not_hold_back_the_others() -> None:
    trainer = Net()
    good, bad = Net(), Net(width=8)
    targets = [ModuleTarget(good), ModuleTarget(bad)]
    receivers = [Receiver(targets[0], engine="good"), Receiver(targets[1], engine="bad")]
    syncer = ParamSyncer(ModuleSource(trainer), InProcessTransport(receivers))
    fill_random(trainer, 1)
    with pytest.raises(TransferError, match="1 of 2 engines: bad"):
        await syncer.sync(1)
    assert raw_state(good) == raw_state(trainer)
    assert syncer.loaded_versions == {"good": 1, "bad": 0}


async def test_a_changed_trainer_layout_fails_once_then_is_replanned() -> None:
    trainer, (rollout,), _, _, syncer = rig()
    await syncer.sync(1)

    class Reordered:
        def named_tensors_for_sync(self):
            return reversed(list(ModuleSource(trainer).named_tensors_for_sync()))

    syncer.source = Reordered()
    fill_random(trainer, 2)
    with pytest.raises(LayoutError, match="changed layout"):
        await syncer.sync(2)
    await syncer.sync(2)
    assert raw_state(rollout) == raw_state(trainer)


async def test_overlapping_syncs_complete_in_version_order() -> None:
    trainer, (rollout,), (target,), _, syncer = rig()
    results = await asyncio.gather(syncer.sync(1), syncer.sync(2), syncer.sync(3))
    assert [m["version"] for m in results] == [1, 2, 3]
    assert target.loaded_version == 3
    late = await asyncio.gather(syncer.sync(5), syncer.sync(4), return_exceptions=True)
    assert isinstance(late[1], StaleVersionError) and target.loaded_version == 5
    assert raw_state(rollout) == raw_state(trainer)


async def test_a_cancelled_caller_does_not_cut_a_sync_in_half() -> None:
    trainer, (rollout,), (target,), _, syncer = rig()
    fill_random(trainer, 1)
    caller = asyncio.create_task(syncer.sync(1))
    await asyncio.sleep(0)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await syncer.aclose()  # waits for the sync, which finished whole in the background
    assert target.loaded_version == 1 and raw_state(rollout) == raw_state(trainer)


@pytest.mark.parametrize("mode", ["swap", "pause"])
async def test_generation_never_sees_two_versions_in_one_decode_step(mode: str) -> None:
    trainer, (rollout,), (target,), _, syncer = rig(mode, produce_mb=64 / 2**20, consume_mb=32 / 2**20)
    fill_version(trainer, 0)
    fill_version(rollout, 0)
    with DecodeLoop(target, step_s=0.002) as loop:
        for version in range(1, 13):
            fill_version(trainer, version)
            await syncer.sync(version)
            await asyncio.sleep(0.004)  # let some steps run on each version
    assert loop.mixed == []
    assert len(loop.waits) >= 12
    assert target.loaded_version == 12 and rollout.steps.tolist() == [12] * 5


async def test_swap_stalls_generation_for_less_than_one_decode_step() -> None:
    step_s = 0.05
    trainer, (rollout,), (target,), _, syncer = rig("swap", produce_mb=1.0, consume_mb=1.0, width=512)
    with DecodeLoop(target, step_s=step_s) as loop:
        await asyncio.sleep(step_s / 2)  # syncs land in the middle of decode steps
        stalls = [(await syncer.sync(version))["stall_s"] for version in (1, 2, 3)]
        await asyncio.sleep(step_s)
    assert max(loop.waits) < step_s
    assert max(stalls) < step_s
    assert raw_state(rollout) == raw_state(trainer)


async def test_a_source_that_fails_before_the_first_sync_is_reported_and_retried() -> None:
    trainer, (rollout,), (target,), _, syncer = rig()
    source = syncer.source
    assert isinstance(source, FlakySource)
    source.arm(after=0)  # the very first walk (the layout plan) dies
    with pytest.raises(GatherError, match="plan the layout"):
        await syncer.sync(1)
    assert target.loaded_version == 0
    await syncer.sync(1)
    assert raw_state(rollout) == raw_state(trainer)


def stream_owns(stream_half: np.ndarray, tensor: torch.Tensor) -> bool:
    base = stream_half.ctypes.data
    return base <= tensor.data_ptr() < base + stream_half.size


async def test_a_mapping_rollout_serves_from_the_buffer_half_and_holds_no_copy() -> None:
    trainer, (rollout,), (target,), _, syncer = rig("swap")
    assert target.can_map
    for version in (1, 2, 3):
        fill_random(trainer, version)
        await syncer.sync(version)
        assert raw_state(rollout) == raw_state(trainer) and target.loaded_version == version
        half = syncer._buffer.active.array  # the half this version was sent in
        assert all(stream_owns(half, t) for t in rollout.state_dict().values())
    assert rollout.head.weight is rollout.embed.weight  # ties survive the repointing


@pytest.mark.parametrize("fault", ["corrupt", "killed"])
async def test_after_an_aborted_transfer_the_next_gather_cannot_reach_the_weights_being_served(fault: str) -> None:
    """Version 1 serves from half A; version 2 (half B) is aborted; the gather of version 3 then
    writes half A and dies midway. A rollout still mapped from A would serve a torn mix: it
    must have copied version 1 out when version 2 aborted."""
    trainer, (rollout,), (target,), transport, syncer = rig("swap")
    source = syncer.source
    fill_random(trainer, 1)
    await syncer.sync(1)
    served = raw_state(rollout)
    fill_random(trainer, 2)
    transport.arm(fault)
    with pytest.raises(TransferError):
        await syncer.sync(2)
    fill_random(trainer, 3)
    source.arm(after=3)
    with pytest.raises(GatherError):
        await syncer.sync(3)
    assert raw_state(rollout) == served and target.loaded_version == 1
    await syncer.sync(3)
    assert raw_state(rollout) == raw_state(trainer) and target.loaded_version == 3


async def test_closing_the_transport_leaves_the_rollout_its_own_weights() -> None:
    trainer, (rollout,), _, _, syncer = rig("swap")
    fill_random(trainer, 1)
    await syncer.sync(1)
    half = syncer._buffer.active.array
    await syncer.aclose()
    assert raw_state(rollout) == raw_state(trainer)
    assert not any(stream_owns(half, t) for t in rollout.state_dict().values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["swap", "pause"])
async def test_a_cuda_rollout_loads_bit_identical_weights_from_pinned_halves(mode: str) -> None:
    trainer, rollout = Net(), Net().cuda()
    target = ModuleTarget(rollout, load_mode=mode)
    assert not target.can_map  # device weights are copied in, never mapped
    syncer = ParamSyncer(ModuleSource(trainer), InProcessTransport([Receiver(target)]), produce_bucket_mb=TINY_MB)
    for version in (1, 2):
        fill_random(trainer, version)
        await syncer.sync(version)
    assert torch.from_numpy(syncer._buffer.active.array).is_pinned()
    await syncer.aclose()
    assert target.loaded_version == 2 and raw_state(rollout.cpu()) == raw_state(trainer)


class Wide(torch.nn.Module):
    """Tensors of several cache-sized parts, sizes that are not whole words, and buckets that
    cut them where parts do not."""

    def __init__(self) -> None:
        super().__init__()
        self.odd = torch.nn.Parameter(torch.zeros(1_572_867, dtype=torch.float16))  # 3 MiB + 6 bytes
        self.small = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
        self.big = torch.nn.Parameter(torch.zeros(700_001, dtype=torch.float32))


@pytest.mark.parametrize(("gather_threads", "window_mib"), [(1, 32), (3, 32), (3, 2)])
async def test_a_gather_spread_over_threads_checksums_and_delivers_every_byte(
    gather_threads: int, window_mib: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parts finish out of order on several threads; each bucket's checksum still adds up
    its parts in stream order, also when the window of unretired parts is full."""
    monkeypatch.setattr(_PartPipeline, "WINDOW_NBYTES", window_mib * MiB)
    trainer, rollout = Wide(), Wide()
    target = ModuleTarget(rollout, load_mode="swap")
    syncer = ParamSyncer(
        ModuleSource(trainer), InProcessTransport([Receiver(target)]), produce_bucket_mb=1.5, gather_threads=gather_threads
    )
    for version in (1, 2):
        fill_random(trainer, version)
        metrics = await syncer.sync(version)  # a part summed wrongly fails its bucket's check
        assert metrics["buckets"] == 4
        assert raw_state(rollout) == raw_state(trainer)
    await syncer.aclose()


async def test_a_gather_killed_while_parts_are_still_copying_waits_for_them_and_leaves_the_old_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The source dies after a many-part tensor was handed to the copy threads: the sync fails
    only once those copies have ended (none writes the half afterwards), the rollout keeps
    serving the old weights, and the next sync delivers every byte."""
    copies = {"started": 0, "ended": 0}
    copy_and_sum = syncer_module._copy_and_sum

    def slow_copy(stream: np.ndarray, host: np.ndarray, part: object) -> tuple[int, float]:
        copies["started"] += 1
        time.sleep(0.05)  # still copying when the source dies
        try:
            return copy_and_sum(stream, host, part)
        finally:
            copies["ended"] += 1

    monkeypatch.setattr(syncer_module, "_copy_and_sum", slow_copy)
    trainer, rollout = Wide(), Wide()
    target = ModuleTarget(rollout, load_mode="swap")
    source = FlakySource(trainer)
    syncer = ParamSyncer(source, InProcessTransport([Receiver(target)]), produce_bucket_mb=1.5, gather_threads=3)
    fill_random(trainer, 1)
    await syncer.sync(1)
    served = raw_state(rollout)
    fill_random(trainer, 2)
    source.arm(after=1)  # dies right after "odd" (3 MiB and 6 bytes: three parts in the copy threads)
    copies.update(started=0, ended=0)
    with pytest.raises(GatherError, match="trainer died"):
        await syncer.sync(2)
    assert copies["started"] == 3 and copies["ended"] == 3  # every copy under way had ended
    assert raw_state(rollout) == served and target.loaded_version == 1
    await syncer.sync(2)
    assert raw_state(rollout) == raw_state(trainer) and target.loaded_version == 2
    await syncer.aclose()
