"""Overlap: how much of the long tail bounded-staleness async hides, on a simulated cluster.

The real flow (all roles, real admission and accounting) drives fake engines on a virtual
clock (looptime), so a 512-slot, 200-step run takes seconds and is deterministic. Generation
and training sit on disjoint resources. Sequence generation times are lognormal (the long
tail of reasoning-length responses); the train step time is set so that generation and
training are balanced: T_train = samples_per_step * mean_gen_s / slots.

For each setting (sync = k 0, then k = 1, 2, 4) the table reports the achieved step time
(steady state: the mean interval between step completions after a warm-up), the speedup over
sync, and the efficiency = ideal / achieved, where the analytic ideal is the step time of
perfect overlap with no tail: max(T_train, samples_per_step * mean_gen_s / slots).
It also reports what the staleness bound itself allows: samples of step t + k may start only
once version t is loaded (the end of train step t - 1) and must be done when train step t + k
starts, so a step period P satisfies (k + 1) * P - T_train >= M, with M the makespan of one
step's generation alone (measured in the sync run: sync step time - T_train). No scheduler
that keeps the bound and trains every sample can beat max(ideal, (M + T_train) / (k + 1));
``vs_bound`` is that limit over the achieved step time. Writes ``benchmarks/results/overlap.json``.

    python benchmarks/overlap.py [--slots 512] [--steps 200] [--sigma 0.5] ...
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import looptime
import structlog
from rich.console import Console
from rich.table import Table

from tandem.pipeline import AsyncTrainingFlow, FlowResult, validate_config

RESULTS = Path(__file__).parent / "results" / "overlap.json"


def simulate(k: int, args: argparse.Namespace) -> FlowResult:
    samples_per_step = args.prompts_per_step * args.samples_per_prompt
    train_s = samples_per_step * args.mean_gen_s / args.slots * args.train_ratio
    cfg = validate_config(
        {
            "run": {"max_steps": args.steps, "seed": args.seed},
            "staleness": {"max_staleness": k},
            "train": {"prompts_per_step": args.prompts_per_step},
            "rollout": {"samples_per_prompt": args.samples_per_prompt},
            # rollout -> reward -> train: logp scoring is folded into the train step here.
            "flow": {"stages": ["dataloader", "generate", "rollout", "reward", "train"],
                     "micro_batch_size": 16, "channel_capacity": 1024},
            "engines": {
                "type": "fake",
                "generation_slots": args.slots,
                "decode_step_s": args.decode_step_s,
                "generation_latency": {"type": "lognormal", "mean_s": args.mean_gen_s, "sigma": args.sigma},
                "train_step_latency": {"type": "constant", "mean_s": train_s},
                "sync_latency": {"type": "constant", "mean_s": args.sync_s},
            },
            "observability": {"write_run_dir": False, "trace": False},
        }
    )
    loop = looptime.new_event_loop(noop_cycles=1)  # nothing here waits on threads
    try:
        return loop.run_until_complete(AsyncTrainingFlow(cfg).run())
    finally:
        loop.close()


def steady_step_time(result: FlowResult, warmup: int) -> float:
    times = [s.time_s for s in result.steps]
    return (times[-1] - times[warmup]) / (len(times) - 1 - warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slots", type=int, default=512, help="generation slots (continuous-batching width x engines)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompts-per-step", type=int, default=128)
    parser.add_argument("--samples-per-prompt", type=int, default=16)
    parser.add_argument("--mean-gen-s", type=float, default=1.0, help="mean time to generate one sequence")
    parser.add_argument("--sigma", type=float, default=0.5, help="lognormal sigma of generation time (tail weight)")
    parser.add_argument("--train-ratio", type=float, default=1.0, help="train step time / balanced train step time")
    parser.add_argument("--decode-step-s", type=float, default=0.02, help="decode step: sequences end on this grid")
    parser.add_argument("--sync-s", type=float, default=0.0, help="weight sync time per step")
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    samples_per_step = args.prompts_per_step * args.samples_per_prompt
    gen_s = samples_per_step * args.mean_gen_s / args.slots
    train_s = gen_s * args.train_ratio
    ideal = max(gen_s, train_s)
    warmup = min(10, args.steps // 4)
    rows = []
    sync_time = None
    makespan = None  # one step's generation alone, from the sync run
    for k in args.ks:
        started = time.perf_counter()
        result = simulate(k, args)
        wall = time.perf_counter() - started
        step_time = steady_step_time(result, warmup)
        if k == 0:
            sync_time = step_time
            makespan = step_time - train_s - args.sync_s
        bound = max(ideal, (makespan + train_s) / (k + 1)) if makespan is not None else ideal
        assert result.ledger["balanced"] and max(result.staleness_counts) <= k
        rows.append(
            {
                "mode": "sync" if k == 0 else f"k{k}",
                "k": k,
                "workers": args.slots,
                "step_time_s": step_time,
                "ideal_step_time_s": ideal,
                "speedup_vs_sync": (sync_time / step_time) if sync_time else None,
                "efficiency": ideal / step_time,
                "bound_step_time_s": bound,
                "vs_bound": bound / step_time,
                "mean_staleness": sum(s * c for s, c in result.staleness_counts.items()) / sum(result.staleness_counts.values()),
                "simulated_s": result.wall_s,
                "real_s": wall,
            }
        )
    table = Table(title=(f"Overlap: {args.slots} slots, {samples_per_step} samples/step, lognormal sigma {args.sigma}, "
                         f"train {train_s:.2f}s vs generation {gen_s:.2f}s per step"))
    for col in ("mode", "step time (s)", "ideal (s)", "speedup vs sync", "efficiency", "k-bound (s)", "vs k-bound",
                "mean staleness", "real s"):
        table.add_column(col, justify="right")
    for r in rows:
        speedup = "—" if r["speedup_vs_sync"] is None else f"{r['speedup_vs_sync']:.2f}x"
        table.add_row(r["mode"], f"{r['step_time_s']:.3f}", f"{r['ideal_step_time_s']:.3f}", speedup,
                      f"{r['efficiency']:.3f}", f"{r['bound_step_time_s']:.3f}", f"{r['vs_bound']:.3f}",
                      f"{r['mean_staleness']:.2f}", f"{r['real_s']:.1f}")
    Console(width=150).print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
