"""Soak: a long simulated run with random faults in every role; does anything grow or leak?

The real flow (all roles, validation included) drives the fake engines on a virtual clock for
10,000 steps, with seeded faults in every role's engine calls (``engines.faults``: exceptions
and extra delays, weight syncs included), every role on ``on_error: drop`` with one retry, and
weight-sync degradation on. It reports:

- memory: the Python heap (tracemalloc) from warm-up to the last step, split in two. *Kept
  records* are what the run keeps by design, one entry per step, sync, drop, evaluation or mode
  change: the step history behind ``FlowResult.steps`` and ``metrics.jsonl``, the sync,
  evaluation and mode-change records, the ledger's drop records and dropped ids. They are the
  history the user asked for, not a leak, and grow linearly (about 1 KB per step here). They
  are told apart by the line that allocated them (tracemalloc keeps one frame: more made the
  run several times slower): lines in ``state_machines/train.py``, ``param_update.py`` and
  ``validate.py`` (what those roles keep is their records, beside a few counters and the train
  role's buffer of at most k + 1 steps), ``pipeline/history.py`` and ``pipeline/ledger.py``, and
  five lines whose objects the records hold: the dataloader's position count (prompt ids), the
  gate's step count (a drop record keeps its step), the fake trainer's metrics (a step record
  copies them), the error policy's drop reason (a drop record keeps it) and the virtual clock's
  ``time()`` (a step record keeps its time stamp; a leak made of time stamps alone would be
  missed). Those lines are found by their text: if one moves out of sight, its objects count as
  growth, so the check fails loudly, never silently. The benchmark's own bookkeeping (this
  file, tracemalloc) is left out too. Each reading runs the cyclic garbage collector first (a
  failed call's exception, traceback and retry state form cycles: garbage, not live).
  Everything else is the *working set* (groups in flight, channels, engines, the gate, the
  metrics): that is what must not grow. It swings with the items in flight at the instant of a
  reading, so it is read every ``--every`` steps and growth is taken two ways: the median of
  the last ten readings minus the median of the first ten, and a least-squares slope over all
  readings times the steps after warm-up. Target: both at most 5 % of the warm-up working set.
  RSS is shown for information only: it holds the kept records, tracemalloc's own per-block
  bookkeeping and pages the allocator keeps;
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

import _bootstrap  # noqa: F401  (first: imports resolve to the project)
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
from looptime._internal import loops as looptime_loops
from rich.console import Console
from rich.table import Table

from pipeline import AsyncTrainingFlow, validate_config
from core.config import FAULT_ROLES
from core.history import StepRecord

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


def kept_record_filters() -> list[tracemalloc.Filter]:
    """Filters that leave out the allocations of the records the run keeps by design."""
    import engines.fake
    import core.history
    import core.ledger
    import core.staleness
    import state_machines.base
    import state_machines.dataloader
    import state_machines.param_update
    import state_machines.train
    import state_machines.validate

    kept = (state_machines.train, state_machines.param_update, state_machines.validate, core.history, core.ledger)
    filters = [tracemalloc.Filter(False, m.__file__) for m in (*kept, sys.modules[__name__], tracemalloc)]
    held_by_records = [
        (state_machines.dataloader, "self.position += 1"),  # prompt ids
        (core.staleness, "self._frontier += 1"),  # the steps drop records keep
        (engines.fake, 'return {"loss": 0.0'),  # the fake trainer's metrics
        (state_machines.base, 'await self.drop(items, f"'),  # drop reasons
        (looptime_loops, "return None if time is None else time / self.__resolution_reciprocal"),  # time stamps
    ]
    for module, text in held_by_records:
        source = Path(module.__file__)
        for lineno, line in enumerate(source.read_text().splitlines(), 1):
            if text in line:
                filters.append(tracemalloc.Filter(False, str(source), lineno=lineno))
    return filters


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
            snapshot = tracemalloc.take_snapshot()
            traced = sum(t.size for t in snapshot.traces)
            rest = sum(t.size for t in snapshot.filter_traces(self.filters).traces)
            self.samples.append(
                {"step": record.step + 1, "traced": traced, "kept_records": traced - rest, "rest": rest, "rss": rss_bytes()}
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
    probe = Probe(warmup=args.warmup, every=args.every, filters=kept_record_filters())
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
    base = statistics.median(r["rest"] for r in readings[:10])
    growth = statistics.median(r["rest"] for r in readings[-10:]) - base
    slope = statistics.linear_regression([r["step"] for r in readings], [r["rest"] for r in readings]).slope
    projected = slope * (end["step"] - warm["step"])
    growth_pct, projected_pct = 100.0 * growth / base, 100.0 * projected / base
    met = growth_pct <= 5.0 and projected_pct <= 5.0
    channels = {
        name: {"peak": st.max_depth, "capacity": st.capacity} for name, st in sorted(result.channels.items())
    }
    ledger = result.ledger
    balanced = ledger["balanced"] and ledger["in_flight"] == 0 and ledger["admitted"] == ledger["trained"] + ledger["dropped"]
    assert len(result.steps) == args.steps and max(result.staleness_counts) <= args.k
    report = {
        "settings": vars(args),
        "steps": len(result.steps),
        "simulated_s": result.wall_s,
        "real_s": real_s,
        "memory": {
            "warmup_step": warm["step"],
            "end_step": end["step"],
            "traced_warm_bytes": warm["traced"],
            "traced_end_bytes": end["traced"],
            "kept_records_warm_bytes": warm["kept_records"],
            "kept_records_end_bytes": end["kept_records"],
            "working_set_warm_bytes": base,
            "growth_excluding_records_bytes": growth,
            "growth_excluding_records_pct": growth_pct,
            "slope_bytes_per_step": slope,
            "projected_growth_bytes": projected,
            "projected_growth_pct": projected_pct,
            "rss_warm_bytes": warm["rss"],
            "rss_end_bytes": end["rss"],
            "readings": readings,
            "target_pct": 5.0,
            "met": met,
        },
        "queues": {"channels": channels, "peak_in_flight": probe.peak_in_flight, "in_flight_cap": cfg.max_concurrent},
        "ledger": {**ledger, "balanced_at_end": balanced},
        "sync_failures": sum(
            m.sync_failures for m in flow.machines if m.name == "param_update"  # type: ignore[attr-defined]
        ),
        "degradations": sum(m.degraded for m in result.mode_changes),
        "validations": [{"version": v.version, "accuracy": v.accuracy} for v in result.validations],
        "staleness_counts": result.staleness_counts,
    }

    console = Console(width=120)
    mib = 1 << 20
    memory = Table(title=f"Soak: {args.steps} steps, k = {args.k}, faults in every role "
                         f"(fail {args.failure_rate:.0%}, delay {args.delay_rate:.0%} of calls)")
    for col in ("step", "traced heap (MiB)", "kept records (MiB)", "rest (MiB)", "RSS (MiB)"):
        memory.add_column(col, justify="right")
    for s in readings[:: max(1, len(readings) // 10)] + readings[-1:]:
        memory.add_row(str(s["step"]), f"{s['traced'] / mib:.2f}", f"{s['kept_records'] / mib:.2f}",
                       f"{s['rest'] / mib:.3f}", f"{s['rss'] / mib:.1f}")
    console.print(memory)
    console.print(
        f"working set after warm-up {base / mib:.3f} MiB (median of 10 readings); growth to the end, excluding kept "
        f"records: {growth / 1024:+.1f} KiB = {growth_pct:+.2f} % (medians), slope {slope:+.2f} B/step = "
        f"{projected_pct:+.2f} % over the run; kept records {end['kept_records'] / end['step']:.0f} B/step "
        f"(target <= 5 %: {'met' if met else 'NOT met'})"
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
