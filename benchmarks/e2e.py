"""End to end: the default job (shipped model, real engines, CPU) in sync, k = 1, k = 2 and k = 4.

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

``--rollout server`` runs every mode twice, with generation in this process's rollout thread
and with generation in a ``tandem serve`` process (one thread there, the trainer on one thread
here: the two no longer share an interpreter), and writes ``benchmarks/results/e2e_server.json``
(the in-process rows beside the server rows; the headline speedups are the server's).

``--backend ray`` runs every mode twice, in process and with the engines as Ray actors on a
local cluster of this machine's cores (default placement: training on one half of the slots,
generation on the other), adds the per-step overhead of Ray over the in-process run of the
same mode, and writes ``benchmarks/results/e2e_ray.json``.

``--proximal-current`` runs every mode again with pi_prox taken from the train step's own
forward pass (``algorithm.proximal=current``, no logp stage) and reports the time per step that
saves (``step_time_saved_s`` on the ``<mode>_prox_current`` rows).

    python benchmarks/e2e.py [--steps 60] [--backend local|ray] [--rollout embedded|server] [--config ...] [key=value ...]
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

from core.config import TandemConfig
from pipeline import AsyncTrainingFlow, FlowResult, load_config
from pipeline.builders import build_components

RESULTS = {
    "local": Path(__file__).parent / "results" / "e2e.json",
    "ray": Path(__file__).parent / "results" / "e2e_ray.json",
    "server": Path(__file__).parent / "results" / "e2e_server.json",
}
MODES = {"sync": 0, "k1": 1, "k2": 2, "k4": 4}
# Generation in a server process: one thread there, the trainer one thread here (2 cores).
SERVER = ["engines.rollout=server", "engines.servers.startup_timeout_s=600"]
SERVER_ASYNC_THREADS = ["engines.generation_threads=1", "engines.train_threads=1"]
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
    result = asyncio.run(train(cfg))
    return result, time.perf_counter() - started


async def train(cfg: TandemConfig) -> FlowResult:
    """One run. Rollout servers are started and ready before the flow starts its clock: their
    start-up (a process, a model load) is a fixed cost of the run, not of its steps."""
    if getattr(cfg.engines, "rollout", "embedded") == "embedded":
        return await AsyncTrainingFlow(cfg).run()
    components = build_components(cfg)
    try:
        await components.workflow.engine.start()  # type: ignore[attr-defined]  # the router: waits for the servers
        return await AsyncTrainingFlow(cfg, components=components).run()
    finally:
        components.close()


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


def run_modes(args: argparse.Namespace, backend: str, rollout: str = "embedded") -> list[dict[str, Any]]:
    """One row per mode on ``backend`` with generation ``rollout``; ``sync`` is the faster of its thread budgets."""
    overrides = [*args.overrides, f"cluster.backend={backend}", *(SERVER if rollout == "server" else [])]
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
            split = SERVER_ASYNC_THREADS if rollout == "server" else []
            result, wall = run_mode(args.config, MODES[mode], args.steps, [*overrides, *split])
            rows.append({**row(mode, result, wall), "threads": "split between phases"})
    sync = next((r for r in rows if r["mode"] == "sync"), None)
    for r in rows:
        r["backend"] = backend
        r["rollout"] = rollout
        r["speedup_vs_sync"] = r["samples_per_s"] / sync["samples_per_s"] if sync else None
    return rows


def proximal_current_rows(args: argparse.Namespace, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each mode of ``rows`` again with ``algorithm.proximal=current`` and no logp stage (pi_prox from
    the train step's own forward pass, exact here), sync with the thread budget it won with: its
    row, named ``<mode>_prox_current``, says how much time per step the skipped forward pass saves
    (``step_time_saved_s``)."""
    stages = [s for s in load_config(args.config).flow.stages if s != "logp"]
    overrides = [*args.overrides, "algorithm.proximal=current", f"flow.stages=[{', '.join(stages)}]"]
    budgets = dict(SYNC_BUDGETS)
    sync = next((r for r in rows if r["mode"] == "sync"), None)
    out = []
    for base in [r for r in rows if r["mode"] in MODES and r["backend"] == "local" and r["rollout"] == "embedded"]:
        threads = budgets.get(base["threads"], [])
        result, wall = run_mode(args.config, MODES[base["mode"]], args.steps, [*overrides, *threads])
        current = {**row(f"{base['mode']}_prox_current", result, wall), "threads": base["threads"],
                   "backend": "local", "rollout": "embedded"}
        current["speedup_vs_sync"] = current["samples_per_s"] / sync["samples_per_s"] if sync else None
        current["step_time_saved_s"] = base["step_time_s"] - current["step_time_s"]
        out.append(current)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--config", default=str(Path(__file__).parent.parent / "configs" / "default.yaml"))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--backend", default="local", choices=["local", "ray"])
    parser.add_argument("--rollout", default="embedded", choices=["embedded", "server"],
                        help="server: every mode also with generation in a tandem serve process")
    parser.add_argument("--proximal-current", action="store_true",
                        help="every mode also with pi_prox from the train step's own forward pass (no logp stage)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value applied to every mode (after --)")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    rows = run_modes(args, "local")
    if args.proximal_current:
        rows += proximal_current_rows(args, rows)
    if args.rollout == "server":
        rows += run_modes(args, "local", "server")
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
    headline = "server" if args.rollout == "server" else "embedded"
    by_mode = {r["mode"]: r for r in rows if r["backend"] == args.backend and r["rollout"] == headline}
    sync = by_mode.get("sync")

    table = Table(title=f"End to end: default job, {args.steps} steps per mode, {os.cpu_count()} cores")
    for col in ("backend", "rollout", "mode", "threads", "samples/s", "tokens/s", "s/step", "vs sync", "ideal",
                "reward 1st 1/4", "reward at equal samples", "Ray overhead s/step"):
        table.add_column(col, justify="right")
    for r in rows:
        speedup = "—" if r["speedup_vs_sync"] is None else f"{r['speedup_vs_sync']:.2f}x"
        overhead = f"{r['ray_overhead_s_per_step']:+.3f}" if "ray_overhead_s_per_step" in r else ""
        table.add_row(r["backend"], r["rollout"], r["mode"], r["threads"], f"{r['samples_per_s']:.1f}",
                      f"{r['tokens_per_s']:.0f}", f"{r['step_time_s']:.2f}", speedup, f"{r['ideal_speedup']:.2f}x",
                      f"{r['reward_first_quarter']:.3f}", f"{r['reward_at_equal_samples']:.3f}", overhead)
        for other in r.get("other_sync_schedules", []):
            table.add_row("", "", "(sync)", other["threads"], f"{other['samples_per_s']:.1f}", "", "", "", "", "",
                          f"{other['reward_at_equal_samples']:.3f}", "")
    Console(width=180).print(table)
    results = RESULTS["server" if args.rollout == "server" else args.backend]
    results.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "rows": rows,
        "speedup_k1_vs_sync": by_mode["k1"]["speedup_vs_sync"] if sync and "k1" in by_mode else None,
        "speedup_k2_vs_sync": by_mode["k2"]["speedup_vs_sync"] if sync and "k2" in by_mode else None,
        "speedup_k4_vs_sync": by_mode["k4"]["speedup_vs_sync"] if sync and "k4" in by_mode else None,
        "settings": {"steps": args.steps, "config": args.config, "overrides": args.overrides, "backend": args.backend,
                     "rollout": args.rollout},
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine(),
                    # Other work on the machine shares its cores: read the numbers with this.
                    "load_average_1m_at_end": os.getloadavg()[0]},
    }
    results.write_text(json.dumps(doc, indent=2))
    print(f"wrote {results}")


if __name__ == "__main__":
    main()
