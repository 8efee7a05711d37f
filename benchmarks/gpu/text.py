"""The text part of the GPU check: decode throughput, and the default job's schedule with its weight syncs.

On the Qwen2.5-0.5B-shaped model (``gpu.models``), in bfloat16 on the GPU:

- **decode**: tandem's embedded rollout engine (continuous batching around a transformers model)
  against transformers' ``model.generate`` on one static batch, at 64 and 256 sequences, each a
  random 32-token prompt and exactly 128 sampled tokens (no eos): tokens/s, the median of two
  timed rounds after a warm-up (``benchmarks/rollout_engines.py`` measures, on the GPU here);
- **schedule**: the default job (``configs/default.yaml``, arithmetic GRPO, 64 samples of 83
  tokens per step) with both engines on the one GPU, synchronous (k = 0) against one step off
  (k = 1), the same number of steps: samples/s and the ratio (``benchmarks/e2e.py`` measures).
  The weights are random, so the reward means nothing here: this is the schedule's speed only;
- **weight sync**: every sync of the k = 1 run is the product's own path while generation goes
  on (gather on the trainer under its weights lock into the dual pinned buffer, then a load into
  the rollout engine's idle weight set and a swap between decode steps): seconds, GB/s and the
  time the swap held generation (``stall_s``), the median over the run's syncs after the first
  (which plans the layout and allocates the buffer). In-flight sequences are then re-prefilled
  under the new weights (``resume_policy: recompute``, the default); that cost is in the
  schedule's samples/s, not in ``stall_s``.

The train step's tokens/s and model FLOPs utilisation are measured by ``gpu.trainer_groups``
(plain torch is its baseline row), on the same model.
"""

from __future__ import annotations

import statistics
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import e2e
import rollout_engines

from gpu.common import Scale
from gpu.models import qwen_shaped, text_parameters

__all__ = ["run"]

DEFAULT_JOB = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"
PROMPT_TOKENS = 32
# Full size: about 40 s of decoding on an H100 (4 engine x batch rows, 3 rounds each).
NEW_TOKENS, BATCHES, TIMED_ROUNDS = 128, (64, 256), 2
# 12 steps per schedule: the first steps warm up (CUDA kernels, the sync buffer), the rest are
# the steady state; about 30 s per schedule on an H100.
SCHEDULE_STEPS = 12
SCHEDULES = {"sync": 0, "k1": 1}
# The smoke mode: a few tokens, a few samples, three steps (at k = 1 the third is admitted only once
# the first sync has loaded, so the run always records one: with two, it could end with the sync in
# flight); one thread per engine (k = 0 would give generation both of a 2-core machine's cores,
# which stall on each other beside other work) and no run folder (its plot is matplotlib's import
# and a figure per run, read by no one).
TINY = SimpleNamespace(new_tokens=8, batches=(4,), rounds=1, steps=3,
                       job=["train.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8",
                            "engines.generation_threads=1", "engines.train_threads=1",
                            "observability.write_run_dir=false"])  # fmt: skip


def decode_rows(scale: Scale, folder: Path) -> list[dict[str, Any]]:
    """Embedded engine and ``model.generate``, each alone on the device, at every batch size."""
    tiny = scale.tiny
    new_tokens = TINY.new_tokens if tiny else NEW_TOKENS
    vocab_size = rollout_engines.model_facts(folder)[1]
    rows = []
    for batch in TINY.batches if tiny else BATCHES:
        settings = SimpleNamespace(batch=batch, new_tokens=new_tokens, prompt_tokens=PROMPT_TOKENS, threads=1,
                                   repeat=TINY.rounds if tiny else TIMED_ROUNDS)  # fmt: skip
        measured = {}
        for name, engine in (("generate", rollout_engines.hf_generate), ("embedded", rollout_engines.embedded)):
            runner = partial(engine, device=str(scale.device), dtype=scale.dtype)
            measured[name] = rollout_engines.measure(runner, folder, vocab_size, settings)
            rows.append({"engine": name, "batch": batch, "new_tokens": new_tokens, "prompt_tokens": PROMPT_TOKENS,
                         **measured[name]})  # fmt: skip
        rows[-1]["vs_generate"] = measured["embedded"]["tokens_per_s_median"] / measured["generate"]["tokens_per_s_median"]
    return rows


def schedule_rows(scale: Scale, folder: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The default job at k = 0 and k = 1 on the device; and the k = 1 run's weight syncs."""
    overrides = [
        f"engines.device={scale.device}", f"engines.dtype={scale.dtype_name}", f"engines.model_path={folder}",
        "validation.every_versions=null", f"run.output_dir={scale.workdir / 'runs'}", "observability.trace=false",
        *(TINY.job if scale.tiny else []),
    ]  # fmt: skip
    steps = TINY.steps if scale.tiny else SCHEDULE_STEPS
    rows, syncs = [], []
    for mode, k in SCHEDULES.items():
        result, wall = e2e.run_mode(str(DEFAULT_JOB), k, steps, overrides)
        rows.append(e2e.row(mode, result, wall))
        if k == 1:
            syncs = [s.metrics for s in result.syncs]
    for r in rows:
        e2e.with_sync(r, rows[0])
    return rows, sync_figures(syncs)


def sync_figures(syncs: list[dict[str, float]]) -> dict[str, Any]:
    """Medians of the syncs after the first (which plans the layout and allocates the buffer)."""
    steady = syncs[1:] or syncs
    if not steady:
        return {"syncs": 0}
    keys = ("total_s", "gb_per_s", "stall_s", "gather_s", "send_s", "load_s")
    return {"syncs": len(steady), "bytes": steady[0]["bytes"],
            **{key: statistics.median(m[key] for m in steady) for key in keys if key in steady[0]}}  # fmt: skip


def run(scale: Scale) -> dict[str, Any]:
    folder = qwen_shaped(scale)
    decode = decode_rows(scale, folder)
    schedule, sync = schedule_rows(scale, folder)
    speedup = next(r["speedup_vs_sync"] for r in schedule if r["mode"] == "k1")
    return {"params": text_parameters(folder), "decode": decode, "schedule": schedule, "k1_over_sync": speedup,
            "weight_sync": sync}  # fmt: skip
