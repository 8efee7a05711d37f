"""The image workload's bundle from config, what it refuses, and the engines on an SD3-family folder with a VAE (CPU, CUDA)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tandem.algorithms import PolicyObjective
from tandem.core.config import AlgorithmConfig, ConfigError, validate_config
from tandem.core.records import Trajectory
from tandem.engines.diffusion.build import build_image_components
from tandem.engines.diffusion.rollout import DenoiseRequest, DiffusionRolloutEngine
from tandem.engines.diffusion.train import DiffusionTrainEngine
from tandem.engines.diffusion.workflow import ImageWorkflow
from tandem.engines.shared.weight_sync import TorchWeightSync, TrainerSyncSource
from tandem.param_sync import InProcessTransport, ParamSyncer, Receiver
from tandem.pipeline.builders import build_components, with_task_model
from tests.conftest import merge

DIGITS: dict[str, Any] = {
    "task": {"name": "digits"},
    "engines": {"type": "torch", "generation_threads": 1, "train_threads": 1},
    "algorithm": {"decoupled": False},
    "flow": {"stages": ["dataloader", "generate", "rollout", "reward", "train"]},
    "diffusion": {"train_steps": 6, "eval_steps": 8, "sde_window": 2},
    "observability": {"write_run_dir": False},
}


def digits_config(**sections: Any) -> Any:
    return validate_config(merge(DIGITS, sections))


def test_a_digits_config_builds_the_image_bundle() -> None:
    components = build_components(digits_config(algorithm={"decoupled": False, "kl_estimator": "exact", "kl_coef": 0.1}))
    try:
        assert isinstance(components.workflow, ImageWorkflow)
        assert isinstance(components.trainer, DiffusionTrainEngine)
        assert components.reference is None and components.max_prompt_tokens is None
        workflow = components.workflow
        assert (workflow.train_steps, workflow.eval_steps, workflow.sde_window, workflow.with_reward) == (6, 8, 2, True)
        assert workflow.pictures is None  # no run folder
        assert components.trainer._reference is not None  # kl_estimator=exact: the engine holds the initial weights
        assert [item.prompt for item in components.held_out(3)] == [f"draw the digit {d}" for d in range(3)]
    finally:
        components.close()


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"engines": {"train_world_size": 2}}, "train_world_size"),
        ({"engines": {"rollout": "server"}}, "engines.rollout=server"),
        ({"engines": {"train": "megatron"}}, "engines.train=megatron"),
        ({"engines": {"data_parallel": "fsdp2"}}, "engines.data_parallel=fsdp2"),
        ({"algorithm": {"decoupled": False, "kl_estimator": "k3", "kl_coef": 0.1},
          "flow": {"stages": ["dataloader", "generate", "rollout", "ref_logp", "reward", "train"]}}, "exact"),
        ({"teacher": {"model_path": "tasks/arithmetic/teacher"},
          "flow": {"stages": ["dataloader", "generate", "rollout", "teacher_logp", "reward", "train"]}},
         "teacher: on-policy distillation scores tokens"),
    ],
)
def test_what_the_image_workload_does_not_do_is_refused_naming_the_field(sections: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_components(digits_config(**sections))


def test_the_config_rules_of_the_exact_kl_and_the_sde_window() -> None:
    with_ref = ["dataloader", "generate", "rollout", "ref_logp", "reward", "train"]
    exact = {"decoupled": False, "kl_estimator": "exact", "kl_coef": 0.1}
    assert digits_config(algorithm=exact).algorithm.kl_estimator == "exact"  # no ref_logp stage needed
    with pytest.raises(ConfigError, match="unused"):
        digits_config(algorithm=exact, flow={"stages": with_ref})
    with pytest.raises(ConfigError, match="kl_importance_weight"):
        digits_config(algorithm={**exact, "decoupled": True, "kl_importance_weight": True})
    with pytest.raises(ConfigError, match="sde_window"):
        digits_config(diffusion={"train_steps": 4, "sde_window": 5})
    with pytest.raises(ConfigError, match="latest_start"):
        digits_config(diffusion={"train_steps": 6, "sde_window": 2, "sde_window_latest_start": 5})
    with pytest.raises(ConfigError, match="needs diffusion.sde_window"):
        digits_config(diffusion={"sde_window": None, "sde_window_latest_start": 1})


def test_with_reward_off_is_refused_where_the_workflow_cannot_honour_it() -> None:
    from tandem.tasks.arithmetic import MODEL_DIR as TEXT_MODEL

    text = validate_config({
        "task": {"name": "arithmetic"}, "engines": {"type": "torch", "model_path": str(TEXT_MODEL)},
        "flow": {"stages": ["dataloader", "generate", "rollout", "logp", "reward", "train"]},
        "rollout": {"with_reward": False}, "observability": {"write_run_dir": False},
    })
    with pytest.raises(ConfigError, match="with_reward"):
        build_components(text)
    setup = _setup()
    images = build_image_components(with_task_model(digits_config(rollout={"with_reward": False}), setup.task), setup)
    try:
        assert images.workflow.with_reward is False
    finally:
        images.close()


def _setup() -> Any:
    from tandem.core.components import TaskSetup
    from tandem.tasks.digits import make_task

    task = make_task()
    return TaskSetup(task, task.items, reward=None)  # type: ignore[arg-type]


# ------------------------------------------------------- an SD3-family folder: 16 latent channels, a VAE


def tiny_sd3_folder(folder: Path) -> Path:
    """A random SD3 transformer (16 latent channels), an AutoencoderKL with SD3's scaling and shift, the digits prompt encoder."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    from tandem.tasks.digits.models import DigitPromptEncoder

    torch.manual_seed(0)
    SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=32,
        pos_embed_max_size=8,
    ).save_pretrained(folder / "transformer")
    AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16), latent_channels=16, layers_per_block=1, norm_num_groups=8, sample_size=16,
        scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False,
    ).save_pretrained(folder / "vae")
    encoder = DigitPromptEncoder(joint_attention_dim=32, pooled_projection_dim=32, sequence_length=4)
    encoder.save_pretrained(folder / "prompt_encoder")
    FlowMatchEulerDiscreteScheduler(shift=3.0).save_pretrained(folder / "scheduler")  # SD3's shift
    index = {
        "_class_name": "StableDiffusion3Pipeline",
        "transformer": ["diffusers", "SD3Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "prompt_encoder": ["tandem.tasks.digits.models", "DigitPromptEncoder"],
    }
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


def run_sd3_family(folder: Path, device: str, dtype: torch.dtype) -> tuple[list[Trajectory], list[list[float]], dict, int]:
    rollout = DiffusionRolloutEngine(folder, noise_level=0.7, guidance_scale=4.5, device=device, dtype=dtype, max_batch_size=3)
    trainer = DiffusionTrainEngine(folder, lr=1e-4, device=device, dtype=dtype, kl_reference=True)
    source = TrainerSyncSource(trainer)  # type: ignore[arg-type]
    sync = TorchWeightSync(source, ParamSyncer(source, InProcessTransport([Receiver(rollout.target, consume_bucket_mb=1)]),
                                               produce_bucket_mb=1))
    requests = [DenoiseRequest(0, i, f"draw the digit {i}", i, (False, True, True, False)) for i in range(4)]

    async def run() -> tuple[list[Trajectory], list[list[float]], dict, int]:
        done = sorted([t async for t in rollout.generate(requests)], key=lambda t: t.index)
        recomputed = await trainer.logprobs(done)
        batch = [replace(t, advantage=float(t.index) - 1.5) for t in done]
        objective = PolicyObjective(AlgorithmConfig(decoupled=False, kl_estimator="exact", kl_coef=0.1))
        metrics = await trainer.train_step(batch, objective)
        report = await sync.sync(1)
        return done, recomputed, metrics, report.version

    try:
        return asyncio.run(run())
    finally:
        sync.close()
        rollout.close()
        trainer.close()


def check_sd3_family(results: tuple[list[Trajectory], list[list[float]], dict, int], tolerance: float) -> None:
    trajectories, recomputed, metrics, synced = results
    for trajectory, logprobs in zip(trajectories, recomputed):
        payload = trajectory.payload
        assert payload.latents.shape == (5, 16, 8, 8) and payload.image.shape == (3, 16, 16)  # decoded by the VAE
        assert np.isfinite(payload.image).all()
        assert np.abs(np.array(logprobs) - np.array(trajectory.behaviour_logprobs)).max() < tolerance
    assert np.isfinite(metrics["loss"]) and metrics["tokens"] == 8.0 and synced == 1


def test_the_engines_run_an_sd3_family_folder_with_a_vae_on_cpu(tmp_path: Path) -> None:
    check_sd3_family(run_sd3_family(tiny_sd3_folder(tmp_path), "cpu", torch.float32), tolerance=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_engines_run_an_sd3_family_folder_on_cuda_in_bfloat16(tmp_path: Path) -> None:
    # bf16 weights and activations, float32 transition math: rollout and train agree to bf16's rounding.
    check_sd3_family(run_sd3_family(tiny_sd3_folder(tmp_path), "cuda", torch.bfloat16), tolerance=5e-2)
