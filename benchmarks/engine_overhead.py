"""Engine overhead: samples per second through all eight roles when every stage costs nothing.

Zero-latency fake engines, one CPU core (the process pins itself to one core where the OS
allows), micro-batches of 1 and of 32. What is measured is the flow itself: channels, state
machines, admission, accounting. Prints a table and writes
``benchmarks/results/engine_overhead.json``.

    python benchmarks/engine_overhead.py [--steps 200]
"""

from __future__ import annotations

import _bootstrap  # noqa: F401  (first: imports resolve to the project)
import argparse
import asyncio
import json
import logging
import os
import platform
import time
from pathlib import Path

import structlog
from rich.console import Console
from rich.table import Table

from pipeline import AsyncTrainingFlow, validate_config

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
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    measure(32, 5)  # warm-up: imports and first-call costs stay out of the numbers
    rows = [measure(1, max(1, args.steps // 10)), measure(32, args.steps)]
    table = Table(title="Engine overhead: zero-cost stages, all eight roles, one core")
    for col in ("micro-batch", "samples", "seconds", "samples/s"):
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(str(row["micro_batch"]), str(row["samples"]), f"{row['seconds']:.2f}", f"{row['samples_per_s']:,.0f}")
    Console().print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "samples_per_s_batch1": rows[0]["samples_per_s"],
                "samples_per_s_batch32": rows[1]["samples_per_s"],
                "target_samples_per_s_batch32": 50_000,
                "rows": rows,
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
