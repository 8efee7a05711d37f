"""Soak: a long simulated run with random faults in every role; does anything grow or leak?

The real flow (all roles, validation included) drives the fake engines on a virtual clock for
10,000 steps, with seeded faults in every role's engine calls (``engines.faults``: exceptions
and extra delays, weight syncs included), every role on ``on_error: drop`` with one retry, and
weight-sync degradation on. It reports:

- memory: all of the Python heap (tracemalloc), but for the benchmark's own bookkeeping (this
  file and tracemalloc), and the process's RSS, from the end of warm-up to the last step. The run
  keeps bounded records only (``observability.keep_steps`` recent step and sync records, running
  totals; the rest streams to ``metrics.jsonl``), so nothing should grow with the step count.
  Each reading runs the cyclic garbage collector first (a failed call's exception, traceback and
  retry state form cycles: garbage, not live). The heap swings with the items in flight at the
  instant of a reading, so it is read every ``--every`` steps and growth is taken two ways: the
  median of the last ten readings against the median of the first ten, and a least-squares slope
  over all readings times the steps after warm-up. Targets: the heap grows at most 5 % both
  ways, the RSS (read the same way, medians) at most 10 %;
- queues: each channel's peak depth against its capacity (the channels track it), and the
  most groups in flight seen when a step landed against the in-flight cap (sampled: the gate
  keeps no peak; admission itself never passes the cap);
- the ledger: admitted = trained + dropped at the end, nothing in flight, drops per stage, and
  the failed syncs and degradations.

The trace is off (it is capped by ``observability.trace_max_events`` by design) and nothing is
written to disk. Writes ``benchmarks/results/soak.json``.

    python benchmarks/soak.py [--steps 10000] [--warmup 1000] [--failure-rate 0.05] ...
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import looptime
import structlog
from rich.console import Console
from rich.table import Table

from tandem.core.config import FAULT_ROLES
from tandem.core.history import StepRecord
from tandem.pipeline import AsyncTrainingFlow, validate_config

RESULTS = Path(__file__).parent / "results" / "soak.json"


def soak_config(args: argparse.Namespace) -> Any:
    fault = {
        "failure_rate": args.failure_rate,
        "delay_rate": args.delay_rate,
        "delay": {"type": "exponential", "mean_s": args.delay_s},
    }
    policy = {"on_error": "drop", "max_retries": 1, "retry_backoff_s": 0.05}
    return validate_config(
        {
            "run": {"max_steps": args.steps, "seed": args.seed},
            "staleness": {"max_staleness": args.k, "degrade_after_sync_failures": 1, "recover_after_syncs": 2},
            "train": {"prompts_per_step": args.prompts_per_step},
            "rollout": {"samples_per_prompt": args.samples_per_prompt},
            "flow": {"micro_batch_size": 4, "channel_capacity": 16},
            "roles": {role: policy for role in (*FAULT_ROLES, "validate")},
            "engines": {
                "type": "fake",
                "generation_slots": 16,
                "generation_latency": {"type": "lognormal", "mean_s": 1.0, "sigma": 0.8},
                "train_step_latency": {"type": "constant", "mean_s": 0.3},
                "logp_latency": {"type": "constant", "mean_s": 0.02},
                "reward_latency": {"type": "constant", "mean_s": 0.02},
                "sync_latency": {"type": "constant", "mean_s": 0.05},
                "faults": {role: fault for role in FAULT_ROLES},
            },
            "validation": {"every_versions": args.validate_every, "prompts": 8},
            "observability": {"write_run_dir": False, "trace": False},
        }
    )


def own_bookkeeping() -> list[tracemalloc.Filter]:
    """Leaves out what the benchmark itself allocates (its readings, tracemalloc's work)."""
    return [tracemalloc.Filter(False, m.__file__) for m in (sys.modules[__name__], tracemalloc)]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclasses.dataclass(slots=True)
class Probe:
    """Readings taken as steps land (the on_step callback)."""

    warmup: int
    every: int
    filters: list[tracemalloc.Filter]
    flow: AsyncTrainingFlow | None = None
    peak_in_flight: int = 0
    samples: list[dict[str, float]] = dataclasses.field(default_factory=list)

    def __call__(self, record: StepRecord) -> None:
        assert self.flow is not None
        services = self.flow.machines[0].services
        self.peak_in_flight = max(self.peak_in_flight, services.gate.in_flight)
        last = record.step + 1 == services.config.run.max_steps
        if record.step + 1 >= self.warmup and ((record.step + 1 - self.warmup) % self.every == 0 or last):
            gc.collect()
            snapshot = tracemalloc.take_snapshot().filter_traces(self.filters)
            self.samples.append(
                {"step": record.step + 1, "traced": sum(t.size for t in snapshot.traces), "rss": rss_bytes()}
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--warmup", type=int, default=1_000, help="steps before the first memory reading")
    parser.add_argument("--every", type=int, default=200, help="steps between memory readings")
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--samples-per-prompt", type=int, default=2)
    parser.add_argument("--failure-rate", type=float, default=0.05, help="per engine call, every role")
    parser.add_argument("--delay-rate", type=float, default=0.05, help="per engine call, every role")
    parser.add_argument("--delay-s", type=float, default=0.5, help="mean injected delay (exponential)")
    parser.add_argument("--validate-every", type=int, default=500, help="versions between held-out evaluations")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))

    cfg = soak_config(args)
    probe = Probe(warmup=args.warmup, every=args.every, filters=own_bookkeeping())
    tracemalloc.start(1)
    tracemalloc.take_snapshot().filter_traces(probe.filters)  # fills fnmatch's caches before any reading
    started = time.perf_counter()
    loop = looptime.new_event_loop(noop_cycles=1)  # nothing here waits on threads
    try:
        flow = probe.flow = AsyncTrainingFlow(cfg, on_step=probe)
        result = loop.run_until_complete(flow.run())
    finally:
        loop.close()
    real_s = time.perf_counter() - started
    tracemalloc.stop()

    readings = probe.samples
    warm, end = readings[0], readings[-1]

    def growth(key: str) -> tuple[float, float, float, float]:
        """(base, growth of the medians, slope per step, the slope over the run) of a reading."""
        base = statistics.median(r[key] for r in readings[:10])
        grown = statistics.median(r[key] for r in readings[-10:]) - base
        slope = statistics.linear_regression([r["step"] for r in readings], [r[key] for r in readings]).slope
        return base, grown, slope, slope * (end["step"] - warm["step"])

    heap_base, heap_growth, heap_slope, heap_projected = growth("traced")
    rss_base, rss_growth, _, rss_projected = growth("rss")
    heap_pct, heap_projected_pct = 100.0 * heap_growth / heap_base, 100.0 * heap_projected / heap_base
    rss_pct, rss_projected_pct = 100.0 * rss_growth / rss_base, 100.0 * rss_projected / rss_base
    met = max(heap_pct, heap_projected_pct) <= 5.0 and max(rss_pct, rss_projected_pct) <= 10.0
    channels = {
        name: {"peak": st.max_depth, "capacity": st.capacity} for name, st in sorted(result.channels.items())
    }
    ledger = result.ledger
    balanced = ledger["balanced"] and ledger["in_flight"] == 0 and ledger["admitted"] == ledger["trained"] + ledger["dropped"]
    assert result.total_steps == args.steps and max(result.staleness_counts) <= args.k
    services = flow.machines[0].services
    report = {
        "settings": vars(args),
        "steps": result.total_steps,
        "simulated_s": result.wall_s,
        "real_s": real_s,
        "memory": {
            "warmup_step": warm["step"],
            "end_step": end["step"],
            "traced_warm_bytes": heap_base,
            "traced_end_bytes": end["traced"],
            "traced_growth_bytes": heap_growth,
            "traced_growth_pct": heap_pct,
            "traced_slope_bytes_per_step": heap_slope,
            "traced_projected_growth_pct": heap_projected_pct,
            "rss_warm_bytes": rss_base,
            "rss_end_bytes": end["rss"],
            "rss_growth_pct": rss_pct,
            "rss_projected_growth_pct": rss_projected_pct,
            "readings": readings,
            "target_traced_pct": 5.0,
            "target_rss_pct": 10.0,
            "met": met,
        },
        "queues": {"channels": channels, "peak_in_flight": probe.peak_in_flight, "in_flight_cap": cfg.max_concurrent},
        "ledger": {**ledger, "balanced_at_end": balanced},
        "sync_failures": services.gate.syncs.failures,
        "degradations": sum(m.degraded for m in result.mode_changes),
        "validations": [{"version": v.version, v.measure: v.score} for v in result.validations],
        "staleness_counts": result.staleness_counts,
    }

    console = Console(width=120)
    mib = 1 << 20
    memory = Table(title=f"Soak: {args.steps} steps, k = {args.k}, faults in every role "
                         f"(fail {args.failure_rate:.0%}, delay {args.delay_rate:.0%} of calls)")
    for col in ("step", "traced heap (MiB)", "RSS (MiB)"):
        memory.add_column(col, justify="right")
    for s in readings[:: max(1, len(readings) // 10)] + readings[-1:]:
        memory.add_row(str(s["step"]), f"{s['traced'] / mib:.3f}", f"{s['rss'] / mib:.1f}")
    console.print(memory)
    console.print(
        f"heap after warm-up {heap_base / mib:.3f} MiB: {heap_growth / 1024:+.1f} KiB = {heap_pct:+.2f} % to the end "
        f"(medians), slope {heap_slope:+.2f} B/step = {heap_projected_pct:+.2f} % over the run (target <= 5 %); "
        f"RSS {rss_base / mib:.1f} MiB: {rss_pct:+.2f} % (medians), {rss_projected_pct:+.2f} % by slope (target <= 10 %): "
        f"{'met' if met else 'NOT met'}"
    )
    queues = Table(title="Queues: peak depth vs capacity")
    queues.add_column("queue")
    queues.add_column("peak", justify="right")
    queues.add_column("capacity", justify="right")
    for name, c in channels.items():
        queues.add_row(name, str(c["peak"]), str(c["capacity"]))
    queues.add_row("groups in flight (at step ends)", str(probe.peak_in_flight), str(cfg.max_concurrent))
    console.print(queues)
    console.print(
        f"ledger: admitted {ledger['admitted']} = trained {ledger['trained']} + dropped {ledger['dropped']} "
        f"(+ in flight {ledger['in_flight']}): {'balanced' if balanced else 'NOT balanced'}; dropped by stage "
        f"{ledger['dropped_by_stage']}; failed syncs {report['sync_failures']}, degradations {report['degradations']}, "
        f"validations {len(result.validations)}; {result.wall_s:.0f} simulated s in {real_s:.0f} real s"
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
