"""Weight sync between the embedded torch engines through param_sync (``engines.shared.weight_sync``).

Specification: after a sync the rollout serves the trainer's weights bit for bit, in both load
modes; tokens generated while syncs land carry the version whose weights produced them; a
gather never copies a half-applied optimizer step; a failed transfer leaves the old weights
serving; and the version a sync reports is exactly the one it loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_lm import encode, save_tiny_model

import tandem.param_sync.syncer as syncer_module
from tandem.core.protocols import GenerationRequest, SamplingParams, WeightSync
from tandem.core.records import FinishReason, ResumePolicy, Trajectory, token_trajectory
from tandem.engines.shared.weight_sync import TorchWeightSync, TrainerSyncSource
from tandem.engines.text.rollout import HFRolloutEngine
from tandem.engines.trainers.torch_train import TorchLogProbEngine, TorchTrainEngine
from tandem.param_sync import (
    BucketHeader,
    BufferHalf,
    InProcessTransport,
    LoadReport,
    Manifest,
    ParamSyncer,
    Receiver,
    SyncSource,
    SyncTarget,
    TransferError,
    unique_weights,
)
from tests.unit.engines.trainers.test_torch_train import pg_loss

# Small buckets and pieces: the ~300 KB tiny model crosses in several of each.
BUCKETS = {"produce_bucket_mb": 0.05, "consume_bucket_mb": 0.02}


def groups(seed: int) -> list[Trajectory]:
    """Two random groups of four with alternating advantages: one train step moves every weight."""
    rng = random.Random(seed)
    out = []
    for g in range(2):
        prompt = [rng.randrange(2, 20) for _ in range(4)]
        for i in range(4):
            response = [rng.randrange(2, 20) for _ in range(8)]
            trajectory = token_trajectory(g, i, prompt, response, [-1.0] * 8, [0] * 8, FinishReason.LENGTH)
            trajectory.advantage = 1.0 if i % 2 else -1.0
            out.append(trajectory)
    return out


def raw(weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, bytes]:
    return {name: t.detach().contiguous().view(torch.uint8).numpy().tobytes() for name, t in weights}


def differing(a: dict[str, bytes], b: dict[str, bytes]) -> list[str]:
    """The weights whose bytes differ (a short failure message, unlike comparing the dicts)."""
    assert a.keys() == b.keys()
    return [name for name in a if a[name] != b[name]]


def trainer_raw(trainer: TorchTrainEngine) -> dict[str, bytes]:
    with trainer.weights_for_sync() as (_, weights):
        return raw(weights.items())


def rollout_raw(rollout: HFRolloutEngine) -> dict[str, bytes]:
    return raw(unique_weights(rollout.model).items())


def requests(n: int, max_new_tokens: int) -> list[GenerationRequest]:
    prompts = ["1+2=", "34+5=", "6=", "78+90=", "b", "12+3="]
    return [
        GenerationRequest(i, 0, encode(prompts[i % len(prompts)]), SamplingParams(max_new_tokens=max_new_tokens), seed=3)
        for i in range(n)
    ]


async def collect(stream: AsyncIterator[Trajectory]) -> list[Trajectory]:
    return sorted([s async for s in stream], key=lambda s: s.prompt_id)


class Engines:
    """A trainer, a rollout engine and the sync between them, closed in the right order."""

    def __init__(self, model_dir: Path, mode: str, *, transport: Any = None, source: Any = None, **rollout: Any) -> None:
        self.trainer = TorchTrainEngine(str(model_dir), lr=1e-2)
        self.rollout = HFRolloutEngine(str(model_dir), load_mode=mode, **rollout)
        self.source = source(self.trainer) if source else TrainerSyncSource(self.trainer)
        self.target = self.rollout.target
        inner = InProcessTransport([Receiver(self.target, consume_bucket_mb=BUCKETS["consume_bucket_mb"])])
        self.transport = transport(inner) if transport else inner
        syncer = ParamSyncer(self.source, self.transport, produce_bucket_mb=BUCKETS["produce_bucket_mb"])
        self.sync = TorchWeightSync(self.source, syncer)

    def close(self) -> None:
        self.sync.close()
        self.rollout.close()
        self.trainer.close()


@pytest.fixture
def make_engines(model_dir: Path) -> Iterator[Any]:
    made: list[Engines] = []

    def make(mode: str = "swap", **kwargs: Any) -> Engines:
        made.append(Engines(kwargs.pop("model_dir", model_dir), mode, **kwargs))
        return made[-1]

    yield make
    for engines in made:
        engines.close()


@pytest.mark.parametrize("mode", ["swap", "pause"])
async def test_after_each_sync_the_rollout_holds_the_trainers_weights_bit_for_bit(
    tmp_path: Path, make_engines: Any, mode: str
) -> None:
    tied = save_tiny_model(tmp_path, seed=0, eos=False, tied=True)  # the shipped model ties its head too
    e = make_engines(mode, model_dir=tied)
    assert isinstance(e.sync, WeightSync) and isinstance(e.source, SyncSource) and isinstance(e.target, SyncTarget)
    for version in (1, 2, 3):  # swap mode: syncs 2 and 3 load into the set that served before
        await e.trainer.train_step(groups(version), pg_loss)
        report = await e.sync.sync(version)
        assert report.version == e.rollout.version == version
        assert differing(rollout_raw(e.rollout), trainer_raw(e.trainer)) == []
    assert e.rollout.model.lm_head.weight is e.rollout.model.model.embed_tokens.weight
    assert report.metrics["bytes"] > 0 and report.metrics["buckets"] > 1 and report.metrics["gather_retries"] == 0


@pytest.mark.parametrize(
    ("mode", "policy"), [("swap", ResumePolicy.RECOMPUTE), ("pause", ResumePolicy.RECOMPUTE), ("swap", ResumePolicy.KEEP_CACHE)]
)
async def test_tokens_generated_while_syncs_land_carry_the_version_that_produced_them(
    model_dir: Path, make_engines: Any, mode: str, policy: ResumePolicy
) -> None:
    e = make_engines(mode, max_batch_size=4, resume_policy=policy)
    snapshots = {0: {k: v.clone() for k, v in e.trainer.model.state_dict().items()}}
    forwards = 0
    reached = {n: threading.Event() for n in (6, 30, 55)}

    syncing = threading.Event()

    def pace(*_: object) -> None:
        # Slows decoding so the syncs land while rows are mid-sequence: a little always, ten
        # times more while a sync is on its way (between steps its commit goes first), so a slow
        # sync on a loaded machine still lands before the rows it started beside have finished.
        nonlocal forwards
        forwards += 1
        if forwards in reached:
            reached[forwards].set()
        time.sleep(0.02 if syncing.is_set() else 0.002)

    e.rollout.model.register_forward_hook(pace)
    generation = asyncio.ensure_future(collect(e.rollout.generate(requests(8, 30))))
    for version, at in enumerate(reached.values(), 1):
        await e.trainer.train_step(groups(version), pg_loss)
        snapshots[version] = {k: v.clone() for k, v in e.trainer.model.state_dict().items()}
        await asyncio.to_thread(at.wait, 10)
        syncing.set()
        assert (await e.sync.sync(version)).version == version
        syncing.clear()
    samples = await generation

    async with TorchLogProbEngine(str(model_dir)) as scorer:
        by_version = {}
        for version, state in snapshots.items():
            scorer.model.load_state_dict(state)
            by_version[version] = await scorer.logprobs(samples)
    spans = set()
    for i, sample in enumerate(samples):
        versions = sample.versions
        assert versions == sorted(versions) and sample.start_version == versions[0]
        spans.add((versions[0], versions[-1]))
        if versions[0] != versions[-1]:
            assert sample.resumed is policy
        # KEEP_CACHE: later versions decode over a cache the older weights built (by design not
        # the new policy's log-probs), so only the starting version is checked there.
        checked = set(versions) if policy is ResumePolicy.RECOMPUTE else {versions[0]}
        for version in checked:
            mine = [(b, t) for b, t, v in zip(sample.behaviour_logprobs, by_version[version][i], versions) if v == version]
            assert max(abs(b - t) for b, t in mine) < 1e-4, (i, version)
            if version > 0:  # the check can tell neighbouring versions apart
                before = [t for t, v in zip(by_version[version - 1][i], versions) if v == version]
                assert max(abs(b - t) for (b, _), t in zip(mine, before)) > 1e-3
    assert any(first != last for first, last in spans), spans  # some rows lived through a sync


class ContendedLock:
    """The trainer's weights lock that also says when a thread had to wait for it."""

    def __init__(self, contended: threading.Event) -> None:
        self._lock = threading.Lock()
        self._contended = contended

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            self._contended.set()
            self._lock.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self._lock.release()


@pytest.mark.parametrize("guarded", [True, False])
async def test_a_sync_racing_an_optimizer_step_copies_one_whole_version(
    make_engines: Any, guarded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    armed = threading.Event()
    first_copied = threading.Event()
    resume = threading.Event()  # set once the step is blocked by the gather, or has finished
    copy_and_sum = syncer_module._copy_and_sum

    def slow_copy_and_sum(*args: Any) -> tuple[int, float]:
        """The gather's copier threads slower than the step: parts still copying as the walk ends."""
        if armed.is_set() and threading.current_thread().name.startswith("param-gather"):
            time.sleep(0.02)
        return copy_and_sum(*args)

    monkeypatch.setattr(syncer_module, "_copy_and_sum", slow_copy_and_sum)

    class PausingSource(TrainerSyncSource):
        """Once armed, stops after the first tensor until the racing step had its chance."""

        def named_tensors_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
            for i, item in enumerate(super().named_tensors_for_sync()):
                yield item
                if i == 0 and armed.is_set():
                    first_copied.set()
                    assert resume.wait(10)

    e = make_engines("swap", source=PausingSource)
    await e.sync.sync(0)  # plans the layout, so the armed walk below is the gather itself
    armed.set()
    before = trainer_raw(e.trainer)
    # Without the guard the optimizer step runs freely in the middle of the gather.
    e.trainer._weights_lock = ContendedLock(resume) if guarded else contextlib.nullcontext()
    syncing = asyncio.ensure_future(e.sync.sync(0))
    await asyncio.to_thread(first_copied.wait, 10)
    await e.trainer.train_step(groups(1), pg_loss)  # guarded: blocks until the gather ends
    resume.set()
    report = await syncing
    after = trainer_raw(e.trainer)
    assert before != after
    loaded = rollout_raw(e.rollout)
    if guarded:
        assert differing(loaded, before) == [] and report.version == e.rollout.version == 0
    else:  # the control: the same race without the lock tears the copy
        assert differing(loaded, before) and differing(loaded, after)


class CorruptOnce:
    """A transport whose next transfer has one byte flipped after its bucket's checksum was taken."""

    def __init__(self, inner: InProcessTransport) -> None:
        self.inner = inner
        self.armed = False

    def allocate(self, nbytes: int) -> BufferHalf:
        return self.inner.allocate(nbytes)

    def send(self, manifest: Manifest, half: BufferHalf, buckets: Iterable[BucketHeader]) -> list[LoadReport]:
        armed, self.armed = self.armed, False
        return self.inner.send(manifest, half, self._spoil(half, buckets) if armed else buckets)

    @staticmethod
    def _spoil(half: BufferHalf, buckets: Iterable[BucketHeader]) -> Iterator[BucketHeader]:
        for header in buckets:
            if header.seq == 1:
                half.array[header.offset] ^= 0xFF
            yield header

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("mode", ["swap", "pause"])
async def test_a_corrupt_transfer_leaves_the_old_weights_serving_and_the_next_sync_succeeds(
    make_engines: Any, mode: str
) -> None:
    e = make_engines(mode, transport=CorruptOnce)
    old = rollout_raw(e.rollout)
    await e.trainer.train_step(groups(1), pg_loss)
    e.transport.armed = True
    with pytest.raises(TransferError, match="corrupt"):
        await e.sync.sync(1)
    assert e.rollout.version == 0 and differing(rollout_raw(e.rollout), old) == []
    [sample] = await collect(e.rollout.generate(requests(1, 5)))  # still generating, on version 0
    assert sample.versions == [0] * 5
    assert (await e.sync.sync(1)).version == e.rollout.version == 1
    assert differing(rollout_raw(e.rollout), trainer_raw(e.trainer)) == []


async def test_a_sync_loads_the_trainers_newest_version_and_says_so(make_engines: Any) -> None:
    e = make_engines()
    await e.trainer.train_step(groups(1), pg_loss)
    await e.trainer.train_step(groups(2), pg_loss)
    report = await e.sync.sync(1)
    assert report.version == e.rollout.version == 2
    with pytest.raises(ValueError, match="trainer is at version 2"):
        await e.sync.sync(3)


async def test_a_step_landing_just_before_the_gather_relabels_the_sync(make_engines: Any) -> None:
    loop = asyncio.get_running_loop()
    stepped = False

    class SteppingSource(TrainerSyncSource):
        """The first walk is preceded by a train step, after the sync read the version."""

        def named_tensors_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal stepped
            if not stepped:
                stepped = True
                asyncio.run_coroutine_threadsafe(self.trainer.train_step(groups(1), pg_loss), loop).result()
            yield from super().named_tensors_for_sync()

    e = make_engines(source=SteppingSource)
    report = await e.sync.sync(0)
    assert report.version == e.rollout.version == 1 and report.metrics["gather_retries"] == 1
    assert differing(rollout_raw(e.rollout), trainer_raw(e.trainer)) == []


async def test_a_dtype_mismatch_is_refused_naming_the_weight(make_engines: Any) -> None:
    e = make_engines(dtype=torch.bfloat16)
    with pytest.raises(TransferError, match=r"model\.embed_tokens\.weight: sent as float32.*held as bfloat16"):
        await e.sync.sync(0)
    assert e.rollout.version == 0


def test_close_is_synchronous_waits_for_the_sync_in_flight_and_refuses_later_ones(make_engines: Any) -> None:
    entered, proceed = threading.Event(), threading.Event()

    class HeldSource(TrainerSyncSource):
        def named_tensors_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
            entered.set()
            assert proceed.wait(10)
            yield from super().named_tensors_for_sync()

    e = make_engines(source=HeldSource)
    reports: list[Any] = []
    # Its caller's loop lives in another thread and is gone by the time close returns.
    caller = threading.Thread(target=lambda: reports.append(asyncio.run(e.sync.sync(0))))
    caller.start()
    assert entered.wait(10)
    closer = threading.Thread(target=e.sync.close)
    closer.start()
    time.sleep(0.05)
    assert closer.is_alive()  # waiting for the sync in flight
    proceed.set()
    closer.join(10)
    caller.join(10)
    assert [r.version for r in reports] == [0]
    e.sync.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(e.sync.sync(0))
