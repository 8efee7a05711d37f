"""vLLM in process (``engines.vllm``), against the real engine (its CPU build).

One engine serves the whole test session (``vllm_engine`` in ``conftest.py``): a tiny Qwen2 with
a tied LM head, so the CPU backend's stale-head bug can show. Every test first pushes weights
of its own at a version above the engine's, so tests do not depend on each other's order.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
import torch
from weights_for_tests import TensorSource

from tandem.core.protocols import GenerationRequest, SamplingParams
from tandem.core.records import ResumePolicy, Trajectory
from tandem.engines.trainers.torch_train import TorchLogProbEngine, TorchTrainEngine
from tandem.engines.vllm.build import generation_cpus
from tandem.engines.vllm.engine import VllmRolloutEngine, token_versions
from tandem.engines.vllm.sync import VllmShmTransport, WeightProbe
from tandem.param_sync import ParamSyncer, SyncError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.xdist_group("vllm")]

PROMPTS = [[3, 4, 12], [5, 6, 7, 8, 13], [9, 2, 14, 15]]


def test_token_versions_expand_vllms_spans_token_by_token() -> None:
    spans = [("3", 0, 2), ("4", 2, 5)]
    assert token_versions(spans, 5, serving=9) == [3, 3, 4, 4, 4]
    assert token_versions(None, 3, serving=7) == [7, 7, 7]
    assert token_versions([("default", 0, 2)], 2, serving=7) == [0, 0]  # a server never updated: the file's weights
    with pytest.raises(ValueError, match="cover 5 of 6 tokens"):
        token_versions(spans, 6, serving=4)


def test_the_engine_core_computes_on_the_cores_it_is_given_one_thread_each(vllm_engine: VllmRolloutEngine) -> None:
    # vllm_engine is given one core, as a run's vLLM with engines.generation_threads=1. Left to
    # OpenMP's default, the team spanned every core of the machine and spun at each barrier.
    assert vllm_engine.call_workers("tandem_test_threads") == [{"cores": generation_cpus(1), "threads": 1}]


def requests(max_new_tokens: int, *, per_prompt: int = 2, seed: int = 0) -> list[GenerationRequest]:
    params = SamplingParams(max_new_tokens=max_new_tokens)
    return [GenerationRequest(p, i, ids, params, seed) for p, ids in enumerate(PROMPTS) for i in range(per_prompt)]


async def sample(engine: VllmRolloutEngine, batch: list[GenerationRequest]) -> list[Trajectory]:
    return sorted([t async for t in engine.generate(batch)], key=lambda t: (t.prompt_id, t.index))


async def push(
    engine: VllmRolloutEngine, probe: WeightProbe, weights: Mapping[str, torch.Tensor], version: int
) -> dict[str, float]:
    """Load ``weights`` into vLLM as ``version`` through the real path (dual buffer in shared
    memory, checksums, the workers' reload, the probe)."""
    syncer = ParamSyncer(TensorSource(weights), VllmShmTransport(lambda: [engine], probe), produce_bucket_mb=0.01)
    try:
        return await syncer.sync(version)
    finally:
        await syncer.aclose()


def snapshot(trainer: TorchTrainEngine) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in trainer.named_tensors_for_sync()}


def max_gap(a: list[float], b: list[float]) -> float:
    return float(np.abs(np.array(a) - np.array(b)).max())


async def train_on(trainer: TorchTrainEngine, samples: list[Trajectory]) -> None:
    from tests.unit.engines.trainers.test_torch_train import pg_loss

    for i, t in enumerate(samples):
        t.advantage = 1.0 if i % 2 == 0 else -1.0
    await trainer.train_step(samples, pg_loss)


@pytest.fixture
def probe(vllm_model_dir: Path) -> WeightProbe:
    return WeightProbe(vllm_model_dir, max_gap=1e-3)


async def test_log_probs_equal_the_trainers_before_and_after_each_sync(
    vllm_engine: VllmRolloutEngine, vllm_model_dir: Path, probe: WeightProbe
) -> None:
    async with TorchTrainEngine(str(vllm_model_dir), lr=5e-2, temperature=1.0) as trainer:
        version = vllm_engine.version
        for _ in range(3):
            version += 1
            metrics = await push(vllm_engine, probe, snapshot(trainer), version)
            assert vllm_engine.version == version and metrics["stall_s"] > 0
            assert probe.last_gap is not None and probe.last_gap < 1e-4
            samples = await sample(vllm_engine, requests(12))
            assert all(t.versions == [version] * 12 and t.resumed is None for t in samples)
            for t, expected in zip(samples, await trainer.logprobs(samples), strict=True):
                assert max_gap(t.behaviour_logprobs, expected) < 1e-4, (t.prompt_id, t.index)
            await train_on(trainer, samples)  # moves every weight, the tied embedding too


async def test_seeded_sampling_depends_on_the_request_alone(vllm_engine: VllmRolloutEngine) -> None:
    first = await sample(vllm_engine, requests(10))
    again = await sample(vllm_engine, requests(10)[::-1])  # another order, another batch
    assert [t.payload.response_ids for t in first] == [t.payload.response_ids for t in again]
    assert first[0].payload.response_ids != first[1].payload.response_ids  # the n samples of a group differ


async def update_in_flight(
    engine: VllmRolloutEngine, model_dir: Path, probe: WeightProbe, new_tokens: int
) -> tuple[int, list[Trajectory], list[list[float]], list[list[float]]]:
    """Serve version ``old``, start long requests, push ``old + 1`` while they are in flight (under
    ``engine.in_flight``); returns ``old``, the samples, and their log-probs under the old and the
    new weights (the trainer's, at the same weights as vLLM's)."""
    async with (
        TorchTrainEngine(str(model_dir), lr=5e-2, temperature=1.0) as trainer,
        TorchLogProbEngine(str(model_dir), temperature=1.0) as old_policy,
    ):
        old = engine.version + 1
        await push(engine, probe, snapshot(trainer), old)
        await train_on(trainer, await sample(engine, requests(8)))
        running = asyncio.ensure_future(sample(engine, requests(new_tokens, per_prompt=8)))
        await asyncio.sleep(1.0)
        assert not running.done()  # long enough to be in flight when the update is asked for
        await push(engine, probe, snapshot(trainer), old + 1)
        assert engine.version == old + 1
        samples = await asyncio.wait_for(running, timeout=60)
        return old, samples, await old_policy.logprobs(samples), await trainer.logprobs(samples)


async def test_tokens_across_a_kept_update_carry_the_version_of_the_weights_that_produced_them(
    vllm_engine: VllmRolloutEngine, vllm_model_dir: Path, probe: WeightProbe
) -> None:
    old, samples, before, after = await update_in_flight(vllm_engine, vllm_model_dir, probe, 400)
    split = [t.versions.index(old + 1) for t in samples if old + 1 in t.versions]
    assert len(split) == len(samples) and all(0 < m < 400 for m in split)  # every one spans the update
    for t, m, lp_old, lp_new in zip(samples, split, before, after, strict=True):
        assert t.versions == [old] * m + [old + 1] * (400 - m) and t.resumed is ResumePolicy.RECOMPUTE
        # Each token matches the weights that produced it: the prefix was recomputed, not kept.
        assert max_gap(t.behaviour_logprobs[:m], lp_old[:m]) < 1e-4
        assert max_gap(t.behaviour_logprobs[m:], lp_new[m:]) < 1e-4
        assert max_gap(t.behaviour_logprobs[m:], lp_old[m:]) > 1e-2  # and the update did change them


async def test_with_in_flight_wait_an_update_lands_once_the_requests_in_flight_finish_under_the_old_weights(
    vllm_engine: VllmRolloutEngine, vllm_model_dir: Path, probe: WeightProbe
) -> None:
    vllm_engine.in_flight = "wait"  # engines.vllm.in_flight=wait
    try:  # requests near the model's 512 positions: mid-way when the update is asked for
        old, samples, lp_old, lp_new = await update_in_flight(vllm_engine, vllm_model_dir, probe, 480)
    finally:
        vllm_engine.in_flight = "keep"
    # No request spans the update (with keep, every request in flight would): the ones in flight
    # finished under the old weights before it landed. (On a loaded machine vLLM may not have
    # scheduled all of them within the second; those run after it, wholly under the new weights.)
    assert all(len(set(t.versions)) == 1 and t.resumed is None for t in samples)
    waited = [i for i, t in enumerate(samples) if t.versions[0] == old]
    assert waited  # the update did wait for requests in flight
    for i, t in enumerate(samples):  # every token scores under the weights that produced it
        assert max_gap(t.behaviour_logprobs, lp_old[i] if i in waited else lp_new[i]) < 1e-4


async def test_the_probe_fails_a_sync_that_did_not_land_as_sent(
    vllm_engine: VllmRolloutEngine, vllm_model_dir: Path, probe: WeightProbe
) -> None:
    async with TorchTrainEngine(str(vllm_model_dir), lr=5e-2, temperature=1.0) as trainer:
        version = vllm_engine.version + 1
        await push(vllm_engine, probe, snapshot(trainer), version)
        await train_on(trainer, await sample(vllm_engine, requests(8)))
        vllm_engine.call_workers("tandem_test_stale_head", stale=True)  # the CPU backend's bug, unfixed
        try:
            with pytest.raises(SyncError, match="weight probe: .* differ from the trainer's weights' by up to"):
                await push(vllm_engine, probe, snapshot(trainer), version + 1)
            assert probe.last_gap is not None and probe.last_gap > 0.05
        finally:
            vllm_engine.call_workers("tandem_test_stale_head", stale=False)
        # With the fix, the same weights land and the probe agrees.
        await push(vllm_engine, probe, snapshot(trainer), version + 2)
        assert probe.last_gap is not None and probe.last_gap < 1e-4


async def test_a_transfer_naming_other_weights_is_refused_and_the_old_weights_keep_serving(
    vllm_engine: VllmRolloutEngine, vllm_model_dir: Path, probe: WeightProbe
) -> None:
    async with TorchTrainEngine(str(vllm_model_dir), lr=5e-2, temperature=1.0) as trainer:
        version = vllm_engine.version + 1
        await push(vllm_engine, probe, snapshot(trainer), version)
        weights = snapshot(trainer)
        weights["model.not_a_weight"] = weights.pop("model.norm.weight")
        with pytest.raises(SyncError, match=r"missing \['model.norm.weight'\], unknown \['model.not_a_weight'\]"):
            await push(vllm_engine, probe, weights, version + 1)
        assert vllm_engine.version == version
        samples = await sample(vllm_engine, requests(6))
        for t, expected in zip(samples, await trainer.logprobs(samples), strict=True):
            assert t.versions == [version] * 6 and max_gap(t.behaviour_logprobs, expected) < 1e-4


def test_a_model_vllm_cannot_run_fails_the_start_and_leaves_no_process(tmp_path: Path) -> None:
    import psutil
    from tiny_lm import save_tiny_model

    unsupported = save_tiny_model(tmp_path, seed=0, eos=False, heads=4)  # heads of 16 dimensions
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    environment = dict(os.environ)
    with pytest.raises(RuntimeError, match=f"vLLM cannot run {unsupported}"):
        VllmRolloutEngine(unsupported, enforce_eager=True)
    # vLLM wrote its own settings (LD_PRELOAD among them) into os.environ as it built its config:
    # the start restores the environment whole, so later child processes do not inherit them.
    assert dict(os.environ) == environment
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [p.cmdline() for p in left]


async def test_an_update_that_hangs_fails_the_sync_in_bounded_time_and_lands_whole_or_not_at_all(
    vllm_engine: VllmRolloutEngine, vllm_model_dir: Path, probe: WeightProbe, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with TorchTrainEngine(str(vllm_model_dir), lr=5e-2, temperature=1.0) as trainer:
        version = vllm_engine.version + 1
        await push(vllm_engine, probe, snapshot(trainer), version)
        await train_on(trainer, await sample(vllm_engine, requests(8)))
        monkeypatch.setattr(vllm_engine, "_update_timeout_s", 2.0)  # the run's engines.vllm.update_timeout_s
        vllm_engine.call_workers("tandem_test_hang", seconds=6.0)
        # The run's syncer outlives a failed sync (its buffer halves with it): so does this one.
        syncer = ParamSyncer(TensorSource(snapshot(trainer)), VllmShmTransport(lambda: [vllm_engine], probe))
        try:
            started = time.monotonic()
            with pytest.raises(SyncError, match=r"the update to version \d+ is still running after 2 s"):
                await syncer.sync(version + 1)
            assert time.monotonic() - started < 5.0 and vllm_engine.version == version
            # Served after the hung load ended: it landed whole, and only then did the version move.
            samples = await sample(vllm_engine, requests(6))
            assert vllm_engine.version == version + 1
        finally:
            await syncer.aclose()
        for t, expected in zip(samples, await trainer.logprobs(samples), strict=True):
            assert t.versions == [version + 1] * 6 and max_gap(t.behaviour_logprobs, expected) < 1e-4
