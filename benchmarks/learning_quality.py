"""Learning quality: do staleness, mini-batches, the learning rate and distillation change what a run learns?

Every row trains the same sample budget (``--steps`` train steps of ``--config``, ``train.prompts_per_step``
groups of ``rollout.samples_per_prompt`` trained samples each; a row on another config trains as many
steps as that budget takes; dynamic sampling generates more to train the same number) on the same seeds,
and is compared with the baseline row, k = 0 decoupled PPO, seed by seed. The rows (``--rows``; the
baseline always runs, every difference is taken against it):

- ``<variant>_k<k>`` for k = 0, 1, 2, 4, one optimizer step per train step, and ``<variant>_m4_k<k>``
  with ``train.mini_batches=4`` (four optimizer steps inside one version: AReaL's setting, where
  decoupled PPO's clip around pi_prox binds). Variants:
  ``naive``: the behaviour log-probs are the old policy (``decoupled: false``, no logp stage);
  ``decoupled`` (AReaL): trust region around pi_prox recomputed by the trainer (the logp stage), tokens
  weighted by pi_prox / pi_behav under AReaL's default correction (token-level mask above 5);
  ``decoupled_current``: pi_prox from the train step's own forward pass (no logp stage; refused with
  more than one optimizer step, so it has no ``_m4`` rows); ``loglinear``: AReaL's log-linear pi_prox
  (``algorithms.prox``, no logp stage); ``corrected``: decoupled PPO with the best mismatch correction,
  the one with the highest reward at the largest k of the selected rows among truncated IS per
  token, IcePop's two-sided token mask and a geometric sequence mask (a sweep run first, unless
  ``--correction`` names one); ``dynamic``: ``corrected`` plus DAPO's dynamic sampling.
- ``decoupled_k0_lr0.5x``, ``decoupled_k0_lr2x``: the baseline at half and twice ``engines.lr``, to say
  whether the chosen learning rate is near the best one.
- ``distill``: on-policy distillation, ``configs/distill_arithmetic.yaml`` as shipped (its k = 1), and
  ``grpo``: the same config without the teacher. Both also measure held-out accuracy along the way
  (the validate role, ``CURVE_POINTS`` times per run, on the same held-out problems as the final
  measure; a version it falls behind on is skipped, not queued), which says how many samples each
  needed to reach a given accuracy.

The default (``DEFAULT_ROWS``): decoupled k = 0 and 4, naive k = 4 (at M = 1, and at M = 4 beside
decoupled M = 4: only there does decoupled PPO's clip bind, AReaL's comparison on equal terms), decoupled
with M = 4 at k = 0 and 4, the two learning rates, distill and grpo: 10 rows x 8 seeds = 80 runs of
20 steps (1,280 samples each), 512 held-out problems. Cost, measured Nov 26 on 2 cores (one run of
each kind): with no other work, 20 steps take about 27 s at k = 0 with the logp stage and 20 s at
k = 4 (generation overlaps training), 512 held-out problems 5 s, building a run's engines about 3 s,
distill and grpo (40 steps of 32 samples, 5 evaluations along the way) about 55 s each: one seed of
the default rows about 360 s, 8 seeds about 50 minutes. With other work at a load of 2, a seed of
the baseline took 51 s and distill and grpo about 70 s each: about 475 s a seed, 65 minutes. So 20
steps, half the previous run's 40: the 8 seeds the intervals need and the rows the issue asks for
leave no more in an hour. 512 held-out problems keep the standard error of a row's mean held-out
accuracy below 0.01 (about 0.022 per run, 0.008 over 8 seeds) for 5 s a run.

Per row, over the seeds: ``reward_mean`` (each run's mean training reward over the last quarter of
its steps, the reward at equal samples), its 95 % confidence half-width ``reward_ci95`` (Student t
over seeds), and ``heldout_accuracy``: after training the final weights are loaded into the rollout
engine and each of ``--heldout`` held-out problems (the ones pretraining reports on) is sampled
once at the training temperature; the share that meets the task's held-out measure (fully
correct). With dynamic sampling the training reward is over the groups kept, which leaves out the
equal-reward ones (all right or all wrong): it is not comparable with the other rows; its held-out
accuracy is. Each row also has ``reward_delta_vs_baseline`` and ``heldout_delta_vs_baseline``: its
difference from the baseline seed by seed (same prompts), with their 95 % intervals.

The two headline questions are fields of the JSON: ``naive_vs_decoupled_k4`` (is naive PPO at k = 4
worse than decoupled PPO at k = 4 beyond the interval, AReaL's Table 2 direction: naive − decoupled
paired by seed, at each M both ran) and ``distill_vs_grpo`` (does distillation reach the GRPO run's
final held-out accuracy in fewer samples: per seed, the samples each run's curve needed to first
reach the grpo run's final accuracy of that seed, and distill − grpo paired). ``lr_sweep`` says
whether a neighbouring learning rate beats the baseline's beyond the interval.

Prints a table and writes ``benchmarks/results/learning_quality.json``. ``--markdown FILE`` prints
a results file's paired differences as a Markdown table (``markdown_table``: for the README) and
runs nothing.

    python benchmarks/learning_quality.py [--steps 20] [--seeds 0 1 ... 7] [--rows decoupled_k4 naive_m4_k4 ...]
        [--heldout 512] [--correction icepop] [--out PATH] [key=value ...]
    python benchmarks/learning_quality.py --markdown benchmarks/results/learning_quality.json
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from rich.console import Console
from rich.table import Table

from tandem.core.config import TandemConfig, load_config
from tandem.core.protocols import RolloutRequest
from tandem.core.records import PromptGroup

# torch and the flow (``tandem.pipeline``, the engines it builds) are imported in the functions that
# use them: every run's reward worker is spawned, and a spawned child re-imports this script (and
# lora.py's, which imports this one), whose top is then all it pays for: with torch there, each run
# spent about 2 s of CPU for nothing, and with the flow about 0.3 s.

RESULTS = Path(__file__).parent / "results" / "learning_quality.json"
CONFIG = Path(__file__).parent.parent / "configs" / "default.yaml"
DISTILL_CONFIG = Path(__file__).parent.parent / "configs" / "distill_arithmetic.yaml"
WITH_LOGP = "flow.stages=[dataloader, generate, rollout, logp, reward, train]"
WITHOUT_LOGP = "flow.stages=[dataloader, generate, rollout, reward, train]"
# Mismatch corrections of the behaviour weight pi_prox / pi_behav (algorithms.corrections).
CORRECTIONS: dict[str, list[str]] = {
    "areal_token_mask": [],  # the default: masked IS per token above 5 (AReaL)
    "tis_token": ["algorithm.behaviour_weight_mode=clamp", "algorithm.behaviour_weight_cap=2.0"],  # Yao et al.: C = 2
    "icepop": ["algorithm.behaviour_weight_floor=0.5", "algorithm.behaviour_weight_cap=5.0"],  # Ring-1T: [0.5, 5]
    "geometric_mask": [
        "algorithm.behaviour_weight_level=geometric",
        "algorithm.behaviour_weight_floor=0.5",
        "algorithm.behaviour_weight_cap=2.0",
    ],
}
# The policy-loss variants of the default config's rows (see the module docstring).
VARIANTS = ("naive", "decoupled", "decoupled_current", "loglinear", "corrected", "dynamic")
KS = (0, 1, 2, 4)
LR_SCALES = (0.5, 2.0)
# Held-out evaluations along a ``curve`` run (versions 0, n/5, ...; the final measure is the last point).
CURVE_POINTS = 5
# Student t 0.975 quantiles by degrees of freedom (no scipy needed for a handful of seeds).
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


@dataclass(frozen=True)
class Row:
    """What one row runs: a variant (``VARIANTS``, ``distill`` or ``grpo``) on a config."""

    variant: str
    k: int | None = None  # None: the config's own staleness bound
    mini_batches: int = 1
    lr_scale: float = 1.0
    config: Path | None = None  # None: --config
    curve: bool = False  # held-out accuracy along the way (samples to reach an accuracy)


def _rows() -> dict[str, Row]:
    rows: dict[str, Row] = {}
    for k in KS:
        for name in VARIANTS:
            rows[f"{name}_k{k}"] = Row(name, k)
        for name in VARIANTS:
            if name != "decoupled_current":  # refused with more than one optimizer step per train step
                rows[f"{name}_m4_k{k}"] = Row(name, k, mini_batches=4)
    for scale in LR_SCALES:
        rows[f"decoupled_k0_lr{scale:g}x"] = Row("decoupled", 0, lr_scale=scale)
    rows["distill"] = Row("distill", config=DISTILL_CONFIG, curve=True)
    rows["grpo"] = Row("grpo", config=DISTILL_CONFIG, curve=True)
    return rows


ROWS = _rows()
BASELINE = "decoupled_k0"
DEFAULT_ROWS = (
    BASELINE,
    "decoupled_k4",
    "naive_k4",
    "naive_m4_k4",
    "decoupled_m4_k0",
    "decoupled_m4_k4",
    "decoupled_k0_lr0.5x",
    "decoupled_k0_lr2x",
    "distill",
    "grpo",
)


def variant(name: str, correction: str | None) -> dict[str, Any]:
    """The correction label and config overrides of one variant (see the module docstring)."""
    if name == "naive":
        # proximal back to its default: the default job sets ``current``, which naive PPO refuses.
        return {"correction": "none", "overrides": ["algorithm.decoupled=false", "algorithm.proximal=recompute", WITHOUT_LOGP]}
    if name == "distill":
        return {"correction": "areal_token_mask", "overrides": []}  # the config as shipped
    if name == "grpo":
        return {"correction": "areal_token_mask", "overrides": ["teacher=null", WITHOUT_LOGP]}
    proximal = {"decoupled_current": "current", "loglinear": "loglinear"}.get(name, "recompute")
    chosen = correction if name in ("corrected", "dynamic") else "areal_token_mask"
    assert chosen is not None, "corrected and dynamic rows need a correction (the sweep picks one)"
    overrides = [f"algorithm.proximal={proximal}", WITH_LOGP if proximal == "recompute" else WITHOUT_LOGP, *CORRECTIONS[chosen]]
    if name == "dynamic":
        overrides.append("algorithm.dynamic_sampling=true")
    return {"correction": chosen, "overrides": overrides}


def sample_budget(args: argparse.Namespace) -> int:
    """Trained samples per run: ``--steps`` train steps of ``--config``."""
    config = load_config(args.config, args.overrides)
    return args.steps * config.train.prompts_per_step * config.rollout.samples_per_prompt


def configure(args: argparse.Namespace, name: str, row: Row, seed: int, overrides: list[str]) -> TandemConfig:
    """One run's config: as many steps as the sample budget takes, the row's lr and evaluations."""
    path = row.config or args.config
    fixed = [
        f"run.seed={seed}",
        f"run.name=lq_{name}_s{seed}",
        f"train.mini_batches={row.mini_batches}",
        *([f"staleness.max_staleness={row.k}"] if row.k is not None else []),
        "observability.write_run_dir=false",
        "observability.metrics_port=null",
        "observability.trace=false",
        "validation.every_versions=null",
        f"validation.prompts={args.heldout}",
        *args.overrides,
        *overrides,
    ]
    config = load_config(path, fixed)
    per_step = config.train.prompts_per_step * config.rollout.samples_per_prompt
    budget = sample_budget(args)
    if budget % per_step:
        raise ValueError(f"row {name}: {per_step} samples per step do not divide the budget of {budget} samples")
    steps = budget // per_step
    return load_config(
        path,
        [
            *fixed,
            f"run.max_steps={steps}",
            f"engines.lr={config.engines.lr * row.lr_scale}",
            *([f"validation.every_versions={max(1, steps // CURVE_POINTS)}"] if row.curve else []),
        ],
    )


async def train_and_evaluate(config: TandemConfig, heldout: int) -> dict[str, Any]:
    """Train one run; then load its final weights into the rollout engine and sample the held-out set.

    ``curve``: (trained samples, held-out accuracy) at each version the validate role evaluated
    (on the same problems), then at the end."""
    from tandem.pipeline import AsyncTrainingFlow
    from tandem.pipeline.builders import build_components
    from tandem.state_machines.generate import request_seed
    from tandem.state_machines.validate import VALIDATION_IDS

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
        accuracy = sum(components.held_out_measure.met_by(s) for s in scores) / len(scores)
        per_step = config.train.prompts_per_step * config.rollout.samples_per_prompt
        tail = result.steps[-max(1, len(result.steps) // 4) :]
        return {
            "reward": statistics.fmean(s.reward_mean for s in tail),
            "heldout": accuracy,
            "curve": [[v.version * per_step, v.score] for v in result.validations] + [[result.samples, accuracy]],
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


def measure(args: argparse.Namespace, name: str, row: Row, correction: str | None) -> dict[str, Any]:
    spec = variant(row.variant, correction)
    runs, config = [], None
    for seed in args.seeds:
        config = configure(args, name, row, seed, spec["overrides"])
        runs.append(asyncio.run(train_and_evaluate(config, args.heldout)))
        print(
            f"  {name} seed={seed}: reward {runs[-1]['reward']:.3f} heldout {runs[-1]['heldout']:.3f} "
            f"({runs[-1]['wall_s']:.0f} s)",
            flush=True,
        )
    assert config is not None
    algo = config.algorithm
    rewards, heldout = [r["reward"] for r in runs], [r["heldout"] for r in runs]
    return {
        "row": name,
        "config": Path(row.config or args.config).name,
        "k": config.staleness.max_staleness,
        "mini_batches": config.train.mini_batches,
        "lr": config.engines.lr,
        "advantage": "distill" if config.teacher is not None else algo.advantage,
        "loss": "decoupled_ppo" if algo.decoupled else "naive_ppo",
        "correction": spec["correction"],
        "dynamic_sampling": algo.dynamic_sampling,
        "proximal": algo.proximal if algo.decoupled else "behaviour",
        "seeds": list(args.seeds),
        "steps": config.run.max_steps,
        "reward_mean": statistics.fmean(rewards),
        "reward_ci95": ci95(rewards),
        "heldout_accuracy": statistics.fmean(heldout),
        "heldout_ci95": ci95(heldout),
        "reward_per_seed": rewards,
        "heldout_per_seed": heldout,
        **({"curve_per_seed": [r["curve"] for r in runs]} if row.curve else {}),
        "samples_trained": runs[0]["trained"],
        "samples_generated_mean": statistics.fmean(r["generated"] for r in runs),
        "wall_s": sum(r["wall_s"] for r in runs),
    }


def paired(a: dict[str, Any], b: dict[str, Any], metric: str) -> tuple[float, float | None]:
    """Mean of ``a - b`` over seeds, and its 95 % half-width (both rows ran the same seeds)."""
    deltas = [x - y for x, y in zip(a[f"{metric}_per_seed"], b[f"{metric}_per_seed"], strict=True)]
    return statistics.fmean(deltas), ci95(deltas)


def add_paired_deltas(rows: list[dict[str, Any]], baseline: dict[str, Any]) -> None:
    """Give each row its difference from the baseline row, paired by seed.

    A seed fixes the prompts a run trains and is evaluated on, and the prompts move the reward
    more than anything compared here (one seed's rows sit about 0.1 above another's at every k).
    Differences taken seed by seed cancel that shared part, so their interval, not the rows'
    own, says whether a row changed the outcome."""
    for r in rows:
        if r is baseline:
            continue
        for metric in ("reward", "heldout"):
            r[f"{metric}_delta_vs_baseline"], r[f"{metric}_delta_vs_baseline_ci95"] = paired(r, baseline, metric)


def below(mean: float | None, half: float | None) -> bool:
    """Whether the whole 95 % interval lies below zero."""
    return mean is not None and half is not None and mean + half < 0


def naive_vs_decoupled(by_name: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Headline (a), AReaL's Table 2 direction: naive − decoupled PPO at k = 4, paired by seed, at
    each number of mini-batches both rows ran."""
    out = []
    for m in ("", "_m4"):
        naive, decoupled = by_name.get(f"naive{m}_k4"), by_name.get(f"decoupled{m}_k4")
        if naive is None or decoupled is None:
            continue
        entry: dict[str, Any] = {"mini_batches": naive["mini_batches"]}
        for metric in ("reward", "heldout"):
            mean, half = paired(naive, decoupled, metric)
            entry |= {f"{metric}_delta": mean, f"{metric}_delta_ci95": half, f"naive_worse_{metric}": below(mean, half)}
        out.append(entry)
    return out


def samples_to_reach(curve: list[list[float]], target: float) -> float | None:
    """Trained samples at the first evaluation at or above ``target``; None if none reached it."""
    return next((samples for samples, score in curve if score >= target), None)


def distill_vs_grpo(by_name: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Headline (b), the peers' claim for distillation: does it reach the GRPO run's final held-out
    accuracy in fewer samples? Per seed the target is the grpo run's final accuracy, which that run
    reaches at the latest at its end; a distill run that never reaches it leaves its seed out of the
    paired difference and the answer no."""
    distill, grpo = by_name.get("distill"), by_name.get("grpo")
    if distill is None or grpo is None:
        return None
    targets = grpo["heldout_per_seed"]
    ours = [samples_to_reach(c, t) for c, t in zip(distill["curve_per_seed"], targets, strict=True)]
    theirs = [samples_to_reach(c, t) for c, t in zip(grpo["curve_per_seed"], targets, strict=True)]
    deltas = [a - b for a, b in zip(ours, theirs, strict=True) if a is not None and b is not None]
    mean = statistics.fmean(deltas) if deltas else None
    half = ci95(deltas)
    heldout, heldout_half = paired(distill, grpo, "heldout")
    return {
        "target_per_seed": targets,
        "distill_samples_per_seed": ours,
        "grpo_samples_per_seed": theirs,
        "distill_reached": len(deltas),
        "seeds": len(targets),
        "samples_delta": mean,
        "samples_delta_ci95": half,
        "distill_fewer_samples": len(deltas) == len(targets) and below(mean, half),
        "heldout_delta": heldout,
        "heldout_delta_ci95": heldout_half,
    }


def lr_sweep(by_name: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Is the baseline's learning rate near the best? Yes unless a neighbour beats it beyond the interval."""
    others = [r for name, r in by_name.items() if name.startswith(f"{BASELINE}_lr")]
    if not others:
        return None
    better = [
        r["lr"]
        for r in others
        if any(below(-r[f"{m}_delta_vs_baseline"], r[f"{m}_delta_vs_baseline_ci95"]) for m in ("reward", "heldout"))
    ]
    return {
        "baseline_lr": by_name[BASELINE]["lr"],
        "lrs": [r["lr"] for r in others],
        "better_beyond_interval": better,
        "chosen_lr_near_best": not better,
    }


def _half(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def _delta(row: dict[str, Any], metric: str) -> str:
    if f"{metric}_delta_vs_baseline" not in row:
        return ""
    return f"{row[f'{metric}_delta_vs_baseline']:+.3f} ± {_half(row[f'{metric}_delta_vs_baseline_ci95'])}"


def markdown_table(doc: dict[str, Any]) -> str:
    """The paired differences against the baseline as Markdown (for the README), with the two headline answers."""
    settings = doc["settings"]
    config = Path(settings["config"]).name
    lines = [
        f"Paired by seed against {doc['baseline']} ({settings['samples']} trained samples per run, seeds "
        f"{settings['seeds']}, {settings['heldout']} held-out problems; ± the 95 % interval):",
        "",
        "| row | k | M | lr | reward (last 1/4) | vs baseline | held-out acc. | vs baseline |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        name = r["row"] if r["config"] == config else f"{r['row']} (`{r['config']}`)"
        reward, heldout = _delta(r, "reward") or "baseline", _delta(r, "heldout") or "baseline"
        lines.append(
            f"| {name} | {r['k']} | {r['mini_batches']} | {r['lr']:g} | {r['reward_mean']:.3f} | {reward} | "
            f"{r['heldout_accuracy']:.3f} | {heldout} |"
        )
    for a in doc["naive_vs_decoupled_k4"]:
        lines.append(
            f"\nNaive − decoupled PPO at k = 4, M = {a['mini_batches']}: reward {a['reward_delta']:+.3f} ± "
            f"{_half(a['reward_delta_ci95'])}, held-out {a['heldout_delta']:+.3f} ± {_half(a['heldout_delta_ci95'])} "
            f"(naive worse beyond the interval: reward {a['naive_worse_reward']}, held-out {a['naive_worse_heldout']})."
        )
    b = doc["distill_vs_grpo"]
    if b is not None:
        half = b["samples_delta_ci95"]
        samples = "—" if b["samples_delta"] is None else f"{b['samples_delta']:+.0f} ± {'—' if half is None else f'{half:.0f}'}"
        lines.append(
            f"\nDistill − GRPO, samples to reach GRPO's final held-out accuracy: {samples} (distill reached it in "
            f"{b['distill_reached']} of {b['seeds']} seeds; fewer beyond the interval: {b['distill_fewer_samples']}); "
            f"final held-out {b['heldout_delta']:+.3f} ± {_half(b['heldout_delta_ci95'])}."
        )
    return "\n".join(lines)


def pick_correction(args: argparse.Namespace, k: int) -> tuple[str, list[dict[str, Any]]]:
    """The correction with the highest reward at staleness ``k`` (decoupled PPO, recomputed pi_prox)."""
    sweep = []
    for name in CORRECTIONS:
        if name == "areal_token_mask":
            continue  # the decoupled rows measure it
        sweep.append(measure(args, f"corrected_k{k}_{name}", Row("corrected", k), name))
    return max(sweep, key=lambda r: r["reward_mean"])["correction"], sweep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="train steps of --config: the sample budget of every row")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(8)))
    parser.add_argument(
        "--rows",
        nargs="+",
        choices=list(ROWS),
        default=list(DEFAULT_ROWS),
        metavar="ROW",
        help=f"the rows to run (the baseline, {BASELINE}, always runs); any of: {', '.join(ROWS)}",
    )
    parser.add_argument("--heldout", type=int, default=512, help="held-out problems sampled after training (and along the way)")
    parser.add_argument("--correction", choices=sorted(CORRECTIONS), help="skip the sweep: the correction of corrected, dynamic")
    parser.add_argument("--config", default=str(CONFIG))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--markdown", type=Path, metavar="JSON", help="print this results file's table as Markdown, run nothing")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value applied to every run (after --)")
    args = parser.parse_args()
    if args.markdown is not None:
        print(markdown_table(json.loads(args.markdown.read_text())))
        return
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    import torch

    torch.set_num_threads(1)

    started = time.perf_counter()
    names = list(dict.fromkeys([BASELINE, *args.rows]))
    sweep: list[dict[str, Any]] = []
    correction = args.correction
    needing = [ROWS[n].k for n in names if ROWS[n].variant in ("corrected", "dynamic")]
    if correction is None and needing:
        correction, sweep = pick_correction(args, max(k for k in needing if k is not None))
    rows = [measure(args, name, ROWS[name], correction) for name in names]
    by_name = {r["row"]: r for r in rows}
    add_paired_deltas(rows, by_name[BASELINE])

    budget = sample_budget(args)
    table = Table(title=f"Learning quality: arithmetic, {budget} trained samples per run, seeds {args.seeds}")
    table.add_column("row", no_wrap=True)
    for col in (
        "k",
        "M",
        "lr",
        "proximal",
        "correction",
        "reward (last 1/4)",
        "± ci95",
        "vs baseline (paired)",
        "held-out acc.",
        "± ci95",
        "vs baseline (paired)",
        "generated / trained",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["row"],
            str(r["k"]),
            str(r["mini_batches"]),
            f"{r['lr']:g}",
            r["proximal"],
            r["correction"] + (" + dyn. sampling" if r["dynamic_sampling"] else ""),
            f"{r['reward_mean']:.3f}",
            _half(r["reward_ci95"]),
            _delta(r, "reward"),
            f"{r['heldout_accuracy']:.3f}",
            _half(r["heldout_ci95"]),
            _delta(r, "heldout"),
            f"{r['samples_generated_mean'] / r['samples_trained']:.2f}",
        )
    Console(width=200).print(table)
    doc = {
        "rows": rows,
        "baseline": BASELINE,
        "naive_vs_decoupled_k4": naive_vs_decoupled(by_name),
        "distill_vs_grpo": distill_vs_grpo(by_name),
        "lr_sweep": lr_sweep(by_name),
        "correction_sweep": sweep,
        "best_correction": correction,
        "settings": {
            "steps": args.steps,
            "samples": budget,
            "seeds": args.seeds,
            "rows": names,
            "heldout": args.heldout,
            "curve_points": CURVE_POINTS,
            "config": str(args.config),
            "overrides": args.overrides,
        },
        "wall_s": time.perf_counter() - started,
        "machine": {
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "machine": platform.machine(),
            # Other work on the machine shares its cores: read the times with this.
            "load_average_1m_at_end": os.getloadavg()[0],
        },
    }
    for key in ("naive_vs_decoupled_k4", "distill_vs_grpo", "lr_sweep"):
        print(f"{key}: {json.dumps(doc[key])}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
