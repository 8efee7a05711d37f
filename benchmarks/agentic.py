"""Agentic RL end to end: FrozenLake (shipped agent, real engines, CPU) in sync, k = 1 and k = 2.

Every mode trains the same number of steps on the same maps: the same episode budget. Episodes
vary in length (1 to 10 turns: a hole on the first move, or a walk to the turn limit), so a
synchronous step waits for its longest episode while the trainer idles; bounded staleness lets
the next steps' episodes run meanwhile. The sync baseline is the faster of the two synchronous
thread budgets (all cores to each phase in turn, or one core per phase), as in ``e2e.py``; the
async modes split the cores between generation and training.

Per mode: episodes/s (trained episodes over the run's wall time), time per step, success at
equal episodes (sampled, temperature-1 success of the final weights on all 1,000 held-out maps,
where the shipped model scores 0.322: on 200 one estimate's standard deviation, about 0.034, would
hide any difference between the modes; on 1,000 it is about 0.015), the mean training success of
the last quarter of steps, turns per episode, environment seconds per step, the mean version
span of an episode's tokens, and the ideal speedup of that run's own stage times,
(generation busy + training busy) / max(generation busy, training busy): what perfect overlap of
its measured phases would give over running them back to back. Prints a table and writes
``benchmarks/results/agentic.json`` with ``speedup_k1_vs_sync`` (and k = 2's) at the top.

    python benchmarks/agentic.py [--steps 30] [--modes sync k1 k2] [key=value ...]
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
from _schedules import CORES, best_sync_row
from rich.console import Console
from rich.table import Table

from tandem.pipeline import AsyncTrainingFlow, FlowResult, load_config
from tandem.tasks.frozenlake import HELD_OUT_MAPS

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "agentic_frozenlake.yaml"
RESULTS = Path(__file__).parent / "results" / "agentic.json"
MODES = {"sync": 0, "k1": 1, "k2": 2}


def run_mode(k: int, steps: int, overrides: list[str]) -> tuple[FlowResult, float]:
    cfg = load_config(CONFIG, [
        f"staleness.max_staleness={k}",
        f"run.max_steps={steps}",
        f"run.name=agentic_bench_k{k}",
        "validation.every_versions=null",  # evaluated after the run instead, on the same maps for every mode
        "observability.metrics_port=null",
        *overrides,
    ])
    started = time.perf_counter()
    result = asyncio.run(AsyncTrainingFlow(cfg).run())
    return result, time.perf_counter() - started


def held_out_success(model_path: Path) -> float:
    """Sampled (temperature 1) success of the weights at ``model_path`` on the report maps."""
    import torch
    from transformers import AutoModelForCausalLM

    from tandem.engines.shared.tokenizer import load_tokenizer
    from tandem.tasks.frozenlake import HELD_OUT_SEEDS
    from tandem.tasks.frozenlake.play import play, summarize

    torch.set_num_threads(CORES)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    episodes = play(model, load_tokenizer(model_path), list(HELD_OUT_SEEDS[:HELD_OUT_MAPS]), sampling_seed=0)
    return summarize(episodes).success


def row(mode: str, result: FlowResult, wall_s: float) -> dict[str, Any]:
    steps = result.steps
    busy = {name: r.state_seconds.get("running", 0.0) for name, r in result.roles.items()}
    gen = busy["generate"]
    train = busy["train"] + busy.get("logp", 0.0)  # logp runs on the trainer's weights and thread
    tail = steps[-max(1, len(steps) // 4):]

    def mean_metric(name: str, of: list[Any] = steps) -> float:
        return statistics.fmean(s.rollout_metrics[name] for s in of)

    episodes = sum(s.samples for s in steps)
    assert result.run_dir is not None
    return {
        "mode": mode,
        "steps": len(steps),
        "episodes": episodes,
        "wall_s": wall_s,
        "episodes_per_s": episodes / result.wall_s,
        "step_time_s": result.wall_s / len(steps),
        "success_at_equal_episodes": held_out_success(result.run_dir / "checkpoint"),
        "train_success_last_quarter": mean_metric("success", tail),
        "turns_per_episode": mean_metric("turns"),
        "env_step_s": mean_metric("env_step_s"),
        "version_span": mean_metric("version_span"),
        "generation_busy_s": gen,
        "training_busy_s": train,
        "ideal_speedup": (gen + train) / max(gen, train) if max(gen, train) > 0 else 1.0,
        "staleness_counts": result.staleness_counts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("overrides", nargs="*", help="dotted.key=value applied to every mode (after --)")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    rows = []
    for mode in args.modes:
        if mode == "sync":
            def measure(budget: list[str]) -> dict[str, Any]:
                return row("sync", *run_mode(0, args.steps, [*args.overrides, *budget]))

            rows.append(best_sync_row(measure, "episodes_per_s", ("episodes_per_s", "success_at_equal_episodes")))
        else:
            result, wall = run_mode(MODES[mode], args.steps, args.overrides)
            rows.append({**row(mode, result, wall), "threads": "split between phases"})
    sync = next((r for r in rows if r["mode"] == "sync"), None)
    for r in rows:
        r["speedup_vs_sync"] = r["episodes_per_s"] / sync["episodes_per_s"] if sync else None
    by_mode = {r["mode"]: r for r in rows}

    table = Table(title=f"Agentic RL: FrozenLake, {args.steps} steps per mode, {CORES} cores")
    for col in ("mode", "threads", "episodes/s", "s/step", "vs sync", "ideal", "held-out success", "train success (last 1/4)",
                "turns", "env s/step", "version span"):
        table.add_column(col, justify="right")
    for r in rows:
        speedup = "—" if r["speedup_vs_sync"] is None else f"{r['speedup_vs_sync']:.2f}x"
        table.add_row(r["mode"], r["threads"], f"{r['episodes_per_s']:.2f}", f"{r['step_time_s']:.2f}", speedup,
                      f"{r['ideal_speedup']:.2f}x", f"{r['success_at_equal_episodes']:.3f}",
                      f"{r['train_success_last_quarter']:.3f}", f"{r['turns_per_episode']:.2f}", f"{r['env_step_s']:.4f}",
                      f"{r['version_span']:.3f}")
        for other in r.get("other_sync_schedules", []):
            table.add_row("(sync)", other["threads"], f"{other['episodes_per_s']:.2f}", "", "", "",
                          f"{other['success_at_equal_episodes']:.3f}", "", "", "", "")
    Console(width=180).print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "rows": rows,
        "speedup_k1_vs_sync": by_mode["k1"]["speedup_vs_sync"] if sync and "k1" in by_mode else None,
        "speedup_k2_vs_sync": by_mode["k2"]["speedup_vs_sync"] if sync and "k2" in by_mode else None,
        "settings": {"steps": args.steps, "config": str(CONFIG.relative_to(ROOT)), "overrides": args.overrides,
                     "held_out_maps": HELD_OUT_MAPS},
        "machine": {"cores": CORES, "python": platform.python_version(), "machine": platform.machine(),
                    # Other work on the machine shares its cores: read the numbers with this.
                    "load_average_1m_at_end": os.getloadavg()[0]},
    }
    RESULTS.write_text(json.dumps(doc, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
