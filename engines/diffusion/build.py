"""Builds the embedded bundle of the image workload: generator engines, Flow-GRPO sampling, weight sync.

The rollout engine (``engines.diffusion.rollout``) and the train engine
(``engines.diffusion.train``) each load the generator the task ships (or
``engines.model_path``); the workflow samples with the ``diffusion`` section's plan; weights
move by param_sync's path (``engines.shared.weight_sync``: the trainer's weights gathered under its
weights lock into a dual buffer and loaded into the rollout engine's ``target`` bucket by
bucket, between denoising steps). With ``engines.lora`` both engines carry a peft adapter on
the transformer: only the adapter trains and moves, each sync proven by the denoising probe
(``engines.diffusion.probe``), and the export is diffusers' LoRA file (plus, with
``engines.lora.export_merged``, the merged generator in ``merged/``). The task's items and
held-out set pass through as they are (an image prompt has no tokens); the reward comes ready
from the builder.

Thread budgets are the text workload's (``engines.text.build.thread_budgets``): split
the cores when generation overlaps training (k >= 1), all of them each when they take turns.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.core.components import Components, TaskSetup
from tandem.core.config import ConfigError, TandemConfig, TorchEnginesConfig
from tandem.core.paths import PACKAGE_ROOT
from tandem.core.protocols import WeightSync
from tandem.engines.diffusion.model import MODEL_INDEX, component_class, read_model_index
from tandem.engines.diffusion.rollout import DiffusionRolloutEngine
from tandem.engines.diffusion.train import DiffusionTrainEngine
from tandem.engines.diffusion.workflow import ImageWorkflow
from tandem.engines.shared.lora import transformer_lora_settings
from tandem.engines.shared.probe import probed_in_process
from tandem.engines.shared.weight_sync import TorchWeightSync
from tandem.engines.text.build import TORCH_DTYPES, thread_budgets

if TYPE_CHECKING:
    import peft

__all__ = [
    "build_image_components",
    "check_image_config",
    "image_lora_of",
    "image_rollout_engine",
    "image_train_engine",
    "image_weight_sync",
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
    if "ref_logp" in config.flow.stages:
        raise ConfigError(
            "flow.stages: the image workload's KL is exact (algorithm.kl_estimator=exact, computed by the train "
            "engine against the initial weights): drop the ref_logp stage"
        )
    if config.teacher is not None:
        raise ConfigError("teacher: on-policy distillation scores tokens; the image workload's actions are denoising steps")
    return spec


def image_lora_of(config: TandemConfig) -> peft.LoraConfig | None:
    """peft's settings for ``engines.lora`` on the generator's transformer (None without it), after
    checking its targets against the transformer's layers: a bad one fails here, before any weights load."""
    spec = check_image_config(config)
    if spec.lora is None:
        return None
    folder = resolve_generator_path(spec.model_path)
    model_class = component_class(*read_model_index(folder)["transformer"])
    return transformer_lora_settings(spec.lora, model_class, folder / "transformer")


def image_rollout_engine(config: TandemConfig, num_threads: int) -> DiffusionRolloutEngine:
    spec = check_image_config(config)
    return DiffusionRolloutEngine(
        resolve_generator_path(spec.model_path), noise_level=config.diffusion.noise_level,
        guidance_scale=config.diffusion.guidance_scale, device=spec.device, dtype=TORCH_DTYPES[spec.dtype],
        max_batch_size=spec.max_batch_size, num_threads=num_threads, load_mode=config.param_sync.load_mode,
        lora=image_lora_of(config),
    )


def image_trainer_with_export(
    config: TandemConfig, num_threads: int
) -> tuple[DiffusionTrainEngine, Callable[[Path], Awaitable[None]]]:
    """The image trainer and its export (the generator folder; with ``engines.lora``, the adapter
    and, on request, the merged generator in ``merged/``), as the in-process bundle and the Ray
    trainer actor hold them."""
    engine = image_train_engine(config, num_threads)
    spec = check_image_config(config)
    merged = spec.lora is not None and spec.lora.export_merged

    async def export(folder: Path) -> None:
        await engine.export(folder)
        if merged:
            await engine.export_merged(folder / "merged")

    return engine, export


def image_train_engine(config: TandemConfig, num_threads: int) -> DiffusionTrainEngine:
    """The image trainer (with ``engines.lora``: an adapter at ``engines.lora.lr``, its probe recorded)."""
    spec = check_image_config(config)
    algo = config.algorithm
    lr = spec.lr if spec.lora is None or spec.lora.lr is None else spec.lora.lr
    return DiffusionTrainEngine(
        resolve_generator_path(spec.model_path), lr=lr, device=spec.device, dtype=TORCH_DTYPES[spec.dtype],
        weight_decay=spec.weight_decay, warmup_steps=spec.warmup_steps, max_grad_norm=spec.max_grad_norm,
        max_pairs_per_micro_batch=config.diffusion.max_pairs_per_micro_batch, num_threads=num_threads,
        kl_reference=algo.kl_estimator == "exact" and algo.kl_coef > 0, lora=image_lora_of(config),
        probe=spec.lora is not None,
    )


def image_weight_sync(config: TandemConfig, trainer: DiffusionTrainEngine, rollout: DiffusionRolloutEngine) -> WeightSync:
    """The trainer's weights into the rollout engine in this process; with ``engines.lora``, the
    adapter alone, each sync proven by the probe (a gap above ``engines.lora.probe_max_gap`` fails it)."""
    spec, ps = check_image_config(config), config.param_sync
    if spec.lora is None:
        return TorchWeightSync.in_process(
            trainer, rollout, produce_bucket_mb=ps.produce_bucket_mb, consume_bucket_mb=ps.consume_bucket_mb
        )
    assert trainer.probe is not None
    return probed_in_process(
        trainer, rollout, trainer.probe, max_gap=spec.lora.max_gap(spec.dtype), what="the adapter",
        produce_bucket_mb=ps.produce_bucket_mb, consume_bucket_mb=ps.consume_bucket_mb,
    )  # fmt: skip


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
        trainer, export = image_trainer_with_export(config, train_threads)
    except BaseException:
        rollout.close()
        raise
    weight_sync = image_weight_sync(config, trainer, rollout)
    # The sync first: a sync in flight finishes against live engines before they stop.
    return Components(
        prompts=setup.items,
        held_out=setup.task.held_out,
        workflow=image_workflow(config, rollout),
        trainer=trainer,
        reward=setup.reward,
        weight_sync=weight_sync,
        close_callbacks=[weight_sync.close, rollout.close, trainer.close],
        save_checkpoint=export,
    )
