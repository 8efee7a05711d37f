"""Builds the embedded bundle of the image workload: generator engines, Flow-GRPO sampling, weight sync.

The rollout engine (``engines.diffusion.rollout``) and the train engine
(``engines.diffusion.train``) each load the generator the task ships (or
``engines.model_path``); the workflow samples with the ``diffusion`` section's plan; weights
move by param_sync's path (``engines.shared.weight_sync``: the trainer's weights gathered under its
weights lock into a dual buffer and loaded into the rollout engine's ``target`` bucket by
bucket, between denoising steps). The task's items and held-out set pass through as they are
(an image prompt has no tokens); the reward comes ready from the builder.

Thread budgets are the text workload's (``engines.text.build.thread_budgets``): split
the cores when generation overlaps training (k >= 1), all of them each when they take turns.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from tandem.core.components import Components, TaskSetup
from tandem.core.config import ConfigError, TandemConfig, TorchEnginesConfig
from tandem.core.paths import PACKAGE_ROOT
from tandem.engines.diffusion.model import MODEL_INDEX
from tandem.engines.diffusion.rollout import DiffusionRolloutEngine
from tandem.engines.diffusion.train import DiffusionTrainEngine
from tandem.engines.diffusion.workflow import ImageWorkflow
from tandem.engines.shared.weight_sync import TorchWeightSync
from tandem.engines.text.build import TORCH_DTYPES, thread_budgets

__all__ = [
    "build_image_components",
    "check_image_config",
    "image_rollout_engine",
    "image_train_engine",
    "image_workflow",
    "resolve_generator_path",
]


def resolve_generator_path(path: Path | None) -> Path:
    """A generator folder (with ``model_index.json``) as given, else relative to the package root (``tandem.core.resources``)."""
    if path is None:
        raise ConfigError("engines.model_path: no model given, and the task ships none")
    for candidate in (path, PACKAGE_ROOT / path):
        if (candidate / MODEL_INDEX).is_file():
            return candidate
    raise ConfigError(f"engines.model_path: no generator ({MODEL_INDEX}) at {path} or {PACKAGE_ROOT / path}")


def check_image_config(config: TandemConfig) -> TorchEnginesConfig:
    """The torch engines' section, after refusing what the image workload does not do (naming the field)."""
    spec = config.engines
    if not isinstance(spec, TorchEnginesConfig):
        raise ConfigError("the image workload runs on engines.type=torch")
    if spec.rollout != "embedded":
        raise ConfigError(f"engines.rollout={spec.rollout}: the image workload samples with the embedded diffusers engine")
    if spec.train_world_size != 1:
        raise ConfigError("engines.train_world_size: the image train engine runs one rank (data parallelism is text-only)")
    if spec.train != "torch" or spec.data_parallel != "ddp":
        raise ConfigError(
            f"engines.train={spec.train}, engines.data_parallel={spec.data_parallel}: the image workload trains with "
            "its own diffusers engine (engines.train=torch, engines.data_parallel=ddp)"
        )
    if spec.lora is not None:
        raise ConfigError("engines.lora: adapters train on the text workloads only (not yet on the image trainer)")
    if "ref_logp" in config.flow.stages:
        raise ConfigError(
            "flow.stages: the image workload's KL is exact (algorithm.kl_estimator=exact, computed by the train "
            "engine against the initial weights): drop the ref_logp stage"
        )
    if config.teacher is not None:
        raise ConfigError("teacher: on-policy distillation scores tokens; the image workload's actions are denoising steps")
    return spec


def image_rollout_engine(config: TandemConfig, num_threads: int) -> DiffusionRolloutEngine:
    spec = check_image_config(config)
    return DiffusionRolloutEngine(
        resolve_generator_path(spec.model_path), noise_level=config.diffusion.noise_level,
        guidance_scale=config.diffusion.guidance_scale, device=spec.device, dtype=TORCH_DTYPES[spec.dtype],
        max_batch_size=spec.max_batch_size, num_threads=num_threads, load_mode=config.param_sync.load_mode,
    )


def image_trainer_with_export(
    config: TandemConfig, num_threads: int
) -> tuple[DiffusionTrainEngine, Callable[[Path], Awaitable[None]]]:
    """The image trainer and its export (the generator folder), as the Ray trainer actor holds them."""
    engine = image_train_engine(config, num_threads)
    return engine, engine.export


def image_train_engine(config: TandemConfig, num_threads: int) -> DiffusionTrainEngine:
    spec = check_image_config(config)
    algo = config.algorithm
    return DiffusionTrainEngine(
        resolve_generator_path(spec.model_path), lr=spec.lr, device=spec.device, dtype=TORCH_DTYPES[spec.dtype],
        weight_decay=spec.weight_decay, warmup_steps=spec.warmup_steps, max_grad_norm=spec.max_grad_norm,
        max_pairs_per_micro_batch=config.diffusion.max_pairs_per_micro_batch, num_threads=num_threads,
        kl_reference=algo.kl_estimator == "exact" and algo.kl_coef > 0,
    )


def image_workflow(config: TandemConfig, engine: DiffusionRolloutEngine | object) -> ImageWorkflow:
    """The workflow over ``engine``; pictures of each evaluation go to the run folder's ``samples/``."""
    d = config.diffusion
    writes = config.observability.write_run_dir and config.validation.every_versions is not None
    return ImageWorkflow(
        engine,  # type: ignore[arg-type]
        train_steps=d.train_steps, eval_steps=d.eval_steps, sde_window=d.sde_window,
        sde_window_latest_start=d.sde_window_latest_start, seed=config.run.seed,
        with_reward=config.rollout.with_reward,
        pictures=config.run.output_dir / config.run.name / "samples" if writes else None,
    )


def build_image_components(config: TandemConfig, setup: TaskSetup) -> Components:
    """The embedded bundle of the image workload, for a config whose ``engines.type`` is ``torch``."""
    check_image_config(config)
    gen_threads, train_threads = thread_budgets(config)
    rollout = image_rollout_engine(config, gen_threads)
    try:
        trainer = image_train_engine(config, train_threads)
    except BaseException:
        rollout.close()
        raise
    ps = config.param_sync
    weight_sync = TorchWeightSync.in_process(
        trainer, rollout, produce_bucket_mb=ps.produce_bucket_mb, consume_bucket_mb=ps.consume_bucket_mb
    )
    # The sync first: a sync in flight finishes against live engines before they stop.
    return Components(
        prompts=setup.items,
        held_out=setup.task.held_out,
        workflow=image_workflow(config, rollout),
        trainer=trainer,
        reward=setup.reward,
        weight_sync=weight_sync,
        close_callbacks=[weight_sync.close, rollout.close, trainer.close],
        save_checkpoint=trainer.export,
    )
