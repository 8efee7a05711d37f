"""The nn.Module adapters and the decode-step gate, driven directly (no transport)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from param_sync_models import Net, fill_random, raw_state

from tandem.param_sync import LayoutError, ModuleSource, ModuleTarget, StaleVersionError, StepGate, SyncError
from tandem.param_sync.bucket import plan_manifest, tensor_bytes


def manifest_and_stream(module: torch.nn.Module, version: int, rename: dict[str, str] | None = None):
    named = list(ModuleSource(module).named_tensors_for_sync())
    manifest = plan_manifest(
        [((rename or {}).get(n, n), t.dtype, tuple(t.shape), t.numel() * t.element_size()) for n, t in named],
        bucket_nbytes=64,
        version=version,
    )
    stream = np.zeros(manifest.total_nbytes, np.uint8)
    for meta, (_, tensor) in zip(manifest.tensors, named, strict=True):
        stream[meta.offset : meta.offset + meta.nbytes] = tensor_bytes(tensor).numpy()
    return manifest, stream


def load_all(target: ModuleTarget, manifest, stream) -> None:
    target.load_bucket(manifest.slices(stream, 0, manifest.total_nbytes))


def test_source_sends_each_tied_storage_once_and_skips_non_persistent_buffers() -> None:
    names = [name for name, _ in ModuleSource(Net()).named_tensors_for_sync()]
    assert "head.weight" not in names and "embed.weight" in names  # tied: first name wins
    assert "cache" not in names
    assert {"steps", "mask", "scale", "gate", "proj.weight"} <= set(names)


@pytest.mark.parametrize("mode", ["swap", "pause"])
def test_commit_makes_the_update_live_in_every_tied_alias(mode: str) -> None:
    trainer, rollout = Net(), Net()
    fill_random(trainer, 1)
    target = ModuleTarget(rollout, load_mode=mode)
    manifest, stream = manifest_and_stream(trainer, 1)
    target.begin_update(manifest)
    load_all(target, manifest, stream)
    target.commit(1)
    assert raw_state(rollout) == raw_state(trainer)
    assert rollout.head.weight is rollout.embed.weight
    assert target.loaded_version == 1 and not target.gate.held


def test_swap_loads_into_the_idle_set_and_abort_leaves_live_weights_untouched() -> None:
    trainer, rollout = Net(), Net()
    fill_random(trainer, 1)
    fill_random(rollout, 2)
    before = raw_state(rollout)
    target = ModuleTarget(rollout, load_mode="swap")
    manifest, stream = manifest_and_stream(trainer, 1)
    target.begin_update(manifest)
    load_all(target, manifest, stream)
    assert raw_state(rollout) == before  # nothing live changes before the commit
    target.abort()
    assert raw_state(rollout) == before and target.loaded_version == 0
    target.begin_update(manifest)  # the next update starts clean
    load_all(target, manifest, stream)
    target.commit(1)
    assert raw_state(rollout) == raw_state(trainer)


def test_swapped_out_weights_are_reused_and_fully_overwritten() -> None:
    trainer, rollout = Net(), Net()
    target = ModuleTarget(rollout, load_mode="swap")
    for version in (1, 2, 3):
        fill_random(trainer, version)
        manifest, stream = manifest_and_stream(trainer, version)
        target.begin_update(manifest)
        load_all(target, manifest, stream)
        target.commit(version)
        assert raw_state(rollout) == raw_state(trainer)


def test_pause_holds_generation_from_begin_until_commit() -> None:
    trainer, rollout = Net(), Net()
    target = ModuleTarget(rollout, load_mode="pause")
    manifest, stream = manifest_and_stream(trainer, 1)
    target.begin_update(manifest)
    assert target.gate.held
    load_all(target, manifest, stream)
    stall = target.commit(1)
    assert stall > 0 and not target.gate.held


def test_pause_abort_before_any_copy_resumes_generation() -> None:
    target = ModuleTarget(Net(), load_mode="pause")
    manifest, _ = manifest_and_stream(Net(), 1)
    target.begin_update(manifest)
    target.abort()
    assert not target.gate.held and target.loaded_version == 0


def test_pause_abort_after_a_copy_keeps_generation_paused_until_a_whole_version_commits() -> None:
    trainer, rollout = Net(), Net()
    fill_random(trainer, 1)
    target = ModuleTarget(rollout, load_mode="pause")
    manifest, stream = manifest_and_stream(trainer, 1)
    target.begin_update(manifest)
    target.load_bucket(manifest.slices(stream, 0, 64))
    target.abort()
    assert target.gate.held  # a half-loaded model never serves
    target.begin_update(manifest)
    load_all(target, manifest, stream)
    target.commit(1)
    assert not target.gate.held and raw_state(rollout) == raw_state(trainer)


def test_layout_mismatches_are_rejected_before_anything_is_copied() -> None:
    target = ModuleTarget(Net(), load_mode="pause")
    renamed, _ = manifest_and_stream(Net(), 1, rename={"gate": "gates"})
    with pytest.raises(LayoutError, match="no weight 'gates'"):
        target.begin_update(renamed)
    wider, _ = manifest_and_stream(Net(width=8), 1)
    with pytest.raises(LayoutError, match="sent as"):
        target.begin_update(wider)
    other = Net()
    other.gate = torch.nn.Parameter(torch.zeros(7, 3, dtype=torch.float32))
    recast, _ = manifest_and_stream(other, 1)
    with pytest.raises(LayoutError, match="never cast"):
        target.begin_update(recast)
    untied, _ = manifest_and_stream(Net(tied=False), 1)
    with pytest.raises(LayoutError, match="share one tensor"):
        target.begin_update(untied)
    partial, _ = manifest_and_stream(torch.nn.Linear(16, 16), 1, rename={"weight": "embed.weight"})
    with pytest.raises(LayoutError):
        target.begin_update(partial)
    assert not target.gate.held


def test_untied_rollout_needs_every_weight() -> None:
    target = ModuleTarget(Net(tied=False))
    tied, _ = manifest_and_stream(Net(), 1)
    with pytest.raises(LayoutError, match="unset"):
        target.begin_update(tied)


def test_versions_only_move_forward_and_updates_do_not_nest() -> None:
    target = ModuleTarget(Net(), version=5)
    old, _ = manifest_and_stream(Net(), 4)
    with pytest.raises(StaleVersionError):
        target.begin_update(old)
    manifest, _ = manifest_and_stream(Net(), 6)
    target.begin_update(manifest)
    with pytest.raises(SyncError, match="in progress"):
        target.begin_update(manifest)
    with pytest.raises(SyncError):
        target.commit(7)


def test_gate_hold_waits_for_the_running_step_and_blocks_new_ones() -> None:
    gate = StepGate()
    events: list[str] = []
    in_step = threading.Event()

    def step() -> None:
        with gate.step():
            in_step.set()
            time.sleep(0.05)
            events.append("step done")

    runner = threading.Thread(target=step)
    runner.start()
    in_step.wait(5)
    gate.hold()
    events.append("held")

    def next_step() -> None:
        with gate.step():
            events.append("next step")

    second = threading.Thread(target=next_step)
    second.start()
    time.sleep(0.05)
    assert events == ["step done", "held"]  # the next step waits for the release
    gate.release()
    second.join(5)
    runner.join(5)
    assert events[-1] == "next step"
