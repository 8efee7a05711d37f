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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from engines.hf_rollout import HFRolloutEngine
from core.protocols import SamplingParams
from engines.rl_trainer import RLTrainer
from engines.tokenizer import load_tokenizer
from engines.torch_sync import TorchWeightSync
from engines.torch_train import TorchLogProbEngine, TorchTrainEngine
from engines.verifier_reward import VerifierReward
from core.components import Components, SourcePrompt
from core.config import ConfigError, TandemConfig, TorchEnginesConfig

__all__ = [
    "build_torch_components",
    "held_out_prompts",
    "prompt_budget",
    "prompt_source",
    "reference_engine",
    "resolve_model_path",
    "rollout_engine",
    "sampling_params",
    "save_checkpoint",
    "thread_budgets",
    "train_engine",
    "verifier_reward",
]

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


def held_out_prompts(tokenizer: Any) -> Callable[[int], list[SourcePrompt]]:
    """The task's held-out evaluation set: the problems pretraining reported its accuracy on,
    drawn from a seed no run trains on (the validate role's data stream)."""
    from tasks.arithmetic import generate_problems
    from tasks.arithmetic.pretrain import REPORT_SEED

    def held_out(n: int) -> list[SourcePrompt]:
        rows = generate_problems(n, REPORT_SEED)
        return [SourcePrompt(row["prompt"], _tokenize(tokenizer, row["prompt"]), row["answer"]) for row in rows]

    return held_out


def file_prompts(path: Path, tokenizer: Any) -> Any:
    """A prompt source over a JSONL or Parquet file of {"prompt", "answer"} rows (via datasets),
    reshuffled each epoch from the seed. A bad row fails here, before the run starts."""
    import datasets

    if not path.is_file():
        raise ConfigError(f"task.data_path: no such file {path}")
    kind = "parquet" if path.suffix == ".parquet" else "json"
    try:
        table = datasets.load_dataset(kind, data_files=str(path), split="train")
    except Exception as exc:
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


def rollout_engine(config: TandemConfig, num_threads: int) -> HFRolloutEngine:
    """The rollout engine a torch config describes, decoding on ``num_threads`` threads."""
    spec = config.engines
    assert isinstance(spec, TorchEnginesConfig)
    return HFRolloutEngine(
        str(resolve_model_path(spec.model_path)), device=spec.device, dtype=_DTYPES[spec.dtype],
        max_batch_size=spec.max_batch_size, num_threads=num_threads, resume_policy=spec.resume_policy,
    )


def train_engine(config: TandemConfig, num_threads: int) -> TorchTrainEngine:
    """The trained policy a torch config describes, computing on ``num_threads`` threads per rank."""
    spec = config.engines
    assert isinstance(spec, TorchEnginesConfig)
    return TorchTrainEngine(
        str(resolve_model_path(spec.model_path)), lr=spec.lr, device=spec.device, dtype=_DTYPES[spec.dtype],
        temperature=config.rollout.temperature, weight_decay=spec.weight_decay, warmup_steps=spec.warmup_steps,
        max_grad_norm=spec.max_grad_norm, max_tokens_per_micro_batch=spec.max_tokens_per_micro_batch,
        num_threads=num_threads, world_size=spec.train_world_size,
    )


def reference_engine(config: TandemConfig, num_threads: int) -> TorchLogProbEngine:
    """The frozen reference model a torch config describes."""
    spec = config.engines
    assert isinstance(spec, TorchEnginesConfig)
    return TorchLogProbEngine(
        str(resolve_model_path(spec.model_path)), device=spec.device, dtype=_DTYPES[spec.dtype],
        temperature=config.rollout.temperature, max_tokens_per_micro_batch=spec.max_tokens_per_micro_batch,
        num_threads=num_threads,
    )


def verifier_reward(config: TandemConfig) -> VerifierReward:
    """The task's rule-based reward, scored in a worker process."""
    from tasks.arithmetic import verify

    return VerifierReward(verify, timeout_s=config.task.reward_timeout_s)


def sampling_params(config: TandemConfig) -> SamplingParams:
    r = config.rollout
    return SamplingParams(r.max_new_tokens, r.temperature, r.top_p, r.top_k, tuple(r.stop))


def prompt_source(config: TandemConfig, tokenizer: Any) -> Any:
    """The run's prompts: the data file if one is named, else the task's generator."""
    return file_prompts(config.task.data_path, tokenizer) if config.task.data_path else task_prompts(tokenizer)


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


def save_checkpoint(engine: TorchTrainEngine, tokenizer: Any, folder: Path) -> None:
    """Export the trainer's weights and tokenizer, loadable by ``from_pretrained``. The
    optimizer and everything else a resume needs are in the run's resumable checkpoints
    (``core.checkpoint``), not here."""
    state = engine.state_dict()
    folder.mkdir(parents=True, exist_ok=True)
    engine.model.save_pretrained(folder, state_dict=state["model"])
    tokenizer.save_pretrained(folder)


def build_torch_components(config: TandemConfig) -> Components:
    """The embedded bundle for a config whose ``engines.type`` is ``torch``."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-load bars would interleave with the run's own display
    spec = config.engines
    assert isinstance(spec, TorchEnginesConfig)
    gen_threads, train_threads = thread_budgets(config)
    tokenizer = load_tokenizer(str(resolve_model_path(spec.model_path)))
    max_prompt_tokens = prompt_budget(config, tokenizer)  # before any engine starts: bad input fails fast
    rollout = rollout_engine(config, gen_threads)
    engine = train_engine(config, train_threads)
    reference = reference_engine(config, train_threads) if "ref_logp" in config.flow.stages else None
    reward = verifier_reward(config)
    ps = config.param_sync
    weight_sync = TorchWeightSync.in_process(
        engine, rollout, load_mode=ps.load_mode,
        produce_bucket_mb=ps.produce_bucket_mb, consume_bucket_mb=ps.consume_bucket_mb,
    )

    async def checkpoint(folder: Path) -> None:
        await asyncio.to_thread(save_checkpoint, engine, tokenizer, folder)

    # The sync first: a sync in flight finishes against live engines before they stop.
    closers = [weight_sync.close, rollout.close, engine.close, reward.close] + ([reference.close] if reference else [])
    return Components(
        prompts=prompt_source(config, tokenizer),
        held_out=held_out_prompts(tokenizer),
        rollout=rollout,
        trainer=RLTrainer(engine, config.algorithm),
        reward=reward,
        weight_sync=weight_sync,
        sampling=sampling_params(config),
        reference=reference,
        close_callbacks=closers,
        save_checkpoint=checkpoint,
        max_prompt_tokens=max_prompt_tokens,
    )
