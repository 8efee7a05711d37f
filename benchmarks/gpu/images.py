"""Images: Flow-GRPO on an SD3-family transformer of a few hundred million parameters, on one GPU.

Every image figure tandem publishes comes from the digits task's 1M-parameter generator on CPU;
MM-GRPO and GeRL report theirs on SD3.5-medium on GPUs. This part runs tandem's own image
workload (``engines/diffusion``, ``tasks/digits``, the shipped Flow-GRPO jobs) unchanged with
a transformer of realistic width and depth in bfloat16, and measures:

- ``rollout_images_per_s``: one step's images (``train.prompts_per_step`` x
  ``rollout.samples_per_prompt``, Flow-GRPO-Fast's sampling plan) denoised through the rollout
  workflow, warm, with the engine's continuous batching of ``engines.max_batch_size`` images;
- ``train_step_s``: one Flow-GRPO train step on those images, warm: the per-step log-probs
  recomputed with guidance on the SDE window's steps, the exact KL to the frozen initial
  transformer, backward and AdamW;
- the schedule: the shipped colocated synchronous job (``flow_grpo_digits_colocated``:
  generation and training take turns) against the shipped one-step-off job
  (``flow_grpo_digits``: k = 1, both engines at once on the one GPU), each trained for the same
  number of steps from a fresh build, reward included (the task's OCR judge, under a
  millisecond an image): samples/s each and their ratio. The jobs differ as shipped, the
  asynchronous reward on only in the one-step-off one: the ratio is ``benchmarks/flow_grpo.py``'s
  ``speedup_combined``, with the cheap judge.

Why the width and depth are scaled and not the image: the digits task fixes the shapes. Its
judge classifies 8x8 one-channel images, which are the generator's latents (no VAE), and its
prompt encoder emits 64-wide conditioning; so the transformer keeps ``sample_size=8``,
``in_channels=1``, 2x2 patches (16 image tokens and one text token per row) and 64-wide
conditioning, and takes SD3.5-medium's width (24 heads of 64, RMS qk-norm, dual attention in
its first blocks) over 4 blocks instead of 24: about 350 M parameters, built from config with
random weights and saved as a model folder in the shipped generator's layout (diffusers'
pipeline folders, the shipped prompt encoder and scheduler beside it). With so few tokens a
row, the figures weigh the engines' per-step host work and the weight traffic more than
SD3.5-medium's 1024-token images would: they measure the machinery at this model size, not
matmul-bound throughput.

Tiny mode runs the same code on CPU with a two-block transformer of width 32, smaller steps
and fewer of them, so the part cannot rot between GPUs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gpu.common import Scale, Skipped, timed
from tandem.algorithms import PolicyObjective
from tandem.core.components import Components
from tandem.core.config import TandemConfig
from tandem.core.protocols import RolloutRequest
from tandem.core.records import PromptGroup, Trajectory
from tandem.pipeline import AsyncTrainingFlow, load_config
from tandem.pipeline.builders import build_components
from tandem.state_machines.generate import request_seed

if TYPE_CHECKING:  # imported when run, once diffusers is known to be there
    from diffusers import SD3Transformer2DModel

__all__ = ["FULL", "TINY", "Size", "build_transformer", "run"]

SYNC_CONFIG = "flow_grpo_digits_colocated"  # the shipped baseline: k = 0, generation and training take turns
K1_CONFIG = "flow_grpo_digits"  # the shipped job: one-step-off, asynchronous reward


@dataclass(frozen=True, slots=True)
class Size:
    """The transformer's width and depth, how long each measurement runs, and the batch shape."""

    heads: int
    head_dim: int
    layers: int
    dual_attention_layers: tuple[int, ...]  # SD3.5's MMDiT-X blocks (a second self-attention on the image)
    timed_rollouts: int  # rollouts of one step's images timed, after one warm-up
    timed_train_steps: int  # train steps timed, after one warm-up
    flow_steps: int  # train steps of each schedule's run
    overrides: tuple[str, ...] = ()  # changes to the shipped jobs' batch shape


# On an H100 (estimated, not yet measured): a flow step of 64 images at 10 denoising steps is
# 40 batched forwards of ~5 ms (host-bound at 17 tokens a row) plus a train step of 192 (image,
# step) pairs, about 0.5 s; 4 + 4 warm and timed steps and 2 x 24 flow steps, with three builds
# of the engines (~3 s each: rollout, trainer and its frozen reference) and the folder, stay
# within about 90 s.
FULL = Size(heads=24, head_dim=64, layers=4, dual_attention_layers=(0, 1),
            timed_rollouts=3, timed_train_steps=3, flow_steps=24)  # fmt: skip
# Tiny: 2 prompts x 4 samples, 4 denoising steps (SDE on a window of 2), 4 images a batch, one
# thread per engine (as the text part's tiny mode, for the same reason).
TINY = Size(heads=2, head_dim=16, layers=2, dual_attention_layers=(0,),
            timed_rollouts=1, timed_train_steps=1, flow_steps=3,
            overrides=("train.prompts_per_step=2", "rollout.samples_per_prompt=4", "flow.micro_batch_size=2",
                       "engines.max_batch_size=4", "diffusion.train_steps=4", "diffusion.sde_window=2",
                       "diffusion.sde_window_latest_start=2", "engines.generation_threads=1",
                       "engines.train_threads=1"))  # fmt: skip


def run(scale: Scale) -> dict[str, Any]:
    """Build the generator folder, time rollout and training warm, then run both schedules."""
    try:
        import diffusers  # noqa: F401  (the diffusion engines and the digits models import it)
    except ImportError as err:
        raise Skipped(f"diffusers is not installed ({err}); install the wheel shipped beside the check") from None
    size = TINY if scale.tiny else FULL
    folder = scale.workdir / "sd3_digits"
    (params, transformer_config), build_s = timed(lambda: save_generator(folder, size, scale), scale.device)
    overrides = [
        f"engines.model_path={folder}", f"engines.device={scale.device}", f"engines.dtype={scale.dtype_name}",
        f"run.output_dir={scale.workdir / 'runs'}", f"run.max_steps={size.flow_steps}", "validation.every_versions=null",
        "observability.write_run_dir=false", "observability.trace=false", "observability.metrics_port=null",
        *size.overrides,
    ]  # fmt: skip
    sync_config = load_config(SYNC_CONFIG, overrides)
    k1_config = load_config(K1_CONFIG, overrides)
    engines = engine_figures(sync_config, size, scale.device)  # also warms the process (CUDA context, cuBLAS)
    sync = schedule_figures(sync_config)
    k1 = schedule_figures(k1_config)
    d = sync_config.diffusion
    side = transformer_config["sample_size"]
    return {
        "params": params,
        "transformer": transformer_config,
        "dtype": scale.dtype_name,
        "build_s": build_s,
        **engines,
        "sync_samples_per_s": sync["samples_per_s"],
        "k1_samples_per_s": k1["samples_per_s"],
        "k1_over_sync": k1["samples_per_s"] / sync["samples_per_s"],
        "sync_wall_s": sync["wall_s"],
        "k1_wall_s": k1["wall_s"],
        "k1_staleness_counts": k1["staleness_counts"],
        "flow_steps": size.flow_steps,
        "timed_rollouts": size.timed_rollouts,
        "timed_train_steps": size.timed_train_steps,
        "images_per_step": sync_config.train.prompts_per_step * sync_config.rollout.samples_per_prompt,
        "denoising_steps": d.train_steps,
        "sde_window": d.sde_window,
        "max_batch_size": sync_config.engines.max_batch_size,  # type: ignore[union-attr]
        "latent_shape": [transformer_config["in_channels"], side, side],
        "tokens_per_row": (side // transformer_config["patch_size"]) ** 2 + 1,  # image patches and one text token
    }


def save_generator(folder: Path, size: Size, scale: Scale) -> tuple[int, dict[str, Any]]:
    """Save the digits generator with its transformer swapped for one of ``size`` (random weights, in
    ``scale.dtype``) into ``folder``; return its parameter count and config."""
    from tandem.tasks.digits.models import load_generator

    # Initialised on the device: a few hundred million random weights are seconds of CPU time.
    with scale.device:
        transformer = build_transformer(size)
    # nn.Module.to: diffusers' own `to` warns on every dtype cast, though SD3 keeps no module in float32.
    transformer = nn.Module.to(nn.Module.to(transformer, scale.dtype), "cpu")
    dataclasses.replace(load_generator(), transformer=transformer).save(folder)
    config = {k: list(v) if isinstance(v, tuple) else v for k, v in transformer.config.items() if not k.startswith("_")}
    return sum(p.numel() for p in transformer.parameters()), config


def build_transformer(size: Size) -> SD3Transformer2DModel:
    """An ``SD3Transformer2DModel`` of ``size`` for the digits task's latents and prompt encoder
    (``tasks.digits.models.build_transformer`` with the width and depth scaled)."""
    from diffusers import SD3Transformer2DModel

    from tandem.tasks.digits import IMAGE_SIZE
    from tandem.tasks.digits.models import JOINT_ATTENTION_DIM, POOLED_PROJECTION_DIM

    patch = 2
    return SD3Transformer2DModel(
        sample_size=IMAGE_SIZE,
        patch_size=patch,
        in_channels=1,
        out_channels=1,
        num_layers=size.layers,
        attention_head_dim=size.head_dim,
        num_attention_heads=size.heads,
        joint_attention_dim=JOINT_ATTENTION_DIM,  # the shipped prompt encoder's width
        caption_projection_dim=size.heads * size.head_dim,  # SD3 requires it equal to the inner width
        pooled_projection_dim=POOLED_PROJECTION_DIM,
        pos_embed_max_size=IMAGE_SIZE // patch,
        qk_norm="rms_norm",  # as in SD3.5
        dual_attention_layers=size.dual_attention_layers,
    )


def engine_figures(config: TandemConfig, size: Size, device: torch.device) -> dict[str, Any]:
    """Rollout images/s and train-step seconds of the config's engines, each warmed by one untimed call."""
    components = build_components(config)
    try:
        with asyncio.Runner() as runner:
            requests = step_requests(config, components)
            runner.run(rollout(components, requests))
            rollouts = [timed(lambda: runner.run(rollout(components, requests)), device) for _ in range(size.timed_rollouts)]
            trajectories = rollouts[-1][0]
            # Stand-ins for GRPO's advantages (their values change no compute): half the images pushed up, half down.
            for i, trajectory in enumerate(trajectories):
                trajectory.advantage = 1.0 if i % 2 else -1.0
            objective = PolicyObjective(config.algorithm, config.algorithm.proximal)

            def train_step() -> dict[str, float]:
                return runner.run(components.trainer.train_step(trajectories, objective))

            train_step()
            steps = [timed(train_step, device) for _ in range(size.timed_train_steps)]
    finally:
        components.close()
    rollout_s = sum(seconds for _, seconds in rollouts)
    return {
        "rollout_images_per_s": len(requests) * len(rollouts) / rollout_s,
        "rollout_s": rollout_s / len(rollouts),
        "train_step_s": sum(seconds for _, seconds in steps) / len(steps),
        "train_pairs_per_step": sum(t.num_trained for t in trajectories),
    }


def step_requests(config: TandemConfig, components: Components) -> list[RolloutRequest]:
    """One train step's requests: the first prompts of the run's item stream, each sampled as the flow samples it."""
    items = itertools.islice(components.prompts(config.run.seed), config.train.prompts_per_step)
    groups = [PromptGroup(i, item, config.rollout.samples_per_prompt) for i, item in enumerate(items)]
    return [RolloutRequest(g, j, request_seed(config.run.seed, g.prompt_id, j)) for g in groups for j in range(g.n)]


async def rollout(components: Components, requests: list[RolloutRequest]) -> list[Trajectory]:
    return [t async for t in components.workflow.rollout(requests)]


def schedule_figures(config: TandemConfig) -> dict[str, Any]:
    """Train the config's job from a fresh build for ``run.max_steps`` steps: samples/s over the flow's wall time."""
    components = build_components(config)
    try:
        result = asyncio.run(AsyncTrainingFlow(config, components).run())
    finally:
        components.close()
    return {
        "samples_per_s": result.samples_per_s,
        "wall_s": result.wall_s,
        "staleness_counts": {str(k): v for k, v in result.staleness_counts.items()},
    }
