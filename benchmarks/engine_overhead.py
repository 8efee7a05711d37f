"""Engine overhead: samples per second through all eight roles when every stage costs nothing.

Zero-latency fake engines, one CPU core (the process pins itself to one core where the OS
allows), micro-batches of 1 and of 32. What is measured is the flow itself: channels, state
machines, admission, accounting. The machine is noisy, so it runs ``--runs`` times: the
headline figures are the slowest run's (a floor, not a best case), every run is kept in the
JSON with the spread. Prints a table and writes ``benchmarks/results/engine_overhead.json``.

    python benchmarks/engine_overhead.py [--steps 200] [--runs 5]
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

import structlog
from rich.console import Console
from rich.table import Table

from tandem.pipeline import AsyncTrainingFlow, validate_config

RESULTS = Path(__file__).parent / "results" / "engine_overhead.json"


def measure(micro_batch: int, steps: int, prompts_per_step: int = 64, n: int = 4) -> dict[str, float]:
    cfg = validate_config(
        {
            "run": {"max_steps": steps},
            "staleness": {"max_staleness": 1},
            "train": {"prompts_per_step": prompts_per_step},
            "rollout": {"samples_per_prompt": n},
            "flow": {"micro_batch_size": micro_batch, "channel_capacity": 256},
            "engines": {"type": "fake", "generation_slots": 4096},
            "observability": {"write_run_dir": False, "trace": False},
        }
    )
    started = time.perf_counter()
    result = asyncio.run(AsyncTrainingFlow(cfg).run())
    elapsed = time.perf_counter() - started
    samples = sum(s.samples for s in result.steps)
    return {"micro_batch": micro_batch, "samples": samples, "seconds": elapsed, "samples_per_s": samples / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per measurement")
    parser.add_argument("--runs", type=int, default=5, help="measurements of each micro-batch size")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    measure(32, 5)  # warm-up: imports and first-call costs stay out of the numbers
    runs = [[measure(1, max(1, args.steps // 10)), measure(32, args.steps)] for _ in range(args.runs)]
    table = Table(title=f"Engine overhead: zero-cost stages, all eight roles, one core ({args.runs} runs)")
    for col in ("micro-batch", "samples", "samples/s min", "median", "max"):
        table.add_column(col, justify="right")
    summary = {}
    for i, micro_batch in enumerate((1, 32)):
        rates = sorted(run[i]["samples_per_s"] for run in runs)
        summary[micro_batch] = {"min": rates[0], "median": statistics.median(rates), "max": rates[-1], "all": rates}
        spread = (f"{summary[micro_batch][k]:,.0f}" for k in ("min", "median", "max"))
        table.add_row(str(micro_batch), str(runs[0][i]["samples"]), *spread)
    Console().print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "samples_per_s_batch1": summary[1]["min"],
                "samples_per_s_batch32": summary[32]["min"],
                "target_samples_per_s_batch32": 50_000,
                "headline": "the slowest of the runs",
                "spread": {f"batch{mb}": v for mb, v in summary.items()},
                "rows": min(runs, key=lambda run: run[1]["samples_per_s"]),
                "runs": runs,
                "load_average": os.getloadavg(),
                "cpu_cores_used": 1,
                "python": platform.python_version(),
                "machine": platform.machine(),
            },
            indent=2,
        )
    )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
