"""Builds the embedded torch bundle of the text workload: model, tokenizer, engines, data, sync.

The task's items are tokenized here, as they are loaded, with the model's own tokenizer; the
task's reward comes ready from the builder (``pipeline.builders``).

Weight sync is param_sync's path (``engines.shared.weight_sync``): the trainer's weights are gathered
under its weights lock into a dual buffer and loaded into the rollout engine bucket by bucket
(``config.param_sync``), so generation keeps running until the brief switch.

Thread budgets (measured here: oversubscribing 2 cores made generation 36x slower): each
engine runs on its own worker thread with its own ``torch.set_num_threads``, which is
per-thread on this torch build. When generation overlaps training (k >= 1) they split the
cores; in the synchronous schedule (k = 0) the phases take turns, so each gets all of them.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tandem.core.components import Components, PromptSource, TaskSetup
from tandem.core.config import ConfigError, TandemConfig, TorchEnginesConfig
from tandem.core.paths import PACKAGE_ROOT
from tandem.core.protocols import SamplingParams, WeightSync
from tandem.core.records import TaskItem
from tandem.core.task import Task
from tandem.engines.shared.chat import PromptEncoder, read_chat_template
from tandem.engines.shared.lora import BaseModelReference, lora_settings, save_adapter, save_merged
from tandem.engines.shared.probe import probed_in_process
from tandem.engines.shared.tokenizer import load_tokenizer, vocabulary_difference
from tandem.engines.shared.weight_sync import TorchWeightSync
from tandem.engines.text.rollout import HFRolloutEngine
from tandem.engines.text.workflow import SingleTurnWorkflow
from tandem.engines.trainers.critic import TorchValueEngine
from tandem.engines.trainers.torch_train import (
    TEACHER_STATE_FILE,
    TorchLogProbEngine,
    TorchTrainEngine,
)

if TYPE_CHECKING:
    import peft

    from tandem.engines.trainers.group import TrainerGroup

__all__ = [
    "TORCH_DTYPES",
    "RolloutPlacement",
    "build_torch_components",
    "embedded_rollout",
    "lora_of",
    "prompt_budget",
    "prompt_encoder",
    "reference_engine",
    "resolve_model_path",
    "rollout_engine",
    "run_tokenizer",
    "sampling_params",
    "save_checkpoint",
    "save_merged_checkpoint",
    "teacher_engine",
    "teacher_path",
    "thread_budgets",
    "tokenized",
    "tokenized_held_out",
    "train_engine",
    "trainer_with_export",
    "value_engine",
]

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(path: Path | None, field: str = "engines.model_path") -> Path:
    """A model folder as given, else relative to the package root (``tandem.core.paths``); an error names
    ``field`` and both tries. (The builder fills ``engines.model_path`` from the task when the config leaves it out.)"""
    if path is None:
        raise ConfigError(f"{field}: no model given, and the task ships none")
    for candidate in (path, PACKAGE_ROOT / path):
        if (candidate / "config.json").is_file():
            return candidate
    raise ConfigError(f"{field}: no model (config.json) at {path} or {PACKAGE_ROOT / path}")


def thread_budgets(config: TandemConfig, cores: int | None = None) -> tuple[int, int]:
    """(generation threads, training threads per trainer rank) for this config on this machine."""
    spec = config.engines
    assert isinstance(spec, TorchEnginesConfig)
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = cores if config.staleness.k == 0 else max(1, cores // 2)
    # Data-parallel ranks run at once: they split the trainer's share between them.
    per_rank = max(1, share // spec.train_world_size)
    return spec.generation_threads or share, spec.train_threads or per_rank


def run_tokenizer(config: TandemConfig) -> Any:
    """The model's tokenizer as the run uses it: ``engines.chat_template`` (if given) replaces its
    template, so the prompts and the exported checkpoint carry the same one."""
    spec = config.engines
    assert isinstance(spec, TorchEnginesConfig)
    tokenizer = load_tokenizer(str(resolve_model_path(spec.model_path)))
    if spec.chat_template is not None:
        tokenizer.chat_template = read_chat_template(spec.chat_template)
    return tokenizer


def prompt_encoder(config: TandemConfig, tokenizer: Any, items: PromptSource) -> PromptEncoder:
    """The encoder of the run's prompts (``engines.shared.chat``) over ``tokenizer`` (the
    :func:`run_tokenizer`), tried on the first training item so that a chat prompt the model
    cannot render fails before any engine starts."""
    spec = config.engines
    assert isinstance(spec, TorchEnginesConfig)
    encoder = PromptEncoder(tokenizer, resolve_model_path(spec.model_path), system_prompt=config.task.system_prompt)
    first = next(iter(items(config.run.seed)), None)
    if first is not None:
        encoder(first)
    return encoder


def tokenized(items: PromptSource, encode: Callable[[TaskItem], list[int]]) -> PromptSource:
    """``items`` with each item's prompt ids from ``encode`` (the data position is kept)."""

    def source(seed: int, start: int = 0) -> Iterator[TaskItem]:
        for item in items(seed, start):
            yield replace(item, prompt_ids=encode(item))

    return source


def tokenized_held_out(task: Task, encode: Callable[[TaskItem], list[int]]) -> Callable[[int], list[TaskItem]]:
    """The task's held-out items with their prompt ids from ``encode`` (the validate role's data)."""

    def held_out(n: int) -> list[TaskItem]:
        return [replace(item, prompt_ids=encode(item)) for item in task.held_out(n)]

    return held_out


def lora_of(config: TandemConfig) -> peft.LoraConfig | None:
    """peft's settings for ``engines.lora`` on the run's model (None without it), after checking
    its targets against the model's layers: a bad one fails here, before any weights load."""
    spec = config.engines
    assert isinstance(spec, TorchEnginesConfig)
    return None if spec.lora is None else lora_settings(spec.lora, resolve_model_path(spec.model_path))


def rollout_engine(config: TandemConfig, num_threads: int) -> HFRolloutEngine:
    """The rollout engine a torch config describes, decoding on ``num_threads`` threads."""
    spec = config.engines
    assert isinstance(spec, TorchEnginesConfig)
    return HFRolloutEngine(
        str(resolve_model_path(spec.model_path)), device=spec.device, dtype=TORCH_DTYPES[spec.dtype],
        max_batch_size=spec.max_batch_size, num_threads=num_threads, resume_policy=spec.resume_policy,
        load_mode=config.param_sync.load_mode, lora=lora_of(config),
    )


def train_engine(config: TandemConfig, num_threads: int) -> TorchTrainEngine | TrainerGroup:
    """The trained policy a torch config describes, computing on ``num_threads`` threads per rank:
    a group of rank processes (``engines.trainers.group``) for several ranks, FSDP2 or megatron, else ``TorchTrainEngine``
    (with ``engines.lora``, either: an adapter at ``engines.lora.lr``, its syncs probed)."""
    spec = config.engines
    assert isinstance(spec, TorchEnginesConfig)
    if spec.trainer_group is not None:
        from tandem.engines.trainers.group import RankSpec, TrainerGroup  # only group runs pay for it

        ranks = RankSpec.from_config(config, str(resolve_model_path(spec.model_path)), num_threads, lora_of(config))
        return TrainerGroup.local(ranks, spec.train_world_size)
    lr = spec.lr if spec.lora is None or spec.lora.lr is None else spec.lora.lr
    return TorchTrainEngine(
        str(resolve_model_path(spec.model_path)), lr=lr, device=spec.device, dtype=TORCH_DTYPES[spec.dtype],
        temperature=config.rollout.temperature, weight_decay=spec.weight_decay, warmup_steps=spec.warmup_steps,
        max_grad_norm=spec.max_grad_norm, max_tokens_per_micro_batch=spec.max_tokens_per_micro_batch,
        num_threads=num_threads, lora=lora_of(config), probe=spec.lora is not None,
    )


def trainer_with_export(
    config: TandemConfig, num_threads: int, tokenizer: Any | None = None
) -> tuple[TorchTrainEngine | TrainerGroup, Export]:
    """The trained policy and its HF export (weights and the run's tokenizer, loadable by
    ``from_pretrained``): what the in-process bundle and the Ray trainer actor both hold.
    ``tokenizer``: the :func:`run_tokenizer` when the caller has it already."""
    tokenizer = run_tokenizer(config) if tokenizer is None else tokenizer
    engine = train_engine(config, num_threads)
    spec = config.engines
    assert isinstance(spec, TorchEnginesConfig)
    merged = spec.lora is not None and spec.lora.export_merged

    async def export(folder: Path) -> None:
        await asyncio.to_thread(save_checkpoint, engine, tokenizer, folder)
        if merged:
            await asyncio.to_thread(save_merged_checkpoint, config, engine, tokenizer, folder / "merged")

    return engine, export


def reference_engine(config: TandemConfig, num_threads: int) -> TorchLogProbEngine:
    """The frozen reference model a torch config describes."""
    spec = config.engines
    assert isinstance(spec, TorchEnginesConfig)
    return TorchLogProbEngine(
        str(resolve_model_path(spec.model_path)), device=spec.device, dtype=TORCH_DTYPES[spec.dtype],
        temperature=config.rollout.temperature, max_tokens_per_micro_batch=spec.max_tokens_per_micro_batch,
        num_threads=num_threads,
    )


def teacher_path(config: TandemConfig, tokenizer: Any) -> Path:
    """The teacher's checkpoint folder (``teacher.model_path``), checked before any engine starts:
    its tokenizer must be ``tokenizer`` (the student's :func:`run_tokenizer`) and its model must
    embed every id of it, or its log-probs would be of other tokens than the student sampled.
    Raises ``ConfigError`` naming ``teacher.model_path``."""
    from transformers import AutoConfig

    assert config.teacher is not None
    path = resolve_model_path(config.teacher.model_path, "teacher.model_path")
    difference = vocabulary_difference(tokenizer, load_tokenizer(str(path)))
    if difference is not None:
        raise ConfigError(
            f"teacher.model_path {path}: its tokenizer is not the student's ({difference}): the teacher "
            "would score other tokens than the ones the student sampled"
        )
    vocab_size = AutoConfig.from_pretrained(str(path)).vocab_size
    if len(tokenizer) > vocab_size:
        raise ConfigError(
            f"teacher.model_path {path}: the model's vocab_size is {vocab_size} but the tokenizer has {len(tokenizer)} tokens"
        )
    return path


def teacher_engine(config: TandemConfig, path: Path, num_threads: int) -> TorchLogProbEngine:
    """On-policy distillation's teacher at ``path`` (:func:`teacher_path`), scoring at the sampling
    temperature on a worker thread of its own with ``teacher.threads`` threads (default ``num_threads``,
    the trainer's per-rank budget, as the reference gets); saved as ``teacher.pt`` in checkpoints."""
    spec, teacher = config.engines, config.teacher
    assert isinstance(spec, TorchEnginesConfig) and teacher is not None
    return TorchLogProbEngine(
        str(path), device=spec.device, dtype=TORCH_DTYPES[spec.dtype], temperature=config.rollout.temperature,
        max_tokens_per_micro_batch=spec.max_tokens_per_micro_batch, num_threads=teacher.threads or num_threads,
        state_file=TEACHER_STATE_FILE,
    )


def value_engine(config: TandemConfig, num_threads: int) -> TorchValueEngine:
    """The critic a torch config with a critic stage describes: the task's checkpoint's decoder
    with a scalar head (``engines.trainers.critic``), trained at ``engines.critic_lr`` (default
    ``lr``); with ``engines.lora``, an adapter of its own on its decoder, with the head (default
    rate ``engines.lora.lr``, then ``lr``)."""
    spec = config.engines
    assert isinstance(spec, TorchEnginesConfig)
    lr = spec.critic_lr or (spec.lora.lr if spec.lora is not None and spec.lora.lr is not None else spec.lr)
    return TorchValueEngine(
        str(resolve_model_path(spec.model_path)), lr=lr, device=spec.device,
        dtype=TORCH_DTYPES[spec.dtype], weight_decay=spec.weight_decay, max_grad_norm=spec.max_grad_norm,
        max_tokens_per_micro_batch=spec.max_tokens_per_micro_batch, num_threads=num_threads, lora=lora_of(config),
    )


def sampling_params(config: TandemConfig) -> SamplingParams:
    r = config.rollout
    return SamplingParams(r.max_new_tokens, r.temperature, r.top_p, r.top_k, tuple(r.stop))


def prompt_budget(config: TandemConfig, tokenizer: Any) -> int:
    """Tokens a prompt may have: the model's context minus ``rollout.max_new_tokens`` (longer
    prompts are dropped at admission). Raises ``ConfigError`` when the tokenizer has ids the
    model has no embedding for, or when ``max_new_tokens`` leaves no room for a prompt."""
    from transformers import AutoConfig

    spec = config.engines
    assert isinstance(spec, TorchEnginesConfig)
    path = resolve_model_path(spec.model_path)
    model = AutoConfig.from_pretrained(str(path))
    if len(tokenizer) > model.vocab_size:
        raise ConfigError(
            f"engines.model_path {path}: the tokenizer has {len(tokenizer)} tokens but the model's "
            f"vocab_size is {model.vocab_size} (ids from {model.vocab_size} on have no embedding): "
            "the tokenizer does not belong to this model"
        )
    budget = model.max_position_embeddings - config.rollout.max_new_tokens
    if budget < 1:
        raise ConfigError(
            f"rollout.max_new_tokens={config.rollout.max_new_tokens} leaves no room for a prompt in the "
            f"model's context of {model.max_position_embeddings} tokens ({path})"
        )
    return budget


def save_checkpoint(engine: TorchTrainEngine | TrainerGroup, tokenizer: Any, folder: Path) -> None:
    """Export the trainer's weights and tokenizer, loadable by ``from_pretrained``; a LoRA
    trainer's adapter in peft's format instead, loadable by ``PeftModel.from_pretrained`` on the
    base (a group's rank 0 writes either). The optimizer and everything else a resume needs are in the run's resumable
    checkpoints (``core.checkpoint``), not here."""
    folder.mkdir(parents=True, exist_ok=True)
    if isinstance(engine, TorchTrainEngine) and engine.lora is not None:
        save_adapter(engine.model, engine.state_dict()["model"], folder)
    elif isinstance(engine, TorchTrainEngine):
        engine.model.save_pretrained(folder, state_dict=engine.state_dict()["model"])
    else:
        engine.save_pretrained(folder)  # gathered from the ranks, written by rank 0
    tokenizer.save_pretrained(folder)


def save_merged_checkpoint(
    config: TandemConfig, engine: TorchTrainEngine | TrainerGroup, tokenizer: Any, folder: Path
) -> None:
    """Export the base with the trainer's adapter merged in (``engines.lora.export_merged``) and
    the tokenizer, loadable by plain ``from_pretrained``; a group's adapter is gathered from its ranks."""
    spec = config.engines
    assert isinstance(spec, TorchEnginesConfig) and engine.lora is not None
    if isinstance(engine, TorchTrainEngine):
        adapter = engine.state_dict()["model"]
    else:
        with engine.weights_for_sync() as (_, staged):
            adapter = {name: t.clone() for name, t in staged.items()}
    save_merged(resolve_model_path(spec.model_path), engine.lora, adapter, folder, TORCH_DTYPES[spec.dtype])
    tokenizer.save_pretrained(folder)


# Writes the trained policy as a Hugging Face folder (``Components.save_checkpoint``).
Export = Callable[[Path], Awaitable[None]]
# Where generation runs, given the trainer and the generation thread budget: the rollout engine
# in this process and the weight sync that feeds it (``embedded_rollout`` here,
# ``engines.vllm.build.vllm_rollout`` for vLLM). ``engines.build`` picks one per config.
RolloutPlacement = Callable[[TandemConfig, Any, int], tuple[Any, WeightSync]]


def embedded_rollout(
    config: TandemConfig, trainer: TorchTrainEngine | TrainerGroup, threads: int
) -> tuple[HFRolloutEngine, WeightSync]:
    """The embedded engine, fed from the trainer's dual buffer in this process; with
    ``engines.lora``, the adapter alone, each sync proven by the probe (``engines.shared.probe``)."""
    rollout = rollout_engine(config, threads)
    spec, ps = config.engines, config.param_sync
    assert isinstance(spec, TorchEnginesConfig)
    try:
        if spec.lora is None:
            return rollout, TorchWeightSync.in_process(
                trainer, rollout, produce_bucket_mb=ps.produce_bucket_mb, consume_bucket_mb=ps.consume_bucket_mb
            )
        assert trainer.probe is not None
        return rollout, probed_in_process(
            trainer, rollout, trainer.probe, max_gap=spec.lora.max_gap(spec.dtype), what="the adapter",
            produce_bucket_mb=ps.produce_bucket_mb, consume_bucket_mb=ps.consume_bucket_mb,
        )  # fmt: skip
    except BaseException:
        rollout.close()
        raise


def build_torch_components(
    config: TandemConfig, setup: TaskSetup, place_rollout: RolloutPlacement = embedded_rollout
) -> Components:
    """The text workload's bundle with generation in this process (``place_rollout``) and the
    trainer, reference, teacher and critic as ``engines.train`` says; ``engines.build`` calls it."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-load bars would interleave with the run's own display
    spec = config.engines
    assert isinstance(spec, TorchEnginesConfig)
    gen_threads, train_threads = thread_budgets(config)
    tokenizer = run_tokenizer(config)
    max_prompt_tokens = prompt_budget(config, tokenizer)  # before any engine starts: bad input fails fast
    teaching = teacher_path(config, tokenizer) if config.teacher is not None else None  # likewise
    encode = prompt_encoder(config, tokenizer, setup.items)
    engine, checkpoint = trainer_with_export(config, train_threads, tokenizer)
    reference: TorchLogProbEngine | BaseModelReference | None = None
    if "ref_logp" in config.flow.stages and spec.lora is not None:
        reference = engine.base_reference()  # the base, adapter disabled: no second copy of the model
    elif "ref_logp" in config.flow.stages:
        reference = reference_engine(config, train_threads)
    teacher = teacher_engine(config, teaching, train_threads) if teaching is not None else None
    critic = value_engine(config, train_threads) if "critic" in config.flow.stages else None
    rollout, weight_sync = place_rollout(config, engine, gen_threads)

    # The sync first: a sync in flight finishes against live engines before they stop.
    closers = [weight_sync.close, rollout.close, engine.close]
    closers += [reference.close] if isinstance(reference, TorchLogProbEngine) else []
    closers += [beside.close for beside in (teacher, critic) if beside is not None]
    return Components(
        prompts=tokenized(setup.items, encode),
        held_out=tokenized_held_out(setup.task, encode),
        workflow=SingleTurnWorkflow(rollout, sampling_params(config)),
        trainer=engine,
        reward=setup.reward,
        weight_sync=weight_sync,
        reference=reference,
        teacher=teacher,
        critic=critic,
        close_callbacks=closers,
        save_checkpoint=checkpoint,
        max_prompt_tokens=max_prompt_tokens,
    )
