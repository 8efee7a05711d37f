"""Builds the embedded torch bundle from a config: model, tokenizer, engines, reward, data, sync.

Weight sync is param_sync's path (``engines.torch_sync``): the trainer's weights are gathered
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
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from engines.hf_rollout import HFRolloutEngine
from engines.protocols import SamplingParams
from engines.rl_trainer import RLTrainer
from engines.tokenizer import load_tokenizer
from engines.torch_sync import TorchWeightSync
from engines.torch_train import TorchLogProbEngine, TorchTrainEngine
from engines.verifier_reward import VerifierReward
from pipeline.components import Components, SourcePrompt
from pipeline.config import ConfigError, TandemConfig, TorchEnginesConfig

__all__ = ["build_torch_components", "resolve_model_path", "thread_budgets"]

PROJECT_ROOT = Path(__file__).resolve().parent.parent
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(path: Path) -> Path:
    """A model folder as given, else relative to the project root; an error names both tries."""
    for candidate in (path, PROJECT_ROOT / path):
        if (candidate / "config.json").is_file():
            return candidate
    raise ConfigError(f"engines.model_path: no model (config.json) at {path} or {PROJECT_ROOT / path}")


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


def _tokenize(tokenizer: Any, prompt: str) -> list[int]:
    return list(tokenizer(prompt)["input_ids"])


def task_prompts(tokenizer: Any, chunk: int = 1024) -> Any:
    """An endless prompt source from the arithmetic task's generator, chunk by chunk."""
    from tasks.arithmetic import generate_problems

    def source(seed: int) -> Iterator[SourcePrompt]:
        for block in range(1 << 62):
            for row in generate_problems(chunk, seed * 1_000_003 + block):
                yield SourcePrompt(row["prompt"], _tokenize(tokenizer, row["prompt"]), row["answer"])

    return source


def file_prompts(path: Path, tokenizer: Any) -> Any:
    """A prompt source over a JSONL or Parquet file of {"prompt", "answer"} rows (via datasets),
    reshuffled each epoch from the seed. A bad row fails here, before the run starts."""
    import datasets

    if not path.is_file():
        raise ConfigError(f"task.data_path: no such file {path}")
    kind = "parquet" if path.suffix == ".parquet" else "json"
    try:
        table = datasets.load_dataset(kind, data_files=str(path), split="train")
    except Exception as exc:  # noqa: BLE001 - datasets raises many types; name the file
        raise ConfigError(f"task.data_path: cannot read {path}: {exc}") from None
    rows: list[tuple[str, str | None]] = []
    for i, row in enumerate(table):
        prompt, answer = row.get("prompt"), row.get("answer")
        if not isinstance(prompt, str) or not prompt:
            raise ConfigError(f"task.data_path {path}: row {i} has no non-empty string 'prompt': {row!r}")
        if answer is not None and not isinstance(answer, str):
            raise ConfigError(f"task.data_path {path}: row {i}: 'answer' must be a string, got {answer!r}")
        rows.append((prompt, answer))
    if not rows:
        raise ConfigError(f"task.data_path {path}: no rows")

    def source(seed: int) -> Iterator[SourcePrompt]:
        for epoch in range(1 << 62):
            order = list(range(len(rows)))
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
            for i in order:
                prompt, answer = rows[i]
                yield SourcePrompt(prompt, _tokenize(tokenizer, prompt), answer)

    return source


def build_torch_components(config: TandemConfig) -> Components:
    """The embedded bundle for a config whose ``engines.type`` is ``torch``."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-load bars would interleave with the run's own display
    from tasks.arithmetic import verify

    spec = config.engines
    assert isinstance(spec, TorchEnginesConfig)
    model_path = str(resolve_model_path(spec.model_path))
    dtype = _DTYPES[spec.dtype]
    gen_threads, train_threads = thread_budgets(config)
    r = config.rollout
    tokenizer = load_tokenizer(model_path)
    prompts = file_prompts(config.task.data_path, tokenizer) if config.task.data_path else task_prompts(tokenizer)
    rollout = HFRolloutEngine(
        model_path, device=spec.device, dtype=dtype, max_batch_size=spec.max_batch_size,
        num_threads=gen_threads, resume_policy=spec.resume_policy,
    )
    engine = TorchTrainEngine(
        model_path, lr=spec.lr, device=spec.device, dtype=dtype, temperature=r.temperature,
        weight_decay=spec.weight_decay, warmup_steps=spec.warmup_steps, max_grad_norm=spec.max_grad_norm,
        max_tokens_per_micro_batch=spec.max_tokens_per_micro_batch, num_threads=train_threads,
        world_size=spec.train_world_size,
    )
    reference = None
    if "ref_logp" in config.flow.stages:
        reference = TorchLogProbEngine(
            model_path, device=spec.device, dtype=dtype, temperature=r.temperature,
            max_tokens_per_micro_batch=spec.max_tokens_per_micro_batch, num_threads=train_threads,
        )
    reward = VerifierReward(verify, timeout_s=config.task.reward_timeout_s)
    ps = config.param_sync
    weight_sync = TorchWeightSync.in_process(
        engine, rollout, load_mode=ps.load_mode,
        produce_bucket_mb=ps.produce_bucket_mb, consume_bucket_mb=ps.consume_bucket_mb,
    )

    async def save_checkpoint(folder: Path) -> None:
        state = await asyncio.to_thread(engine.state_dict)
        folder.mkdir(parents=True, exist_ok=True)
        engine.model.save_pretrained(folder, state_dict=state["model"])
        tokenizer.save_pretrained(folder)
        torch.save({k: v for k, v in state.items() if k != "model"}, folder / "trainer_state.pt")

    # The sync first: a sync in flight finishes against live engines before they stop.
    closers = [weight_sync.close, rollout.close, engine.close, reward.close] + ([reference.close] if reference else [])
    return Components(
        prompts=prompts,
        rollout=rollout,
        trainer=RLTrainer(engine, config.algorithm),
        reward=reward,
        weight_sync=weight_sync,
        sampling=SamplingParams(r.max_new_tokens, r.temperature, r.top_p, r.top_k, tuple(r.stop)),
        reference=reference,
        close_callbacks=closers,
        save_checkpoint=save_checkpoint,
    )
