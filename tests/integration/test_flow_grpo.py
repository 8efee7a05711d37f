"""Flow-GRPO through the flow on the shipped digit generator (CPU): k = 0 is the synchronous algorithm, and it learns."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Sequence
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tandem.algorithms.flow_grpo import (
    choose_sde_window,
    flow_grpo_loss,
    flow_match_sigmas,
    ode_step,
    sde_step,
    sde_step_mask,
    sde_transition,
    transition_kl,
    transition_log_prob,
)
from tandem.core.config import TandemConfig, load_config, validate_config
from tandem.core.protocols import LossObjective
from tandem.core.records import Trajectory
from tandem.pipeline import AsyncTrainingFlow
from tandem.pipeline.builders import build_components
from tandem.state_machines.generate import request_seed
from tandem.tasks.digits import MODEL_DIR, make_task, parse_prompt
from tandem.tasks.digits.models import DigitGenerator, load_generator
from tandem.tasks.digits.reward import ocr_reward
from tandem.tasks.digits.sampling import predict_velocity, sample_images
from tests.conftest import merge

pytestmark = pytest.mark.slow

SMALL: dict[str, Any] = {
    "run": {"max_steps": 3, "seed": 1},
    "staleness": {"max_staleness": 0},
    "train": {"prompts_per_step": 2},
    "rollout": {"samples_per_prompt": 4},
    "flow": {"stages": ["dataloader", "generate", "rollout", "reward", "train"], "micro_batch_size": 2},
    "engines": {"type": "torch", "lr": 1e-3, "max_batch_size": 3, "generation_threads": 1, "train_threads": 1},
    "task": {"name": "digits", "options": {"judge": "inline"}},
    "algorithm": {"decoupled": False, "kl_estimator": "exact", "kl_coef": 0.1},
    "diffusion": {"train_steps": 5, "eval_steps": 5, "noise_level": 0.7, "guidance_scale": 1.5,
                  "sde_window": 2, "sde_window_latest_start": 2},
    "observability": {"write_run_dir": False, "trace": False},
}


def hand_written_flow_grpo(cfg: TandemConfig) -> tuple[list[list[tuple[np.ndarray, float]]], dict[str, torch.Tensor]]:
    """Flow-GRPO-Fast written out on the task's own generator, as the paper's reference loop does, with nothing of the
    flow or the engines: per step, sample every image of the step's groups with the SDE on the group's window, score
    with the OCR, GRPO advantages, one AdamW step on the clipped per-step objective plus the exact KL.

    Returns each step's (image, reward) per sample in prompt then index order, and the final weights."""
    d, algo, spec, seed = cfg.diffusion, cfg.algorithm, cfg.engines, cfg.run.seed
    per_step, n = cfg.train.prompts_per_step, cfg.rollout.samples_per_prompt
    generator = load_generator()
    policy = generator.transformer.requires_grad_(True)
    reference = DigitGenerator(copy.deepcopy(policy).requires_grad_(False), generator.prompt_encoder, generator.scheduler)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    sigmas = flow_match_sigmas(d.train_steps).tolist()
    items = make_task(judge="inline").items(seed)
    steps: list[list[tuple[np.ndarray, float]]] = []
    for step in range(cfg.run.max_steps):
        samples = []  # (digit, chain of latents, sde mask, old log-probs)
        for g, item in enumerate(islice(items, per_step)):
            prompt_id = step * per_step + g
            group_seed = int(np.random.SeedSequence([seed, prompt_id]).generate_state(1)[0])
            window = choose_sde_window(d.train_steps, d.sde_window, seed=group_seed, latest_start=d.sde_window_latest_start)
            mask = sde_step_mask(d.train_steps, window)
            for i in range(n):
                rng = torch.Generator().manual_seed(request_seed(seed, prompt_id, i))
                x = torch.randn(1, 1, 8, 8, generator=rng)
                chain, old = [x], []
                digit = torch.tensor([parse_prompt(item.prompt)])
                for t in range(d.train_steps):
                    with torch.no_grad():
                        v = predict_velocity(generator, x, torch.tensor(sigmas[t] * 1000), digit, d.guidance_scale)
                    if mask[t]:
                        noise = torch.randn(1, 1, 8, 8, generator=rng)
                        drawn = sde_step(x, v, sigmas[t], sigmas[t + 1], d.noise_level, noise=noise)
                        x = drawn.next_sample
                        old.append(drawn.log_prob)
                    else:
                        x = ode_step(x, v, sigmas[t], sigmas[t + 1])
                    chain.append(x)
                samples.append((int(digit), chain, mask, old))
        images = np.concatenate([s[1][-1].numpy() for s in samples])
        rewards = ocr_reward(images, [s[0] for s in samples])
        steps.append(list(zip(images, rewards.tolist())))
        table = rewards.reshape(per_step, n)
        advantages = ((table - table.mean(1, keepdims=True)) / (table.std(1, ddof=1, keepdims=True) + 1e-6)).reshape(-1)
        logprobs, olds, pair_advantages, kls = [], [], [], []
        for (digit, chain, mask, old), advantage in zip(samples, advantages):
            trained = [t for t in range(d.train_steps) if mask[t]]
            for t, old_logprob in zip(trained, old):
                timestep = torch.tensor(sigmas[t] * 1000)
                v = predict_velocity(generator, chain[t], timestep, torch.tensor([digit]), d.guidance_scale)
                mean, std = sde_transition(chain[t], v, sigmas[t], sigmas[t + 1], d.noise_level)
                with torch.no_grad():
                    ref_v = predict_velocity(reference, chain[t], timestep, torch.tensor([digit]), d.guidance_scale)
                ref_mean, _ = sde_transition(chain[t], ref_v, sigmas[t], sigmas[t + 1], d.noise_level)
                logprobs.append(transition_log_prob(chain[t + 1], mean, std))
                kls.append(transition_kl(mean, ref_mean, std))
                olds.append(old_logprob)
                pair_advantages.append(float(advantage))
        loss, _ = flow_grpo_loss(torch.cat(logprobs), torch.cat(olds), torch.tensor(pair_advantages), algo.clip_eps_high)
        loss = loss + algo.kl_coef * torch.cat(kls).mean()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), spec.max_grad_norm)
        optimizer.step()
    return steps, {k: v.detach().clone() for k, v in policy.state_dict().items()}


class Recording:
    """Wraps the trainer's train_step to keep every batch it saw."""

    def __init__(self, trainer: Any) -> None:
        self.batches: list[list[Trajectory]] = []
        inner = trainer.train_step

        async def train_step(
            batch: Sequence[Trajectory], objective: LossObjective, mini_batches: Sequence[Sequence[int]] | None = None
        ) -> dict[str, float]:
            self.batches.append(list(batch))
            return await inner(batch, objective, mini_batches)

        trainer.train_step = train_step


def test_k0_flow_reproduces_a_hand_written_synchronous_flow_grpo_loop() -> None:
    cfg = validate_config(SMALL)
    components = build_components(cfg)
    recorder = Recording(components.trainer)
    initial = {k: v.detach().clone() for k, v in components.trainer.model.state_dict().items()}
    try:
        result = asyncio.run(AsyncTrainingFlow(cfg, components).run())
        flow_weights = {k: v.detach().clone() for k, v in components.trainer.model.state_dict().items()}
    finally:
        components.close()
    assert len(result.steps) == 3 and result.staleness_counts == {0: 3 * 2}
    hand_steps, hand_weights = hand_written_flow_grpo(cfg)
    for batch, hand in zip(recorder.batches, hand_steps, strict=True):
        assert [(t.prompt_id, t.index) for t in batch] == sorted((t.prompt_id, t.index) for t in batch) and len(batch) == 8
        for trajectory, (image, reward) in zip(batch, hand, strict=True):
            np.testing.assert_allclose(trajectory.payload.image, image, atol=1e-4)
            assert trajectory.reward == pytest.approx(reward, abs=1e-4)
            assert set(trajectory.versions) == {batch[0].versions[0]}  # one version per step at k = 0
    update = max((flow_weights[k] - initial[k]).abs().max().item() for k in initial)
    difference = max((flow_weights[k] - hand_weights[k]).abs().max().item() for k in initial)
    # Same samples, rewards and objective; the weights differ by float rounding (other batch compositions in the
    # transformer's matmuls), which Adam amplifies where gradients are near zero: far below the update itself.
    assert update > 1e-3 and difference < 0.05 * update, (difference, update)


def heldout_reward(folder: Path, prompts: int = 100) -> float:
    """Mean OCR reward of the generator in ``folder`` on held-out prompts and noise seeds no run trains on (Euler ODE)."""
    digits = [i % 10 for i in range(prompts)]
    images = sample_images(load_generator(folder), digits, [7_000_000 + i for i in range(prompts)], num_steps=20,
                           guidance_scale=1.5)
    return float(ocr_reward(images.numpy(), digits).mean())


def test_the_shipped_job_on_a_reduced_budget_raises_the_held_out_reward(tmp_path: Path) -> None:
    cfg = load_config("configs/flow_grpo_digits.yaml", [
        "run.max_steps=30", f"run.output_dir={tmp_path}", "run.name=short", "validation.every_versions=null",
        "observability.trace=false",
    ])
    result = asyncio.run(AsyncTrainingFlow(cfg).run())
    assert len(result.steps) == 30 and result.ledger["balanced"] and max(result.staleness_counts) <= 1
    before, after = heldout_reward(MODEL_DIR), heldout_reward(tmp_path / "short" / "checkpoint")
    # Measured 0.44 -> 0.55 to 0.60 after 30 to 40 steps (tuning runs); the bar is a third of the smallest rise.
    assert after >= before + 0.04, (before, after)


def test_the_image_workload_runs_on_ray_actors(ray_cluster: Any, tmp_path: Path) -> None:
    cfg = validate_config(merge(SMALL, {
        "run": {"max_steps": 3, "output_dir": str(tmp_path), "name": "ray"},
        "staleness": {"max_staleness": 1},
        "cluster": {"backend": "ray"},
        "validation": {"every_versions": 2, "prompts": 10},
        "observability": {"write_run_dir": True},
    }))
    result = asyncio.run(AsyncTrainingFlow(cfg).run())
    assert len(result.steps) == 3 and result.ledger["balanced"] and max(result.staleness_counts) <= 1
    assert result.validations and result.validations[0].version == 0
    assert (tmp_path / "ray" / "samples" / "version_000000.png").is_file()  # drawn in the driver
    assert (tmp_path / "ray" / "checkpoint" / "model_index.json").is_file()  # exported by the trainer actor
