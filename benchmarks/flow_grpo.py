"""Flow-GRPO on the digits task: asynchronous reward and one-step-off against the colocated synchronous baseline.

The job is ``configs/flow_grpo_digits.yaml`` (the shipped 1M-parameter digit generator,
Flow-GRPO-Fast, OCR judge); every mode trains the same number of steps on the same prompts
(the same sample budget), one run each, on this machine's cores. Two judges: ``cheap`` (the
OCR classifier in the reward pool, well under a millisecond an image) and ``slow`` (the same
judge spending ``--judge-cost`` seconds an image, GeRL's served VLM judge reproduced by the
task's ``judge_cost_s``).

Modes, the rows of the two GeRL tables this reproduces:
- table 1 (asynchronous reward): ``colocated_sync`` with ``rollout.with_reward`` off and on,
  with each judge. Off, a rollout call hands its images over only once all are denoised, so
  the judge scores the whole batch after generation; on, it scores each batch of
  ``engines.max_batch_size`` images while the next is denoised;
- table 2 (decoupled pools, one-step-off): the colocated synchronous hybrid engine
  (``flow.colocate``: generation, training and evaluation take turns, each with all cores)
  against decoupled pools (one core generating, one training): synchronous (k = 0),
  one-step-off (k = 1) with and without the asynchronous reward, and k = 2; slow judge.

Per row: ``samples_per_s`` (trained samples over wall time), the held-out reward curve (the
validate role's evaluations, every ``--eval-every`` versions on ``--eval-prompts`` fixed
prompts and seeds, plus the final weights evaluated the same way once training ends),
``time_to_target_s`` (wall time from the flow's start until the held-out reward first reaches
the threshold and stays at or above it for every later evaluation; null if it never does),
``reward_at_equal_samples`` (the final weights' held-out reward: every mode trained the same
samples), and each role's busy seconds (``busy_s``: where the wall time went). The threshold
is chosen from the colocated synchronous baseline (with_reward off, slow judge): its first
held-out reward plus ``--target-fraction`` of the rise it achieved.

Top level: ``speedup_async_reward`` (colocated sync, with_reward on / off, slow judge),
``speedup_one_step_off`` (decoupled k = 1 with_reward off / colocated sync off) and
``speedup_combined`` (k = 1 with_reward on / colocated sync off), samples per second each, and
``time_to_target_ratio_one_step_off`` (k = 1 with_reward on / baseline). Prints a table and
writes ``benchmarks/results/flow_grpo.json``.

    python benchmarks/flow_grpo.py [--steps 40] [--judge-cost 0.015] [--modes ...] [key=value ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from rich.console import Console
from rich.table import Table

from tandem.core.components import Components
from tandem.core.config import TandemConfig
from tandem.core.protocols import RolloutRequest
from tandem.core.records import PromptGroup
from tandem.pipeline import AsyncTrainingFlow, FlowResult, load_config
from tandem.pipeline.builders import build_components
from tandem.state_machines.generate import request_seed
from tandem.state_machines.validate import VALIDATION_IDS

RESULTS = Path(__file__).parent / "results" / "flow_grpo.json"
CONFIG = "configs/flow_grpo_digits.yaml"
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
BASELINE = "colocated_sync/off/slow"


@dataclass(frozen=True)
class Mode:
    """One row: the schedule, the asynchronous reward switch and the judge."""

    name: str
    k: int
    colocated: bool
    with_reward: bool
    judge: str  # "cheap" or "slow"

    @property
    def key(self) -> str:
        return f"{self.name}/{'on' if self.with_reward else 'off'}/{self.judge}"

    def overrides(self, judge_cost_s: float) -> list[str]:
        threads = CORES if self.colocated else max(1, CORES // 2)
        return [
            f"staleness.max_staleness={self.k}",
            f"rollout.with_reward={str(self.with_reward).lower()}",
            f"task.options.judge_cost_s={judge_cost_s if self.judge == 'slow' else 0.0}",
            f"engines.generation_threads={threads}",
            f"engines.train_threads={threads}",
            "flow.colocate=[[generate, train, validate]]" if self.colocated else "flow.colocate=[]",
        ]


MODES = [
    Mode("colocated_sync", 0, True, False, "cheap"),
    Mode("colocated_sync", 0, True, True, "cheap"),
    Mode("colocated_sync", 0, True, False, "slow"),
    Mode("colocated_sync", 0, True, True, "slow"),
    Mode("decoupled_sync", 0, False, True, "slow"),
    Mode("one_step_off", 1, False, False, "slow"),
    Mode("one_step_off", 1, False, True, "slow"),
    Mode("k2", 2, False, True, "slow"),
]


async def evaluate_final(config: TandemConfig, components: Components) -> float:
    """The trained weights' held-out reward, exactly as the validate role measures it (same prompts, seeds, steps)."""
    await components.weight_sync.sync(components.trainer.version)
    items = components.held_out(config.validation.prompts)  # type: ignore[misc]
    groups = [PromptGroup(VALIDATION_IDS + i, item, 1) for i, item in enumerate(items)]
    requests = [RolloutRequest(g, 0, request_seed(config.run.seed, g.prompt_id, 0), evaluation=True) for g in groups]
    trajectories = [t async for t in components.workflow.rollout(requests)]
    by_id = {g.prompt_id: g for g in groups}
    results = await components.reward.score(trajectories, [by_id[t.prompt_id] for t in trajectories])
    return statistics.fmean(r.reward if r.ok else 0.0 for r in results)


async def run_mode(mode: Mode, args: argparse.Namespace, output: Path) -> dict[str, Any]:
    config = load_config(args.config, [
        f"run.max_steps={args.steps}", f"run.name=bench_{mode.key.replace('/', '_')}", f"run.output_dir={output}",
        f"validation.every_versions={args.eval_every}", f"validation.prompts={args.eval_prompts}",
        "observability.write_run_dir=false", "observability.trace=false", "observability.metrics_port=null",
        *mode.overrides(args.judge_cost), *args.overrides,
    ])  # fmt: skip
    components = build_components(config)
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        result = await AsyncTrainingFlow(config, components).run()
        final = await evaluate_final(config, components)
    finally:
        components.close()
    return row(mode, config, result, started, final)


def row(mode: Mode, config: TandemConfig, result: FlowResult, started: float, final: float) -> dict[str, Any]:
    steps = result.steps
    samples = sum(s.samples for s in steps)
    curve = [{"version": v.version, "time_s": round(v.time_s - started, 3), "reward": v.reward_mean} for v in result.validations]
    curve.append({"version": result.final_version, "time_s": round(result.wall_s, 3), "reward": final, "final": True})
    tail = steps[-max(1, len(steps) // 5):]
    spec = config.engines
    return {
        "mode": mode.name,
        "with_reward": mode.with_reward,
        "judge": mode.judge,
        "k": mode.k,
        "colocated": mode.colocated,
        "generation_threads": getattr(spec, "generation_threads", None),
        "train_threads": getattr(spec, "train_threads", None),
        "steps": len(steps),
        "samples": samples,
        "wall_s": round(result.wall_s, 3),
        "samples_per_s": samples / result.wall_s,
        "time_to_target_s": None,  # filled once the threshold is known
        "reward_at_equal_samples": final,
        "heldout": curve,
        "train_reward_last_fifth": statistics.fmean(s.reward_mean for s in tail),
        "staleness_counts": result.staleness_counts,
        # Seconds each role spent working (its RUNNING state): where the wall time went.
        "busy_s": {name: round(r.state_seconds.get("running", 0.0), 2) for name, r in result.roles.items()
                   if name in ("generate", "reward", "train", "validate")},
    }


def time_to_target(curve: list[dict[str, Any]], threshold: float) -> float | None:
    """The first evaluation time from which every evaluation is at or above ``threshold``; None if the last is below."""
    reached = None
    for point in curve:
        if point["reward"] >= threshold:
            reached = point["time_s"] if reached is None else reached
        else:
            reached = None
    return reached


def ratio(rows: dict[str, dict[str, Any]], over: str, under: str, key: str = "samples_per_s") -> float | None:
    if over not in rows or under not in rows or rows[over][key] is None or rows[under][key] in (None, 0):
        return None
    return rows[over][key] / rows[under][key]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per mode (the sample budget)")
    parser.add_argument("--judge-cost", type=float, default=0.015, help="seconds the slow judge spends per image")
    parser.add_argument("--eval-every", type=int, default=5, help="held-out evaluation every this many versions")
    parser.add_argument("--eval-prompts", type=int, default=100, help="held-out prompts per evaluation")
    parser.add_argument("--target-fraction", type=float, default=0.6, help="threshold: baseline's first + this * its rise")
    parser.add_argument("--modes", nargs="*", default=[m.key for m in MODES], help=f"subset of {[m.key for m in MODES]}")
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("overrides", nargs="*", help="dotted config overrides for every mode")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if BASELINE not in args.modes:
        parser.error(f"the modes must include the baseline {BASELINE}")
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as output:
        for mode in (m for m in MODES if m.key in args.modes):
            began = time.perf_counter()
            rows[mode.key] = asyncio.run(run_mode(mode, args, Path(output)))
            print(f"{mode.key}: {rows[mode.key]['samples_per_s']:.1f} samples/s, "
                  f"held-out {rows[mode.key]['reward_at_equal_samples']:.3f} ({time.perf_counter() - began:.0f} s)", flush=True)
    base = rows[BASELINE]["heldout"]
    first, final = base[0]["reward"], base[-1]["reward"]
    threshold = round(first + args.target_fraction * (final - first), 4)
    for r in rows.values():
        r["time_to_target_s"] = time_to_target(r["heldout"], threshold)
    results = {
        "rows": list(rows.values()),
        "baseline": BASELINE,
        "threshold": threshold,
        "speedup_async_reward": ratio(rows, "colocated_sync/on/slow", BASELINE),
        "speedup_one_step_off": ratio(rows, "one_step_off/off/slow", BASELINE),
        "speedup_combined": ratio(rows, "one_step_off/on/slow", BASELINE),
        "speedup_async_reward_cheap_judge": ratio(rows, "colocated_sync/on/cheap", "colocated_sync/off/cheap"),
        "time_to_target_ratio_one_step_off": ratio(rows, "one_step_off/on/slow", BASELINE, "time_to_target_s"),
        "settings": {
            "config": args.config, "steps": args.steps, "judge_cost_s": args.judge_cost, "eval_every": args.eval_every,
            "eval_prompts": args.eval_prompts, "target_fraction": args.target_fraction, "overrides": args.overrides,
        },
        "machine": {"cores": CORES, "python": platform.python_version(), "machine": platform.machine()},
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    table = Table(title=f"Flow-GRPO digits, {args.steps} steps per mode, threshold {threshold:.3f}")
    for column in ("mode", "with_reward", "judge", "k", "samples/s", "time to target (s)", "held-out at equal samples"):
        table.add_column(column)
    for r in rows.values():
        ttt = "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}"
        table.add_row(r["mode"], str(r["with_reward"]), r["judge"], str(r["k"]), f"{r['samples_per_s']:.1f}", ttt,
                      f"{r['reward_at_equal_samples']:.3f}")
    Console().print(table)
    for key in ("speedup_async_reward", "speedup_one_step_off", "speedup_combined", "time_to_target_ratio_one_step_off"):
        value = results[key]
        print(f"{key}: {'-' if value is None else f'{value:.2f}'}")


if __name__ == "__main__":
    main()
