"""End to end: the default job (shipped model, real engines, CPU) in sync, k = 1 and k = 2.

Every mode trains the same number of steps on the same prompts (the same sample budget).
The sync baseline is the best synchronous schedule these engines allow, measured in the same
run: k = 0 with continuous batching, once with all cores given to each phase (the default
budget at k = 0) and once with one core per phase, and the faster of the two is ``sync``
(on the shipped 1M-parameter model one core per phase wins: scoring of finished groups overlaps
the generation tail, and two 2-thread engines oversubscribe 2 cores). The async modes split
the cores between generation and training.

Per mode: samples/s and tokens/s (trained), time per step, reward at equal samples (mean reward
over the last quarter of steps), and the ideal speedup of that run's own stage times,
(generation busy + training busy) / max(generation busy, training busy): what perfect overlap
of the measured phases would give over running them back to back. Prints a table and writes
``benchmarks/results/e2e.json``.

    python benchmarks/e2e.py [--steps 60] [--config configs/default.yaml] [key=value ...]
"""

from __future__ import annotations

import _bootstrap  # noqa: F401  (first: imports resolve to the project)
import argparse
import asyncio
import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import structlog
from rich.console import Console
from rich.table import Table

from pipeline import AsyncTrainingFlow, FlowResult, load_config

RESULTS = Path(__file__).parent / "results" / "e2e.json"
MODES = {"sync": 0, "k1": 1, "k2": 2}
# The synchronous schedules tried for the baseline: (label, thread overrides).
SYNC_BUDGETS = [("all cores per phase", []), ("one core per phase", ["engines.generation_threads=1", "engines.train_threads=1"])]


def run_mode(config_path: str, k: int, steps: int, overrides: list[str]) -> tuple[FlowResult, float]:
    cfg = load_config(
        config_path,
        [
            f"staleness.max_staleness={k}",
            f"run.max_steps={steps}",
            f"run.name=e2e_k{k}",
            "observability.metrics_port=null",
            *overrides,
        ],
    )
    started = time.perf_counter()
    result = asyncio.run(AsyncTrainingFlow(cfg).run())
    return result, time.perf_counter() - started


def row(mode: str, result: FlowResult, wall_s: float) -> dict[str, Any]:
    steps = result.steps
    busy = {name: r.state_seconds.get("running", 0.0) for name, r in result.roles.items()}
    gen = busy["generate"]
    train = busy["train"] + busy.get("logp", 0.0)  # logp runs on the trainer's weights and thread
    tail = steps[-max(1, len(steps) // 4):]
    samples = sum(s.samples for s in steps)
    tokens = sum(s.tokens for s in steps)
    return {
        "mode": mode,
        "steps": len(steps),
        "samples": samples,
        "wall_s": wall_s,
        "samples_per_s": samples / result.wall_s,
        "tokens_per_s": tokens / result.wall_s,
        "step_time_s": result.wall_s / len(steps),
        "reward_first_quarter": statistics.mean(s.reward_mean for s in steps[: max(1, len(steps) // 4)]),
        "reward_at_equal_samples": statistics.mean(s.reward_mean for s in tail),
        "generation_busy_s": gen,
        "training_busy_s": train,
        "ideal_speedup": (gen + train) / max(gen, train) if max(gen, train) > 0 else 1.0,
        "staleness_counts": result.staleness_counts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--config", default=str(Path(__file__).parent.parent / "configs" / "default.yaml"))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("overrides", nargs="*", help="dotted.key=value applied to every mode (after --)")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    rows = []
    for mode in args.modes:
        if mode == "sync":
            tried = []
            for label, budget in SYNC_BUDGETS:
                result, wall = run_mode(args.config, 0, args.steps, [*args.overrides, *budget])
                tried.append({**row("sync", result, wall), "threads": label})
            best = max(tried, key=lambda r: r["samples_per_s"])
            best["other_sync_schedules"] = [
                {k: r[k] for k in ("threads", "samples_per_s", "reward_at_equal_samples")} for r in tried if r is not best
            ]
            rows.append(best)
        else:
            result, wall = run_mode(args.config, MODES[mode], args.steps, args.overrides)
            rows.append({**row(mode, result, wall), "threads": "split between phases"})
    by_mode = {r["mode"]: r for r in rows}
    sync = by_mode.get("sync")
    for r in rows:
        r["speedup_vs_sync"] = r["samples_per_s"] / sync["samples_per_s"] if sync else None

    table = Table(title=f"End to end: default job, {args.steps} steps per mode, {os.cpu_count()} cores")
    for col in ("mode", "threads", "samples/s", "tokens/s", "s/step", "vs sync", "ideal", "reward 1st 1/4",
                "reward at equal samples"):
        table.add_column(col, justify="right")
    for r in rows:
        speedup = "—" if r["speedup_vs_sync"] is None else f"{r['speedup_vs_sync']:.2f}x"
        table.add_row(r["mode"], r["threads"], f"{r['samples_per_s']:.1f}", f"{r['tokens_per_s']:.0f}",
                      f"{r['step_time_s']:.2f}", speedup, f"{r['ideal_speedup']:.2f}x",
                      f"{r['reward_first_quarter']:.3f}", f"{r['reward_at_equal_samples']:.3f}")
        for other in r.get("other_sync_schedules", []):
            table.add_row("(sync)", other["threads"], f"{other['samples_per_s']:.1f}", "", "", "", "", "",
                          f"{other['reward_at_equal_samples']:.3f}")
    Console(width=150).print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "rows": rows,
        "speedup_k1_vs_sync": by_mode["k1"]["speedup_vs_sync"] if sync and "k1" in by_mode else None,
        "speedup_k2_vs_sync": by_mode["k2"]["speedup_vs_sync"] if sync and "k2" in by_mode else None,
        "settings": {"steps": args.steps, "config": args.config, "overrides": args.overrides},
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine()},
    }
    RESULTS.write_text(json.dumps(doc, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
