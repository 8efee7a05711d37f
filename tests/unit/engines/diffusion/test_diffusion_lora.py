"""The image workload with a LoRA adapter on the SD3 transformer.

Specification: only the adapter (on the attention projections by default) gets gradients, sits in
the optimizer and fills the checkpoint; the exact KL is taken against the base, the adapter
disabled; a sync moves the adapter's bytes alone, after which the rollout engine samples like the
trainer (fp32, below 1e-4) with the base never written, the previous adapter serving until the new
one commits; a sync acknowledged but not applied is caught by the denoising probe at that sync;
a resume continues as if never interrupted; the export is a LoRA file diffusers' pipeline loads,
reproducing the trained transformer, and the merged export is a generator folder that does too.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import SD3Transformer2DModel
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tandem.algorithms.flow_grpo import sde_transition, transition_kl
from tandem.core.config import AlgorithmConfig, LoraConfig, validate_config
from tandem.core.records import Trajectory
from tandem.engines.diffusion.build import image_rollout_engine, image_train_engine, image_weight_sync
from tandem.engines.diffusion.model import guided_velocity, load_generator
from tandem.engines.diffusion.payload import image_payload
from tandem.engines.diffusion.rollout import DenoiseRequest, DiffusionRolloutEngine
from tandem.engines.diffusion.train import TRAINER_STATE_FILE, DiffusionTrainEngine
from tandem.engines.shared.lora import DIFFUSERS_WEIGHTS_FILE, adapter_tensors, transformer_lora_settings
from tandem.param_sync import TransferError
from tandem.tasks.digits import MODEL_DIR, format_prompt
from tests.conftest import merge
from tests.unit.engines.diffusion.test_diffusion_components import DIGITS
from tests.unit.engines.diffusion.test_diffusion_train import Recording, flow_grpo, stepped_gradient
from tests.unit.engines.text.test_lora_sync import Dropping, HeldCommit

peft = pytest.importorskip("peft", reason="LoRA needs the lora extra (peft)")

GUIDANCE = 1.5
NOISE = 0.7
STEPS = 4
ATTENTION = {"to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"}


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def settings() -> peft.LoraConfig:
    return transformer_lora_settings(LoraConfig(rank=4), SD3Transformer2DModel, MODEL_DIR / "transformer")


def requests(count: int, seed: int = 0) -> list[DenoiseRequest]:
    """Images of digits 0, 2, 4...; odd ones on a Flow-GRPO-Fast window (ODE first and last)."""
    plans = [(True,) * STEPS, (False, True, True, False)]
    return [DenoiseRequest(i // 2, i % 2, format_prompt(i // 2 * 2), seed + i, plans[i % 2]) for i in range(count)]


def generate(engine: DiffusionRolloutEngine, batch: list[DenoiseRequest]) -> list[Trajectory]:
    async def run() -> list[Trajectory]:
        return [t async for t in engine.generate(batch)]

    return sorted(asyncio.run(run()), key=lambda t: (t.prompt_id, t.index))


@pytest.fixture(scope="module")
def trajectories() -> list[Trajectory]:
    """Eight images sampled by the base (an adapter's version 0), with advantages of both signs."""
    engine = DiffusionRolloutEngine(MODEL_DIR, noise_level=NOISE, guidance_scale=GUIDANCE, max_batch_size=4)
    try:
        done = generate(engine, requests(8, seed=500))
    finally:
        engine.close()
    return [replace(t, advantage=(-1.0) ** i * (1 + i / 8)) for i, t in enumerate(done)]


def lora_trainer(settings: peft.LoraConfig, lr: float = 1e-3, **kwargs: Any) -> DiffusionTrainEngine:
    return DiffusionTrainEngine(MODEL_DIR, lr=lr, lora=settings, **kwargs)


def train(engine: DiffusionTrainEngine, batch: list[Trajectory], objective: Any = None) -> dict[str, float]:
    return asyncio.run(engine.train_step(batch, objective or flow_grpo()))


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def test_only_the_adapter_on_the_attention_projections_trains_and_fills_the_checkpoint(
    settings: peft.LoraConfig, trajectories: list[Trajectory], tmp_path: Path
) -> None:
    engine = lora_trainer(settings)
    named = dict(engine.model.named_parameters())
    with_gradient: set[str] = set()

    def record(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        with_gradient.update(n for n, p in named.items() if p.grad is not None)
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        assert stepped == {id(p) for p in named.values() if p.requires_grad}

    handle = register_optimizer_step_pre_hook(record)
    try:
        train(engine, trajectories)
        asyncio.run(engine.save_state(tmp_path))
    finally:
        handle.remove()
        engine.close()
    trained = {n for n, p in named.items() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert with_gradient == trained  # the base gets none
    synced = dict(engine.named_tensors_for_sync())
    # Each attention projection of each of the three blocks but the last one's to_add_out (it has none).
    adapted = {n.split(".attn.")[1].rsplit(".lora_", 1)[0] for n in synced}
    assert adapted == ATTENTION and len(synced) == 2 * (3 * len(ATTENTION) - 1)
    assert nbytes(synced) < nbytes(dict(named)) / 10
    saved = torch.load(tmp_path / TRAINER_STATE_FILE, weights_only=True)
    assert saved["model"].keys() == synced.keys()  # the adapter, not the base
    moments = saved["optimizer"]["state"].values()
    assert sum(m["exp_avg"].numel() + m["exp_avg_sq"].numel() for m in moments) == 2 * sum(t.numel() for t in synced.values())


def test_the_exact_kl_is_taken_against_the_base_with_the_adapter_disabled(
    settings: peft.LoraConfig, trajectories: list[Trajectory]
) -> None:
    # The KL is quadratic in d = mean - base_mean, a difference of O(1) means, so its relative
    # float32 error is twice d's. After one step at lr 1e-3 the adapter moves the means by only
    # ~0.2 % and float noise alone put the KL 1.2e-4 (relative) off on one CPU. At lr 3e-2 d is
    # ~30x larger, as large as a full fine-tune's step at 1e-3 moves them (its KL test sees ~1e-6):
    # the gap measured here is under 1.5e-6 in every step, far inside the bound of 1e-4.
    objective = Recording(AlgorithmConfig(decoupled=False, kl_estimator="exact", kl_coef=0.5))
    engine = lora_trainer(settings, lr=3e-2, kl_reference=True, max_pairs_per_micro_batch=1000)
    try:
        first = train(engine, trajectories, objective)
        at_version_1 = copy.deepcopy(engine.model)
        second = train(engine, trajectories, objective)
        trained_logprobs = asyncio.run(engine.logprobs(trajectories))
    finally:
        engine.close()
    assert first["kl_loss"] == pytest.approx(0.0, abs=1e-9)  # a fresh adapter computes the base
    assert second["kl_loss"] > 0.0
    # By hand, between the transitions of the weights the second step started from and the base's.
    base = load_generator(MODEL_DIR)
    payload = image_payload(trajectories[0])
    cond, uncond = base.encode([payload.prompt]), base.encode([""])
    kl = objective.seen[1].kl
    assert kl is not None
    for step in range(STEPS):
        x, sigma = torch.from_numpy(payload.latents[step])[None], torch.tensor([payload.sigmas[step]])
        with torch.no_grad():
            (mean, std), (base_mean, _) = (
                sde_transition(x, guided_velocity(m, x, sigma, cond, uncond, GUIDANCE, 1000), sigma,
                               payload.sigmas[step + 1], NOISE)
                for m in (at_version_1, base.transformer)
            )  # fmt: skip
        assert float(kl[0, step].detach()) == pytest.approx(float(transition_kl(mean, base_mean, std)), rel=1e-4)
    # The adapter is enabled again after the reference's forward: scoring still uses it.
    behaviour = [t.behaviour_logprobs for t in trajectories]
    assert max(abs(a - b) for lp, bl in zip(trained_logprobs, behaviour) for a, b in zip(lp, bl)) > 1e-3


class Engines:
    """The LoRA trainer and rollout engine of a digits config and the probed sync between them, as
    the image bundle builds them (fp32, the probe's bound 1e-4); ``target`` wraps the engine's target."""

    def __init__(self, target: Any = None) -> None:
        lora = {"rank": 4, "lr": 1e-3, "probe_max_gap": 1e-4}
        config = validate_config(merge(DIGITS, {"engines": {"model_path": str(MODEL_DIR), "lora": lora}}))
        self.trainer = image_train_engine(config, num_threads=1)
        self.rollout = image_rollout_engine(config, num_threads=1)
        if target is not None:
            self.rollout.target = target(self.rollout.target)
        self.sync = image_weight_sync(config, self.trainer, self.rollout)

    def close(self) -> None:
        self.sync.close()
        self.rollout.close()
        self.trainer.close()


@contextmanager
def lora_engines(target: Any = None) -> Iterator[Engines]:
    engines = Engines(target)
    try:
        yield engines
    finally:
        engines.close()


def base_weights(engine: DiffusionRolloutEngine) -> dict[str, torch.Tensor]:
    state = engine.generator.transformer.state_dict()
    return {n: t.clone() for n, t in state.items() if ".lora_" not in n}


def test_a_sync_moves_the_adapters_bytes_and_the_engine_then_samples_like_the_trainer(trajectories: list[Trajectory]) -> None:
    with lora_engines() as e:
        adapter_bytes = nbytes(dict(e.trainer.named_tensors_for_sync()))
        base = base_weights(e.rollout)
        for version in (1, 2):
            train(e.trainer, trajectories)
            report = asyncio.run(e.sync.sync(version))
            assert report.version == e.rollout.version == version
            assert report.metrics["bytes"] == adapter_bytes < nbytes(base) / 10
            assert report.metrics["logprob_gap"] < 1e-4
        served = {n: t.clone() for n, t in adapter_tensors(e.rollout.generator.transformer).items()}
        assert all(torch.equal(served[n], t) for n, t in e.trainer.named_tensors_for_sync())  # the adapter, bit for bit
        samples = generate(e.rollout, requests(4, seed=900))
        scored = asyncio.run(e.trainer.logprobs(samples))
        after = base_weights(e.rollout)
    assert all(s.versions == [2] * STEPS for s in samples)
    assert max(abs(b - t) for s, lp in zip(samples, scored) for b, t in zip(s.behaviour_logprobs, lp)) < 1e-4
    assert all(torch.equal(after[n], t) for n, t in base.items())  # the base was never written


def test_generation_serves_the_previous_adapter_until_the_new_one_commits(trajectories: list[Trajectory]) -> None:
    with lora_engines(target=HeldCommit) as e:
        train(e.trainer, trajectories)
        before = generate(e.rollout, requests(2))

        async def sync_held() -> list[Trajectory]:
            syncing = asyncio.ensure_future(e.sync.sync(1))
            await asyncio.to_thread(e.rollout.target.reached.wait, 30)  # verified, not committed
            during = [t async for t in e.rollout.generate(requests(2))]
            e.rollout.target.release.set()
            await syncing
            return sorted(during, key=lambda t: (t.prompt_id, t.index))

        during = asyncio.run(sync_held())
        after = generate(e.rollout, requests(2))
    assert [s.behaviour_logprobs for s in during] == [s.behaviour_logprobs for s in before]
    assert all(s.versions == [0] * STEPS for s in during) and all(s.versions == [1] * STEPS for s in after)
    assert [s.behaviour_logprobs for s in after] != [s.behaviour_logprobs for s in before]


def test_a_sync_acknowledged_but_not_applied_is_caught_by_the_probe_at_that_sync(trajectories: list[Trajectory]) -> None:
    with lora_engines(target=lambda inner: Dropping(inner, drop_from=2)) as e:
        train(e.trainer, trajectories)
        assert asyncio.run(e.sync.sync(1)).metrics["logprob_gap"] < 1e-4
        train(e.trainer, trajectories)
        with pytest.raises(TransferError, match=r"version 2 .* by up to .* nats \(bound 0.0001\): the adapter did not land"):
            asyncio.run(e.sync.sync(2))
        assert e.rollout.version == 2  # the engine claims it: only the probe saw through it


def test_a_resumed_adapter_continues_as_if_never_interrupted(
    settings: peft.LoraConfig, trajectories: list[Trajectory], tmp_path: Path
) -> None:
    # Compared: the gradient of each step after the resume (not the weights after Adam's steps,
    # which amplify float noise). A resume that lost the adapter changes the first; one that lost
    # Adam's moments, the second (its step from fresh moments is lr·sign(g), not lr·m/sqrt(v)).
    first, second = trajectories[:4], trajectories[4:]
    whole, resumed = lora_trainer(settings), lora_trainer(settings)
    try:
        train(whole, first)
        asyncio.run(whole.save_state(tmp_path))
        asyncio.run(resumed.load_state(tmp_path))
        assert resumed.version == whole.version == 1
        for batch in (second, first):
            _, expected = stepped_gradient(whole, batch)
            _, gradient = stepped_gradient(resumed, batch)
            torch.testing.assert_close(gradient, expected, rtol=1e-5, atol=1e-9)
        assert resumed.version == whole.version == 3
    finally:
        whole.close()
        resumed.close()


def test_the_export_loads_into_a_diffusers_pipeline_and_the_merged_export_as_a_generator(
    settings: peft.LoraConfig, trajectories: list[Trajectory], tmp_path: Path
) -> None:
    from diffusers import StableDiffusion3Pipeline
    from safetensors import safe_open

    engine = lora_trainer(settings)
    try:
        for _ in range(2):
            train(engine, trajectories)
        asyncio.run(engine.export(tmp_path))
        asyncio.run(engine.export_merged(tmp_path / "merged"))
        names = {n for n, _ in engine.named_tensors_for_sync()}
    finally:
        engine.close()
    with safe_open(str(tmp_path / DIFFUSERS_WEIGHTS_FILE), "pt") as exported:
        assert set(exported.keys()) == {f"transformer.{n}" for n in names}  # diffusers' naming
    base = load_generator(MODEL_DIR)
    untouched = copy.deepcopy(base.transformer)
    pipeline = StableDiffusion3Pipeline(
        transformer=base.transformer, scheduler=base.scheduler, vae=None, text_encoder=None, tokenizer=None,
        text_encoder_2=None, tokenizer_2=None, text_encoder_3=None, tokenizer_3=None,
    )  # fmt: skip
    pipeline.load_lora_weights(tmp_path)
    merged = load_generator(tmp_path / "merged").transformer
    x = torch.randn(6, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    sigma = torch.linspace(0.2, 1.0, 6)
    cond = base.encode([format_prompt(d) for d in range(6)])

    def velocity(model: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return guided_velocity(model, x, sigma, cond, base.encode([""]), GUIDANCE, 1000)

    trained = velocity(engine.model)
    assert (trained - velocity(untouched)).abs().max() > 1e-3  # the adapter changed the model
    torch.testing.assert_close(velocity(pipeline.transformer), trained, rtol=0, atol=1e-6)  # alpha / rank survived
    torch.testing.assert_close(velocity(merged), trained, rtol=0, atol=1e-5)
    assert not any(".lora_" in n for n in merged.state_dict())  # a plain transformer


SMALL_RUN: dict[str, Any] = {
    "run": {"max_steps": 3, "seed": 1, "save_steps": 1, "keep_checkpoints": 3},
    "staleness": {"max_staleness": 0},
    "train": {"prompts_per_step": 2},
    "rollout": {"samples_per_prompt": 4},
    "flow": {"micro_batch_size": 2},
    "task": {"options": {"judge": "inline"}},
    "engines": {"max_batch_size": 4, "lora": {"rank": 4, "lr": 1e-2, "export_merged": True}},
    "algorithm": {"decoupled": False, "kl_estimator": "exact", "kl_coef": 0.1},
    "diffusion": {"train_steps": 5, "eval_steps": 5, "sde_window": 2, "sde_window_latest_start": 2},
    "observability": {"write_run_dir": True, "trace": False},
}


def run_flow(tmp_path: Path, name: str, **run: Any) -> Any:
    from tandem.pipeline import AsyncTrainingFlow

    config = validate_config(merge(merge(DIGITS, SMALL_RUN), {"run": {"output_dir": str(tmp_path), "name": name, **run}}))
    return asyncio.run(AsyncTrainingFlow(config).run())


@pytest.mark.slow
def test_a_lora_run_syncs_the_adapter_proven_each_time_exports_it_and_resumes_at_k0_as_if_never_stopped(
    tmp_path: Path,
) -> None:
    whole = run_flow(tmp_path, "whole")
    saved = torch.load(tmp_path / "whole" / "checkpoints" / "step_00000003" / TRAINER_STATE_FILE, weights_only=True)
    assert saved["model"] and all(".lora_A." in n or ".lora_B." in n for n in saved["model"])  # the adapter alone
    assert whole.syncs and all(s.metrics["bytes"] == nbytes(saved["model"]) for s in whole.syncs)
    assert all(s.metrics["logprob_gap"] < 1e-4 for s in whole.syncs)
    assert any(s.train_metrics["kl_loss"] > 0 for s in whole.steps[1:])  # the base as reference: a KL opened
    export = tmp_path / "whole" / "checkpoint"
    assert (export / DIFFUSERS_WEIGHTS_FILE).is_file() and load_generator(export / "merged").transformer is not None

    resumed = run_flow(tmp_path, "resumed", resume=str(tmp_path / "whole" / "checkpoints" / "step_00000001"))
    # Its first sync (at the start, of the restored adapter) was probed too: a miss would have failed the run.
    assert resumed.resumed_from_version == 1
    # Each step after the resume samples the same images (rewards) and computes the same gradient
    # before its optimizer step as the uninterrupted run's.
    after = {s.step: s for s in whole.steps if s.step >= 1}
    assert [s.step for s in resumed.steps] == sorted(after)
    for step in resumed.steps:
        assert step.reward_mean == after[step.step].reward_mean
        assert step.train_metrics["grad_norm"] == pytest.approx(after[step.step].train_metrics["grad_norm"], rel=1e-5)
