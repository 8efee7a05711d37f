"""Learning quality under staleness: does async training learn as well as synchronous training?

The shipped arithmetic task and model (``configs/default.yaml``), k = 0, 1, 2, 4, several seeds,
the same sample budget for every row (``--steps`` optimizer steps of ``train.prompts_per_step``
groups of ``rollout.samples_per_prompt`` trained samples each; dynamic sampling generates more
to train the same number). Variants per k:

- (a) ``naive_ppo``: the behaviour log-probs are the old policy (``decoupled: false``, no logp stage);
- (b) ``decoupled_ppo`` (AReaL): trust region around pi_prox recomputed by the trainer, tokens
  weighted by pi_prox / pi_behav under AReaL's default correction (token-level mask above 5);
- (b') the same with pi_prox from the train step's own forward pass (``proximal: current``, no
  logp stage): the reward effect of skipping the recompute;
- (c) decoupled PPO with the best mismatch correction: the correction with the highest reward
  at the largest k among truncated IS per token, IcePop's two-sided token mask and a geometric
  sequence mask (a sweep run first, unless ``--correction`` names one);
- (d) (c) plus DAPO's dynamic sampling.

Per row, over the seeds: ``reward_mean`` (each run's mean training reward over the last quarter
of its steps, the reward at equal samples), its 95 % confidence half-width ``reward_ci95``
(Student t over seeds), and ``heldout_accuracy``: after training the final weights are loaded
into the rollout engine and each of ``--heldout`` held-out problems (the ones pretraining
reports on) is sampled once at the training temperature; the fraction fully correct. With
dynamic sampling the training reward is over the groups kept, which leaves out the equal-reward
ones (all right or all wrong): it is not comparable with the other rows; its held-out accuracy is.
Each row at k > 0 also has ``reward_delta_vs_k0`` and ``heldout_delta_vs_k0``: its difference from
the same variant at k = 0, seed by seed (same prompts), with their 95 % intervals: the seeds'
prompts move every row together, and the paired differences cancel that.

The goal (issue 14): (b)-(d) within noise of k = 0 at every k, (a) visibly worse at k = 4.
Prints a table and writes ``benchmarks/results/learning_quality.json``.

    python benchmarks/learning_quality.py [--steps 40] [--seeds 0 1 2] [--ks 0 1 2 4] [--heldout 64]
        [--correction icepop] [--variants naive decoupled ...] [key=value ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import structlog
import torch
from rich.console import Console
from rich.table import Table

from tandem.core.config import TandemConfig
from tandem.core.protocols import RolloutRequest
from tandem.core.records import PromptGroup
from tandem.pipeline import AsyncTrainingFlow, load_config
from tandem.pipeline.builders import build_components
from tandem.state_machines.generate import request_seed
from tandem.state_machines.validate import VALIDATION_IDS

RESULTS = Path(__file__).parent / "results" / "learning_quality.json"
CONFIG = Path(__file__).parent.parent / "configs" / "default.yaml"
WITH_LOGP = "flow.stages=[dataloader, generate, rollout, logp, reward, train]"
WITHOUT_LOGP = "flow.stages=[dataloader, generate, rollout, reward, train]"
# Mismatch corrections of the behaviour weight pi_prox / pi_behav (algorithms.corrections).
CORRECTIONS: dict[str, list[str]] = {
    "areal_token_mask": [],  # the default: masked IS per token above 5 (AReaL)
    "tis_token": ["algorithm.behaviour_weight_mode=clamp", "algorithm.behaviour_weight_cap=2.0"],  # Yao et al.: C = 2
    "icepop": ["algorithm.behaviour_weight_floor=0.5", "algorithm.behaviour_weight_cap=5.0"],  # Ring-1T: [0.5, 5]
    "geometric_mask": [
        "algorithm.behaviour_weight_level=geometric", "algorithm.behaviour_weight_floor=0.5",
        "algorithm.behaviour_weight_cap=2.0",
    ],
}
# The rows run at each k (see the module docstring): (a), (b), (b'), (c), (d).
VARIANTS = ("naive", "decoupled", "decoupled_current", "corrected", "dynamic")
# Student t 0.975 quantiles by degrees of freedom (no scipy needed for a handful of seeds).
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def variant(name: str, correction: str) -> dict[str, Any]:
    """The row labels and config overrides of one variant (see the module docstring)."""
    if name == "naive":
        # proximal back to its default: the default job sets ``current``, which naive PPO refuses.
        return {"loss": "naive_ppo", "correction": "none", "dynamic_sampling": False, "proximal": "behaviour",
                "overrides": ["algorithm.decoupled=false", "algorithm.proximal=recompute", WITHOUT_LOGP]}
    proximal = "current" if name == "decoupled_current" else "recompute"
    chosen = correction if name in ("corrected", "dynamic") else "areal_token_mask"
    overrides = [f"algorithm.proximal={proximal}", WITHOUT_LOGP if proximal == "current" else WITH_LOGP,
                 *CORRECTIONS[chosen]]
    if name == "dynamic":
        overrides.append("algorithm.dynamic_sampling=true")
    return {"loss": "decoupled_ppo", "correction": chosen, "dynamic_sampling": name == "dynamic", "proximal": proximal,
            "overrides": overrides}


def configure(args: argparse.Namespace, k: int, seed: int, overrides: list[str]) -> TandemConfig:
    return load_config(args.config, [
        f"run.max_steps={args.steps}", f"run.seed={seed}", f"run.name=lq_k{k}_s{seed}", f"staleness.max_staleness={k}",
        "observability.write_run_dir=false", "observability.metrics_port=null", "observability.trace=false",
        "validation.every_versions=null", *args.overrides, *overrides,
    ])


async def train_and_evaluate(config: TandemConfig, heldout: int) -> dict[str, float]:
    """Train one run; then load its final weights into the rollout engine and sample the held-out set."""
    components = build_components(config)
    try:
        started = time.perf_counter()
        result = await AsyncTrainingFlow(config, components).run()
        await components.weight_sync.sync(result.final_version)
        assert components.held_out is not None
        groups = [PromptGroup(VALIDATION_IDS + i, item, 1) for i, item in enumerate(components.held_out(heldout))]
        requests = [RolloutRequest(g, 0, request_seed(config.run.seed, g.prompt_id, 0), evaluation=True) for g in groups]
        trajectories = [t async for t in components.workflow.rollout(requests)]
        by_id = {g.prompt_id: g for g in groups}
        scores = await components.reward.score(trajectories, [by_id[t.prompt_id] for t in trajectories])
        tail = result.steps[-max(1, len(result.steps) // 4):]
        return {
            "reward": statistics.fmean(s.reward_mean for s in tail),
            "heldout": sum(s.ok and s.reward >= 1.0 for s in scores) / len(scores),
            "generated": result.ledger["admitted"] * config.rollout.samples_per_prompt,
            "trained": result.samples,
            "wall_s": time.perf_counter() - started,
        }
    finally:
        components.close()


def ci95(values: list[float]) -> float | None:
    """Half-width of the 95 % confidence interval of the mean over seeds; None with one seed."""
    if len(values) < 2:
        return None
    return T975.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))


def measure(args: argparse.Namespace, k: int, spec: dict[str, Any]) -> dict[str, Any]:
    runs = []
    for seed in args.seeds:
        runs.append(asyncio.run(train_and_evaluate(configure(args, k, seed, spec["overrides"]), args.heldout)))
        print(f"  k={k} {spec['loss']} {spec['correction']} ds={spec['dynamic_sampling']} prox={spec['proximal']} "
              f"seed={seed}: reward {runs[-1]['reward']:.3f} heldout {runs[-1]['heldout']:.3f} "
              f"({runs[-1]['wall_s']:.0f} s)", flush=True)
    rewards, heldout = [r["reward"] for r in runs], [r["heldout"] for r in runs]
    return {
        "k": k, **{key: spec[key] for key in ("loss", "correction", "dynamic_sampling", "proximal")},
        "seeds": list(args.seeds),
        "reward_mean": statistics.fmean(rewards), "reward_ci95": ci95(rewards),
        "heldout_accuracy": statistics.fmean(heldout), "heldout_ci95": ci95(heldout),
        "reward_per_seed": rewards, "heldout_per_seed": heldout,
        "samples_trained": runs[0]["trained"], "samples_generated_mean": statistics.fmean(r["generated"] for r in runs),
        "wall_s": sum(r["wall_s"] for r in runs),
    }


def add_paired_deltas(rows: list[dict[str, Any]]) -> None:
    """Give each row its difference from the same variant at k = 0, paired by seed.

    A seed fixes the prompts a run trains and is evaluated on, and the prompts move the reward
    more than anything compared here (one seed's rows sit about 0.1 above another's at every k).
    Differences taken seed by seed cancel that shared part, so their interval, not the rows'
    own, says whether staleness changed the outcome."""
    variant_key = ("loss", "correction", "dynamic_sampling", "proximal")
    at_k0 = {tuple(r[key] for key in variant_key): r for r in rows if r["k"] == 0}
    for r in rows:
        base = at_k0.get(tuple(r[key] for key in variant_key))
        if base is None or base["seeds"] != r["seeds"]:
            continue
        for metric in ("reward", "heldout"):
            deltas = [a - b for a, b in zip(r[f"{metric}_per_seed"], base[f"{metric}_per_seed"], strict=True)]
            r[f"{metric}_delta_vs_k0"] = statistics.fmean(deltas)
            r[f"{metric}_delta_vs_k0_ci95"] = ci95(deltas)


def _half(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def _delta(row: dict[str, Any], metric: str) -> str:
    if row["k"] == 0 or f"{metric}_delta_vs_k0" not in row:
        return ""
    return f"{row[f'{metric}_delta_vs_k0']:+.3f} ± {_half(row[f'{metric}_delta_vs_k0_ci95'])}"


def pick_correction(args: argparse.Namespace) -> tuple[str, list[dict[str, Any]]]:
    """The correction with the highest reward at the largest k (decoupled PPO, recomputed pi_prox)."""
    k = max(args.ks)
    sweep = []
    for name in CORRECTIONS:
        if name == "areal_token_mask":
            continue  # row (b) measures it
        spec = variant("corrected", name)
        sweep.append(measure(args, k, spec))
    return max(sweep, key=lambda r: r["reward_mean"])["correction"], sweep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--heldout", type=int, default=64, help="held-out problems sampled after training")
    parser.add_argument("--correction", choices=sorted(CORRECTIONS), help="skip the sweep: use this correction for (c), (d)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="the rows to run at each k")
    parser.add_argument("--config", default=str(CONFIG))
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("overrides", nargs="*", help="dotted.key=value applied to every run (after --)")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    torch.set_num_threads(1)

    started = time.perf_counter()
    sweep: list[dict[str, Any]] = []
    correction = args.correction
    if correction is None and {"corrected", "dynamic"} & set(args.variants):
        correction, sweep = pick_correction(args)
    rows = []
    for k in args.ks:
        for name in args.variants:
            rows.append(measure(args, k, variant(name, correction)))
    add_paired_deltas(rows)

    table = Table(title=f"Learning quality: arithmetic, {args.steps} steps per run, seeds {args.seeds}")
    for col in ("k", "loss", "correction", "proximal", "dyn. sampling", "reward (last 1/4)", "± ci95",
                "vs k = 0 (paired)", "held-out acc.", "± ci95", "vs k = 0 (paired)", "generated / trained"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["k"]), r["loss"], r["correction"], r["proximal"], "yes" if r["dynamic_sampling"] else "",
                      f"{r['reward_mean']:.3f}", _half(r["reward_ci95"]), _delta(r, "reward"),
                      f"{r['heldout_accuracy']:.3f}", _half(r["heldout_ci95"]), _delta(r, "heldout"),
                      f"{r['samples_generated_mean'] / r['samples_trained']:.2f}")
    Console(width=180).print(table)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "rows": rows,
        "correction_sweep": sweep,
        "best_correction": correction,
        "settings": {"steps": args.steps, "seeds": args.seeds, "ks": args.ks, "heldout": args.heldout,
                     "config": str(args.config), "overrides": args.overrides},
        "wall_s": time.perf_counter() - started,
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine(),
                    # Other work on the machine shares its cores: read the times with this.
                    "load_average_1m_at_end": os.getloadavg()[0]},
    }
    args.output.write_text(json.dumps(doc, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
