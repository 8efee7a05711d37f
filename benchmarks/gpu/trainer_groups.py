"""Trainer groups on one GPU: plain torch's train step against FSDP2 and megatron-core's engine.

On the Qwen2.5-0.5B-shaped model (``gpu.models``), bfloat16, one batch of 16 sequences of
512 tokens (64 prompt + 448 response tokens, alternating advantages), the default job's loss
(decoupled PPO), each trainer built from config exactly as a run builds it
(``engines.text.build.train_engine``):

- ``plain``: one process's ``TorchTrainEngine``, the baseline: train-step seconds, tokens/s
  (every token of the batch goes forward and backward) and model FLOPs utilisation, 6·N·tokens
  per second over the card's dense bf16 peak (N: every parameter, the tied embedding counted
  once, as the output projection's matmul); the figure users compare with peers' MFU;
- ``fsdp2``: a trainer group of one FSDP2 rank (``engines.data_parallel: fsdp2``): what the
  wrapper costs on one GPU (a rank process, the messages, FSDP2's all-gather and reduce-scatter
  of a world of one), as the ratio of its step time to plain's;
- ``megatron``: a group of one megatron-core rank (``engines.train: megatron``): on CUDA it runs
  megatron's own DDP and distributed optimizer, which the CPU path replaces with shims.

Each: one warm-up step, then timed steps (the median). A row whose library is missing on the
host (megatron-core) is reported as skipped with the reason; the others still run. Tiny mode
runs the same rows on CPU at toy shapes (FSDP2 and megatron over gloo).
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import random
import statistics
from pathlib import Path
from typing import Any

from gpu.common import Scale, bf16_peak_flops, timed
from gpu.models import qwen_shaped, text_parameters
from tandem.algorithms import PolicyObjective
from tandem.core.config import TandemConfig
from tandem.core.records import FinishReason, Trajectory, token_trajectory
from tandem.engines.text.build import train_engine
from tandem.pipeline import load_config

__all__ = ["run"]

ROWS = {
    "plain": [],
    "fsdp2": ["engines.data_parallel=fsdp2", "engines.train_world_size=1"],
    "megatron": ["engines.train=megatron", "engines.train_world_size=1"],
}
# Full size: 16 x 512 tokens a step (two micro-batches of the default 4096-token budget); three
# timed steps each, about 20 s a row on an H100 with the rank processes' start.
SEQUENCES, PROMPT_TOKENS, RESPONSE_TOKENS, TIMED_STEPS = 16, 64, 448, 3
TINY_SEQUENCES, TINY_PROMPT_TOKENS, TINY_RESPONSE_TOKENS, TINY_TIMED_STEPS = 4, 8, 24, 1


def config_for(scale: Scale, folder: Path, row: str) -> TandemConfig:
    """The default job's config with this row's trainer, on the check's device and model."""
    return load_config("default", [
        f"engines.device={scale.device}", f"engines.dtype={scale.dtype_name}", f"engines.model_path={folder}",
        f"run.output_dir={scale.workdir / 'runs'}", *ROWS[row],
    ])  # fmt: skip


def batch(scale: Scale, vocab_size: int) -> list[Trajectory]:
    """Random sequences of equal length, advantages +1/-1 by sample (groups of four), behaviour
    log-probs those of a uniform policy (about what a random model gives): importance ratios near
    one, so the losses are of the size a run sees."""
    rng = random.Random(0)
    sequences, prompt_len, response_len = (
        (TINY_SEQUENCES, TINY_PROMPT_TOKENS, TINY_RESPONSE_TOKENS) if scale.tiny
        else (SEQUENCES, PROMPT_TOKENS, RESPONSE_TOKENS)
    )  # fmt: skip
    uniform = -math.log(vocab_size)
    out = []
    for i in range(sequences):
        prompt = [rng.randrange(4, vocab_size) for _ in range(prompt_len)]
        response = [rng.randrange(4, vocab_size) for _ in range(response_len)]
        trajectory = token_trajectory(i // 4, i % 4, prompt, response, [uniform] * response_len, [0] * response_len,
                                      FinishReason.LENGTH)  # fmt: skip
        trajectory.advantage = 1.0 if i % 2 == 0 else -1.0
        out.append(trajectory)
    return out


async def measure(config: TandemConfig, trajectories: list[Trajectory], steps: int, scale: Scale) -> dict[str, Any]:
    """Build the trainer, one warm-up step, ``steps`` timed steps; seconds of each."""
    objective = PolicyObjective(config.algorithm, config.algorithm.proximal)
    engine, build_s = timed(lambda: train_engine(config, num_threads=1), scale.device)
    try:
        loop = asyncio.get_running_loop()
        seconds, losses = [], []
        for step in range(steps + 1):
            started = loop.time()
            losses.append((await engine.train_step(trajectories, objective)).get("loss"))
            if step:  # step 0 warms up (kernels, allocator, optimizer state)
                seconds.append(loop.time() - started)
    finally:
        engine.close()
    # The first step's loss is computed on the weights every row starts from: the rows agree on
    # it up to their kernels' rounding (a check that each trained the same thing).
    return {"build_s": build_s, "step_s": statistics.median(seconds), "step_s_runs": seconds, "first_loss": losses[0],
            "losses": losses}  # fmt: skip


def run(scale: Scale) -> dict[str, Any]:
    folder = qwen_shaped(scale)
    params = text_parameters(folder)
    config = config_for(scale, folder, "plain")
    trajectories = batch(scale, _vocab(folder))
    tokens = len(trajectories) * (TINY_PROMPT_TOKENS + TINY_RESPONSE_TOKENS if scale.tiny else PROMPT_TOKENS + RESPONSE_TOKENS)
    steps = TINY_TIMED_STEPS if scale.tiny else TIMED_STEPS
    peak, _ = bf16_peak_flops(scale.device)
    out: dict[str, Any] = {"params": params, "tokens_per_step": tokens, "sequences": len(trajectories)}
    for row in ROWS:
        if row == "megatron" and importlib.util.find_spec("megatron.core") is None:
            out[row] = {"skipped": "megatron-core is not installed (pip install tandem[megatron], or its wheel on a GPU host)"}
            continue
        config = config_for(scale, folder, row)
        figures = asyncio.run(measure(config, trajectories, steps, scale))
        figures["tokens_per_s"] = tokens / figures["step_s"]
        figures["mfu"] = 6 * params * figures["tokens_per_s"] / peak if peak else None
        out[row] = figures
    plain = out["plain"]
    out["plain_tokens_per_s"], out["plain_mfu"] = plain["tokens_per_s"], plain["mfu"]
    out["fsdp2_over_plain"] = out["fsdp2"]["step_s"] / plain["step_s"]
    if "step_s" in out["megatron"]:
        out["megatron_tokens_per_s"] = out["megatron"]["tokens_per_s"]
        out["megatron_over_plain"] = out["megatron"]["step_s"] / plain["step_s"]
    return out


def _vocab(folder: Path) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder).vocab_size
