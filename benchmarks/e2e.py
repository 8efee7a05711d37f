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

``--rollout agent`` adds a third row per mode: generation in a server, each rollout made by the
shipped agent (``tasks/arithmetic/openai_agent.py``) through the server's OpenAI endpoint with
the ``openai`` client, and writes ``benchmarks/results/e2e_server_agent.json`` (headline: the
agent's rows): what an agent's HTTP round trips cost against the native server rows.

``--rollout vllm`` runs every mode twice, with the embedded engine and with vLLM in process
(``engines.rollout=vllm``, its CPU build, compiled as a user would run it), and writes
``benchmarks/results/e2e_vllm.json``: the same keys as ``e2e.json`` plus, on the vLLM rows,
``logprob_gap_max`` (the largest gap the sync probe measured over the run), ``sync_s`` (median
seconds per weight update: pause, load, resume and probe) and ``sync_stall_s`` (median seconds
generation stood still for it). The headline speedups are vLLM's.

``--backend ray`` runs every mode twice, in process and with the engines as Ray actors on a
local cluster of this machine's cores (default placement: training on one half of the slots,
generation on the other), adds the per-step overhead of Ray over the in-process run of the
same mode, and writes ``benchmarks/results/e2e_ray.json``.

``--proximal-recompute`` runs every mode again with pi_prox recomputed by the logp stage
(``algorithm.proximal=recompute``; the default job takes it from the train step's own forward
pass, the same values) and reports the time per step that recompute costs
(``step_time_cost_s`` on the ``<mode>_prox_recompute`` rows).

Async rows also carry ``bound_vs_sync``: the samples/s the run would reach if its busiest role
never waited (samples / max(generation busy, training busy)) over sync's. The async schedules
give each phase one core where sync gives each all of them, so this, not ``ideal_speedup``
(which uses the async run's own one-core times for both sides), is their ceiling over sync.

    python benchmarks/e2e.py [--steps 60] [--repeat 3] [--backend local|ray] [--rollout embedded|server|agent|vllm]
        [--proximal-recompute] [--config ...] [key=value ...]

``--mini-batches M`` runs every mode again with ``train.mini_batches=M`` (M optimizer steps per
train step, the same samples), sync with the thread budget it won with, and reports each row's
samples/s against its one-step row (``vs_one_step``): what the extra optimizer steps cost at equal
work per sample. Give a proximal source valid for both (``-- algorithm.proximal=loglinear``: the
default job's ``current`` is refused with several optimizer steps). Writes
``benchmarks/results/e2e_mini_batches.json``.

``--repeat N`` measures every mode N times, each run against its own sync; the headline speedups
are the medians, each run's in ``speedup_<mode>_vs_sync_runs``.
"""

from __future__ import annotations

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
from _schedules import CORES, SYNC_BUDGETS, best_sync_row
from rich.console import Console
from rich.table import Table

from tandem.core.config import TandemConfig
from tandem.pipeline import AsyncTrainingFlow, FlowResult, load_config
from tandem.pipeline.builders import build_components

RESULTS = {
    "local": Path(__file__).parent / "results" / "e2e.json",
    "ray": Path(__file__).parent / "results" / "e2e_ray.json",
    "server": Path(__file__).parent / "results" / "e2e_server.json",
    "agent": Path(__file__).parent / "results" / "e2e_server_agent.json",
    "vllm": Path(__file__).parent / "results" / "e2e_vllm.json",
    "mini_batches": Path(__file__).parent / "results" / "e2e_mini_batches.json",
}
MODES = {"sync": 0, "k1": 1, "k2": 2, "k4": 4}
# Generation in a server process: one thread there, the trainer one thread here (2 cores).
SERVER = ["engines.rollout=server", "engines.servers.startup_timeout_s=600"]
SERVER_ASYNC_THREADS = ["engines.generation_threads=1", "engines.train_threads=1"]
# The shipped agent that sees only the server's OpenAI endpoint (the same single completion).
AGENT = ["engines.servers.agent=tasks.arithmetic.openai_agent:solver"]


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
    rollout = getattr(cfg.engines, "rollout", "embedded")
    if rollout == "embedded":
        return await AsyncTrainingFlow(cfg).run()
    components = build_components(cfg)  # vLLM starts here (its engine core, compiled), before the clock
    try:
        if rollout != "vllm":
            await components.workflow.engine.start()  # type: ignore[attr-defined]  # the router: waits for the servers
        return await AsyncTrainingFlow(cfg, components=components).run()
    finally:
        await components.aclose()  # an agent's session exits in this loop


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
        "busiest_role_s": max(gen, train),
        "staleness_counts": result.staleness_counts,
        **sync_columns(result),
    }


def sync_columns(result: FlowResult) -> dict[str, float]:
    """For runs whose syncs are probed (vLLM): the largest probe gap, the median seconds per sync
    and the median seconds generation stood still for one."""
    probed = [s.metrics for s in result.syncs if "logprob_gap" in s.metrics]
    if not probed:
        return {}
    return {
        "logprob_gap_max": max(m["logprob_gap"] for m in probed),
        "sync_s": statistics.median(m["total_s"] for m in probed),
        "sync_stall_s": statistics.median(m["stall_s"] for m in probed),
        "syncs": len(probed),
    }


def run_modes(args: argparse.Namespace, backend: str, rollout: str = "embedded") -> list[dict[str, Any]]:
    """One row per mode on ``backend`` with generation ``rollout``; ``sync`` is the faster of its thread budgets."""
    served = rollout in ("server", "agent")
    overrides = [*args.overrides, f"cluster.backend={backend}", *(SERVER if served else []),
                 *(AGENT if rollout == "agent" else []), *(["engines.rollout=vllm"] if rollout == "vllm" else [])]
    rows = []
    for mode in args.modes:
        if mode == "sync":
            def measure(budget: list[str]) -> dict[str, Any]:
                return row("sync", *run_mode(args.config, 0, args.steps, [*overrides, *budget]))

            rows.append(best_sync_row(measure, "samples_per_s", ("samples_per_s", "reward_at_equal_samples")))
        else:
            split = SERVER_ASYNC_THREADS if served else []
            result, wall = run_mode(args.config, MODES[mode], args.steps, [*overrides, *split])
            rows.append({**row(mode, result, wall), "threads": "split between phases"})
    sync = next((r for r in rows if r["mode"] == "sync"), None)
    for r in rows:
        r["backend"] = backend
        r["rollout"] = rollout
        with_sync(r, sync)
    return rows


def with_sync(r: dict[str, Any], sync: dict[str, Any] | None) -> None:
    """Add ``r``'s speedup over ``sync`` and, for an async row, its ceiling over sync (``bound_vs_sync``)."""
    r["speedup_vs_sync"] = r["samples_per_s"] / sync["samples_per_s"] if sync else None
    overlapped = sync is not None and r is not sync and r["busiest_role_s"] > 0
    r["bound_vs_sync"] = r["samples"] / r["busiest_role_s"] / sync["samples_per_s"] if overlapped else None


def proximal_recompute_rows(args: argparse.Namespace, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each mode of ``rows`` again with pi_prox recomputed by the logp stage, sync with the thread
    budget it won with, against its own recompute sync: each row, named ``<mode>_prox_recompute``,
    says how much time per step the extra forward pass costs (``step_time_cost_s``)."""
    config = load_config(args.config)
    if config.algorithm.proximal != "current" or "logp" in config.flow.stages:
        raise SystemExit(f"--proximal-recompute compares with algorithm.proximal=current: {args.config} does not set it")
    stages = [s for s in config.flow.stages if s not in ("reward", "train")] + ["logp", "reward", "train"]
    overrides = [*args.overrides, "algorithm.proximal=recompute", f"flow.stages=[{', '.join(stages)}]"]
    budgets = dict(SYNC_BUDGETS)
    out = []
    for base in [r for r in rows if r["mode"] in MODES and r["backend"] == "local" and r["rollout"] == "embedded"]:
        threads = budgets.get(base["threads"], [])
        result, wall = run_mode(args.config, MODES[base["mode"]], args.steps, [*overrides, *threads])
        recompute = {**row(f"{base['mode']}_prox_recompute", result, wall), "threads": base["threads"],
                     "backend": "local", "rollout": "embedded"}
        recompute["step_time_cost_s"] = recompute["step_time_s"] - base["step_time_s"]
        out.append(recompute)
    sync = next((r for r in out if r["mode"] == "sync_prox_recompute"), None)
    for r in out:
        with_sync(r, sync)
    return out


def mini_batch_rows(args: argparse.Namespace, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each in-process mode of ``rows`` again with ``train.mini_batches`` optimizer steps per train
    step (sync with the thread budget it won with); each row, named ``<mode>_m<M>``, carries its
    samples/s over its one-step row's (``vs_one_step``)."""
    budgets = dict(SYNC_BUDGETS)
    out = []
    for base in [r for r in rows if r["mode"] in MODES and r["backend"] == "local" and r["rollout"] == "embedded"]:
        threads = budgets.get(base["threads"], [])
        overrides = [*args.overrides, f"train.mini_batches={args.mini_batches}", *threads]
        result, wall = run_mode(args.config, MODES[base["mode"]], args.steps, overrides)
        stepped = {**row(f"{base['mode']}_m{args.mini_batches}", result, wall), "threads": base["threads"],
                   "backend": "local", "rollout": "embedded"}  # fmt: skip
        stepped["vs_one_step"] = stepped["samples_per_s"] / base["samples_per_s"]
        out.append(stepped)
    sync = next((r for r in out if r["mode"] == f"sync_m{args.mini_batches}"), None)
    for r in out:
        with_sync(r, sync)
    return out


def measure_once(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every mode once on each path asked for: one run's rows, speedups against that run's own sync."""
    rows = run_modes(args, "local")
    if args.proximal_recompute:
        rows += proximal_recompute_rows(args, rows)
    if args.mini_batches > 1:
        rows += mini_batch_rows(args, rows)
    if args.rollout in ("server", "agent"):
        rows += run_modes(args, "local", "server")
    if args.rollout == "agent":
        rows += run_modes(args, "local", "agent")
    if args.rollout == "vllm":
        rows += run_modes(args, "local", "vllm")
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
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--config", default=str(Path(__file__).parent.parent / "configs" / "default.yaml"))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--backend", default="local", choices=["local", "ray"])
    parser.add_argument("--rollout", default="embedded", choices=["embedded", "server", "agent", "vllm"],
                        help="server: every mode also with generation in a tandem serve process; "
                             "agent: and again with the rollouts made by the shipped OpenAI-client agent; "
                             "vllm: every mode also with vLLM in process")
    parser.add_argument("--proximal-recompute", action="store_true",
                        help="every mode also with pi_prox recomputed by the logp stage")
    parser.add_argument("--mini-batches", type=int, default=1,
                        help="every mode also with this many optimizer steps per train step (train.mini_batches)")
    parser.add_argument("--repeat", type=int, default=1, help="measure every mode this many times (spread between runs)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value applied to every mode (after --)")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    rows = []
    for run in range(args.repeat):
        rows += [{**r, "run": run} for r in measure_once(args)]
    headline = args.rollout
    speedups: dict[str, list[float]] = {}  # mode -> its speedup over sync in each run
    for r in rows:
        if r["backend"] == args.backend and r["rollout"] == headline and r["mode"] in MODES and r["speedup_vs_sync"]:
            speedups.setdefault(r["mode"], []).append(r["speedup_vs_sync"])

    table = Table(title=f"End to end: default job, {args.steps} steps per mode, {os.cpu_count()} cores")
    for col in ("run", "backend", "rollout", "mode", "threads", "samples/s", "tokens/s", "s/step", "vs sync", "bound", "ideal",
                "reward 1st 1/4", "reward at equal samples", "Ray overhead s/step", "probe gap", "sync s (stall)", "vs 1 step"):
        table.add_column(col, justify="right")
    for r in rows:
        speedup = "—" if r["speedup_vs_sync"] is None else f"{r['speedup_vs_sync']:.2f}x"
        bound = "—" if r["bound_vs_sync"] is None else f"{r['bound_vs_sync']:.2f}x"
        overhead = f"{r['ray_overhead_s_per_step']:+.3f}" if "ray_overhead_s_per_step" in r else ""
        probe = f"{r['logprob_gap_max']:.1e}" if "logprob_gap_max" in r else ""
        sync_s = f"{r['sync_s']:.3f} ({r['sync_stall_s']:.3f})" if "sync_s" in r else ""
        table.add_row(str(r["run"]), r["backend"], r["rollout"], r["mode"], r["threads"], f"{r['samples_per_s']:.1f}",
                      f"{r['tokens_per_s']:.0f}", f"{r['step_time_s']:.2f}", speedup, bound, f"{r['ideal_speedup']:.2f}x",
                      f"{r['reward_first_quarter']:.3f}", f"{r['reward_at_equal_samples']:.3f}", overhead, probe, sync_s,
                      f"{r['vs_one_step']:.2f}x" if "vs_one_step" in r else "")
        for other in r.get("other_sync_schedules", []):
            table.add_row("", "", "", "(sync)", other["threads"], f"{other['samples_per_s']:.1f}", "", "", "", "", "", "",
                          f"{other['reward_at_equal_samples']:.3f}", "", "", "", "")
    Console(width=220).print(table)
    results = RESULTS["mini_batches" if args.mini_batches > 1 else args.backend if args.rollout == "embedded" else args.rollout]
    results.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "rows": rows,
        # The median over runs; each run's own in the *_runs lists.
        **{f"speedup_{mode}_vs_sync": statistics.median(speedups[mode]) if mode in speedups else None
           for mode in ("k1", "k2", "k4")},
        **{f"speedup_{mode}_vs_sync_runs": speedups.get(mode, []) for mode in ("k1", "k2", "k4")},
        "settings": {"steps": args.steps, "config": args.config, "overrides": args.overrides, "backend": args.backend,
                     "rollout": args.rollout, "repeat": args.repeat, "mini_batches": args.mini_batches},
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine(),
                    # Other work on the machine shares its cores: read the numbers with this.
                    "load_average_1m_at_end": os.getloadavg()[0]},
    }
    results.write_text(json.dumps(doc, indent=2))
    print(f"wrote {results}")


if __name__ == "__main__":
    main()
