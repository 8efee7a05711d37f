"""Adapter-only weight sync into the embedded rollout engine, each sync proven by the probe.

Specification: a sync moves the adapter's bytes and nothing else; afterwards the engine scores
like the trainer (fp32, below 1e-4); each sync replaces the adapter (the base is never
written); generation serves the previous adapter until the new one commits; and a sync that an
engine acknowledges without applying is caught by the probe at that very sync, with an error
saying the adapter did not land.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tandem.core.config import LoraConfig
from tandem.engines.shared.lora import adapter_tensors, lora_settings
from tandem.engines.shared.probe import ProbedWeightSync, probed_in_process
from tandem.engines.text.rollout import HFRolloutEngine
from tandem.engines.trainers.torch_train import TorchTrainEngine
from tandem.param_sync import ModuleTarget, TransferError, unique_weights
from tests.unit.engines.shared.test_torch_sync import collect, differing, groups, raw, requests
from tests.unit.engines.trainers.test_torch_train import pg_loss

pytest.importorskip("peft", reason="LoRA needs the lora extra (peft)")


class HeldCommit:
    """The engine's target with each commit held until released, so a test can watch generation
    between a verified transfer and its commit (everything else goes to the real target)."""

    def __init__(self, inner: ModuleTarget) -> None:
        self.inner = inner
        self.reached = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def commit(self, version: int) -> float:
        self.reached.set()
        assert self.release.wait(30)
        return self.inner.commit(version)


class Dropping:
    """The engine's target acknowledging every update from ``drop_from`` on without applying it:
    it reports the version as loaded, and the old adapter keeps serving (the bug the probe is for)."""

    def __init__(self, inner: ModuleTarget, drop_from: int) -> None:
        self.inner = inner
        self.drop_from = drop_from
        self.acknowledged = inner.loaded_version

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def loaded_version(self) -> int:
        return max(self.acknowledged, self.inner.loaded_version)

    def commit(self, version: int) -> float:
        if version < self.drop_from:
            return self.inner.commit(version)
        self.inner.abort()
        self.acknowledged = version
        return 0.0


class Engines:
    """A LoRA trainer, a LoRA rollout engine and the probed sync between them."""

    def __init__(self, model_dir: Path, target: Any = None) -> None:
        settings = lora_settings(LoraConfig(rank=4), model_dir)
        self.trainer = TorchTrainEngine(str(model_dir), lr=1e-2, lora=settings, probe=True)
        self.rollout = HFRolloutEngine(str(model_dir), lora=settings, max_batch_size=4)
        if target is not None:
            self.rollout.target = target(self.rollout.target)
        assert self.trainer.probe is not None
        self.sync: ProbedWeightSync = probed_in_process(
            self.trainer, self.rollout, self.trainer.probe, max_gap=1e-4, what="the adapter",
            produce_bucket_mb=0.01, consume_bucket_mb=0.005,
        )  # fmt: skip

    def close(self) -> None:
        self.sync.close()
        self.rollout.close()
        self.trainer.close()


@contextmanager
def lora_engines(model_dir: Path, target: Any = None) -> Iterator[Engines]:
    engines = Engines(model_dir, target)
    try:
        yield engines
    finally:
        engines.close()


async def test_a_sync_moves_the_adapters_bytes_and_the_engine_then_scores_like_the_trainer(model_dir: Path) -> None:
    with lora_engines(model_dir) as e:
        adapter_bytes = sum(t.numel() * t.element_size() for _, t in e.trainer.named_tensors_for_sync())
        model_bytes = sum(t.numel() * t.element_size() for t in unique_weights(e.rollout.model.get_base_model()).values())
        for version in (1, 2):
            await e.trainer.train_step(groups(version), pg_loss)
            report = await e.sync.sync(version)
            assert report.version == e.rollout.version == version
            assert report.metrics["bytes"] == adapter_bytes < model_bytes / 10
            assert report.metrics["logprob_gap"] < 1e-4
        samples = await collect(e.rollout.generate(requests(4, 12)))
        scored = await e.trainer.logprobs(samples)
        assert all(s.versions == [2] * 12 for s in samples)
        assert max(abs(b - t) for s, lp in zip(samples, scored) for b, t in zip(s.behaviour_logprobs, lp)) < 1e-4


async def test_each_sync_replaces_the_adapter_and_never_writes_the_base(model_dir: Path) -> None:
    with lora_engines(model_dir) as e:
        base = raw(unique_weights(e.rollout.model.get_base_model()).items())
        base = {n: b for n, b in base.items() if ".lora_" not in n}
        for version in (1, 2, 3):
            await e.trainer.train_step(groups(version), pg_loss)
            await e.sync.sync(version)
            served = raw(adapter_tensors(e.rollout.model).items())
            assert differing(served, raw(e.trainer.named_tensors_for_sync())) == []  # the adapter, bit for bit
        after = raw(unique_weights(e.rollout.model.get_base_model()).items())
        assert differing({n: after[n] for n in base}, base) == []


async def test_generation_serves_the_previous_adapter_until_the_new_one_commits(model_dir: Path) -> None:
    with lora_engines(model_dir, target=HeldCommit) as e:
        await e.trainer.train_step(groups(1), pg_loss)
        before = await collect(e.rollout.generate(requests(2, 6)))
        syncing = asyncio.ensure_future(e.sync.sync(1))
        await asyncio.to_thread(e.rollout.target.reached.wait, 30)  # verified, not committed
        during = await collect(e.rollout.generate(requests(2, 6)))
        e.rollout.target.release.set()
        await syncing
        after = await collect(e.rollout.generate(requests(2, 6)))
        assert [s.behaviour_logprobs for s in during] == [s.behaviour_logprobs for s in before]
        assert all(s.versions == [0] * 6 for s in during) and all(s.versions == [1] * 6 for s in after)
        assert [s.behaviour_logprobs for s in after] != [s.behaviour_logprobs for s in before]


async def test_a_sync_acknowledged_but_not_applied_is_caught_by_the_probe_at_that_sync(model_dir: Path) -> None:
    with lora_engines(model_dir, target=lambda inner: Dropping(inner, drop_from=2)) as e:
        await e.trainer.train_step(groups(1), pg_loss)
        assert (await e.sync.sync(1)).metrics["logprob_gap"] < 1e-4
        await e.trainer.train_step(groups(2), pg_loss)
        with pytest.raises(TransferError, match=r"version 2 .* by up to .* nats \(bound 0.0001\): the adapter did not land"):
            await e.sync.sync(2)
        assert e.rollout.version == 2  # the engine claims it: only the probe saw through it
