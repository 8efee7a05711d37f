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

``--backend ray`` runs every mode twice, in process and with the engines as Ray actors on a
local cluster of this machine's cores (default placement: training on one half of the slots,
generation on the other), adds the per-step overhead of Ray over the in-process run of the
same mode, and writes ``benchmarks/results/e2e_ray.json``.

    python benchmarks/e2e.py [--steps 60] [--backend local|ray] [--config configs/default.yaml] [key=value ...]
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

RESULTS = {"local": Path(__file__).parent / "results" / "e2e.json", "ray": Path(__file__).parent / "results" / "e2e_ray.json"}
MODES = {"sync": 0, "k1": 1, "k2": 2}
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
# The synchronous schedules tried for the baseline: (label, thread overrides). Explicit, since a
# Ray actor's default budget is its slots (one core), not the k = 0 default of all cores.
SYNC_BUDGETS = [
    ("all cores per phase", [f"engines.generation_threads={CORES}", f"engines.train_threads={CORES}"]),
    ("one core per phase", ["engines.generation_threads=1", "engines.train_threads=1"]),
]


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


def run_modes(args: argparse.Namespace, backend: str) -> list[dict[str, Any]]:
    """One row per mode on ``backend``; ``sync`` is the faster of its thread budgets."""
    overrides = [*args.overrides, f"cluster.backend={backend}"]
    rows = []
    for mode in args.modes:
        if mode == "sync":
            tried = []
            for label, budget in SYNC_BUDGETS:
                result, wall = run_mode(args.config, 0, args.steps, [*overrides, *budget])
                tried.append({**row("sync", result, wall), "threads": label})
            best = max(tried, key=lambda r: r["samples_per_s"])
            best["other_sync_schedules"] = [
                {k: r[k] for k in ("threads", "samples_per_s", "reward_at_equal_samples")} for r in tried if r is not best
            ]
            rows.append(best)
        else:
            result, wall = run_mode(args.config, MODES[mode], args.steps, overrides)
            rows.append({**row(mode, result, wall), "threads": "split between phases"})
    sync = next((r for r in rows if r["mode"] == "sync"), None)
    for r in rows:
        r["backend"] = backend
        r["speedup_vs_sync"] = r["samples_per_s"] / sync["samples_per_s"] if sync else None
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--config", default=str(Path(__file__).parent.parent / "configs" / "default.yaml"))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--backend", default="local", choices=["local", "ray"])
    parser.add_argument("overrides", nargs="*", help="dotted.key=value applied to every mode (after --)")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    rows = run_modes(args, "local")
    if args.backend == "ray":
        import ray

        # One cluster for every mode: each run's backend joins it instead of starting its own.
        ray.init(num_cpus=CORES, include_dashboard=False, log_to_driver=False)
        try:
            remote = run_modes(args, "ray")
        finally:
            ray.shutdown()
        local_step = {r["mode"]: r["step_time_s"] for r in rows}
        for r in remote:
            r["ray_overhead_s_per_step"] = r["step_time_s"] - local_step[r["mode"]]
        rows += remote
    by_mode = {r["mode"]: r for r in rows if r["backend"] == args.backend}
    sync = by_mode.get("sync")

    table = Table(title=f"End to end: default job, {args.steps} steps per mode, {os.cpu_count()} cores")
    for col in ("backend", "mode", "threads", "samples/s", "tokens/s", "s/step", "vs sync", "ideal",
                "reward 1st 1/4", "reward at equal samples", "Ray overhead s/step"):
        table.add_column(col, justify="right")
    for r in rows:
        speedup = "—" if r["speedup_vs_sync"] is None else f"{r['speedup_vs_sync']:.2f}x"
        overhead = f"{r['ray_overhead_s_per_step']:+.3f}" if "ray_overhead_s_per_step" in r else ""
        table.add_row(r["backend"], r["mode"], r["threads"], f"{r['samples_per_s']:.1f}", f"{r['tokens_per_s']:.0f}",
                      f"{r['step_time_s']:.2f}", speedup, f"{r['ideal_speedup']:.2f}x",
                      f"{r['reward_first_quarter']:.3f}", f"{r['reward_at_equal_samples']:.3f}", overhead)
        for other in r.get("other_sync_schedules", []):
            table.add_row("", "(sync)", other["threads"], f"{other['samples_per_s']:.1f}", "", "", "", "", "",
                          f"{other['reward_at_equal_samples']:.3f}", "")
    Console(width=170).print(table)
    results = RESULTS[args.backend]
    results.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "rows": rows,
        "speedup_k1_vs_sync": by_mode["k1"]["speedup_vs_sync"] if sync and "k1" in by_mode else None,
        "speedup_k2_vs_sync": by_mode["k2"]["speedup_vs_sync"] if sync and "k2" in by_mode else None,
        "settings": {"steps": args.steps, "config": args.config, "overrides": args.overrides, "backend": args.backend},
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine()},
    }
    results.write_text(json.dumps(doc, indent=2))
    print(f"wrote {results}")


if __name__ == "__main__":
    main()
