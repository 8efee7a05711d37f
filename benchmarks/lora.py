"""LoRA against full fine-tuning: bytes and seconds per sync, train-step time and memory, learning at equal samples.

Three parts (``--parts``), each LoRA (``engines.lora``) against every weight training, on the
engines a run builds (``engines.text.build``: ``train_engine`` and ``embedded_rollout``):

- ``sync``: the shipped arithmetic model (the task's model folder, about 1M parameters) and a
  larger causal LM built here from a Qwen2 config (``BIG_MODEL``: 33M parameters, random init,
  nothing downloaded; the shipped character tokenizer beside it, as the rollout engine loads
  one and nothing is decoded). For each, the trainer ``TorchTrainEngine`` syncs into the
  embedded rollout engine through the weight sync a run uses: ``TorchWeightSync.in_process``
  for full weights, ``probed_in_process`` for the adapter (every load checked by the probe).
  Per mode: the bytes a sync moves and the wall seconds of ``sync()`` (the median of ``--reps``
  syncs after a warm-up, in each of ``--repeat`` rounds; LoRA and full alternate within a
  round, and each round's ratio is taken inside it). The probe is measured apart: the rollout
  engine scoring the probe's 32 tokens (inside every probed sync) and the trainer recording its
  own log-probs (once per version, inside the train step), each the median of ``--reps``.
- ``train``: seconds per train step and peak memory, on both models, one trainer thread (a
  run's share at k >= 1 on 2 cores), the same batch for all four rows (``--batch`` trajectories
  of 16 prompt and 48 response tokens, behaviour log-probs the model's own, advantages +-1),
  each row's configured objective. Memory is the resident-set high-water mark (``VmHWM``) over
  the warm-up and timed steps minus the resident set just before them, in a fresh process per
  row and round (forked from a server that imported torch once), with the mark reset
  (``/proc/self/clear_refs``) after the engine was built: on CPU this is what training adds
  (gradients, optimizer state, activations) whatever the allocator does, and neither the model
  load's transient peak nor another row's memory can leak into it.
- ``learning``: reward at equal samples on the default job (``configs/default.yaml``, full
  fine-tuning at its ``engines.lr``, against ``configs/lora_arithmetic.yaml``, the adapter at its
  ``engines.lora.lr``) and held-out recognition on the digits job (``configs/flow_grpo_digits.yaml``
  against ``configs/flow_grpo_digits_lora.yaml``), each pair trained the same steps on the same
  seeds at the learning rates the configs chose (their comments give the runs behind them).
  Per run (``learning_quality.train_and_evaluate``): the mean training reward over the last
  quarter of the steps and, after training, the final weights' held-out measure (arithmetic:
  fully correct answers of ``--heldout`` problems; digits: images the OCR judge recognizes as
  the prompted digit, of ``--digits-heldout`` prompts at the evaluation's 20 denoising steps).
  LoRA minus full is paired by seed, with its 95 % interval.

Cost with the defaults: sync and train took 200-300 s together on 2 cores shared with other jobs
(a load of 2 to 3; the 33M model's train steps are most of it). Learning is 12 runs; at a load
of 2, 10 steps of the default job and 512 held-out problems took 17 s with full fine-tuning and
25 s with the adapter (its layers run beside every projection, in decoding as in training), 5 steps of the digits job and
200 held-out images 16 s each. On 2 quiet cores (the default job at about 0.7 s a step,
``results/e2e.json``) that puts learning near 16 minutes and the whole run near 20; at a load
of 2, near 28. The default job trains 100 steps: the held-out accuracies the LoRA config's
comment compares are at version 100. ``--tiny`` runs every part at a toy size (a 0.1M-parameter
second model, one step of two groups of two samples, one seed) for the smoke test.

Prints a table per part and writes ``benchmarks/results/lora.json``.

    python benchmarks/lora.py [--parts sync train learning] [--repeat 3] [--reps 5] [--train-steps 3] [--batch 32]
        [--seeds 0 1 2] [--arithmetic-steps 100] [--digits-steps 40] [--heldout 512] [--digits-heldout 200] [--tiny]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from learning_quality import ci95, paired, train_and_evaluate
from rich.console import Console
from rich.table import Table

from tandem.core.config import TandemConfig, TorchEnginesConfig, load_config
from tandem.core.records import FinishReason, Trajectory, token_trajectory
from tandem.core.task import held_out_measure

if TYPE_CHECKING:
    import torch

    from tandem.algorithms.objective import PolicyObjective
    from tandem.engines.trainers.torch_train import TorchTrainEngine

# torch, transformers, peft, the engines (all under ``ENGINE_MODULES``) and the flow's builders are
# imported in the functions that use them: each learning run's reward worker is spawned, and a
# spawned child re-imports this script, which with them at the top cost each worker about 3 s of
# CPU for nothing.
ENGINE_MODULES = ("peft", "tandem.engines.text.build")

RESULTS = Path(__file__).parent / "results" / "lora.json"
CONFIGS = Path(__file__).parent.parent / "configs"
# (full fine-tuning, LoRA) per job: the LoRA config derives from the other.
JOBS = {
    "arithmetic": (CONFIGS / "default.yaml", CONFIGS / "lora_arithmetic.yaml"),
    "digits": (CONFIGS / "flow_grpo_digits.yaml", CONFIGS / "flow_grpo_digits_lora.yaml"),
}
MODES = ("full", "lora")
# The larger causal LM: 33M parameters (16M of them the tied 32k-token embedding, which no
# adapter touches); rank 8 on its 42 projections is 0.43M (1.3 %). Random init, seeded: no download.
BIG_MODEL: dict[str, Any] = {
    "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 6, "num_attention_heads": 8,
    "num_key_value_heads": 2, "vocab_size": 32000, "max_position_embeddings": 512,
}  # fmt: skip
TINY_MODEL: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 256,
}  # fmt: skip
PROMPT_TOKENS, RESPONSE_TOKENS = 16, 48
# The train-step batch uses ids every model embeds (the arithmetic tokenizer's 18).
BATCH_VOCAB = range(3, 18)


# --- models ------------------------------------------------------------------------------


def arithmetic_model() -> Path:
    """The shipped model of the default job's task, as the builder resolves it."""
    from tandem.engines.text.build import resolve_model_path
    from tandem.pipeline.builders import load_config_task, with_task_model

    config = load_config(JOBS["arithmetic"][0])
    spec = with_task_model(config, load_config_task(config)).engines
    assert isinstance(spec, TorchEnginesConfig)
    return resolve_model_path(spec.model_path)


def build_model(folder: Path, shape: dict[str, Any]) -> Path:
    """A Qwen2 causal LM of ``shape`` (random init, seed 0) saved in ``folder`` with the shipped
    character tokenizer, which the rollout engine loads (nothing here is decoded)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**shape, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    shipped = arithmetic_model()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(shipped / name, folder / name)
    return folder


def run_config(mode: str, model_dir: Path) -> TandemConfig:
    """The default job's config (``full``) or its LoRA variant (``lora``) on ``model_dir``, one thread per engine."""
    path = JOBS["arithmetic"][MODES.index(mode)]
    return load_config(path, [f"engines.model_path={model_dir}", "engines.generation_threads=1", "engines.train_threads=1"])


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


# --- sync --------------------------------------------------------------------------------


def median_s(fn: Any, reps: int) -> float:
    """Median wall seconds of ``reps`` calls of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class SyncPair:
    """A trainer and the embedded rollout engine fed by it, as a run of ``mode`` builds them."""

    def __init__(self, mode: str, model_dir: Path) -> None:
        from tandem.engines.text.build import embedded_rollout, train_engine
        from tandem.engines.trainers.torch_train import TorchTrainEngine

        self.config = run_config(mode, model_dir)
        trainer = train_engine(self.config, 1)
        assert isinstance(trainer, TorchTrainEngine)
        self.trainer = trainer
        self.rollout, self.sync = embedded_rollout(self.config, trainer, 1)

    async def timed_syncs(self, reps: int) -> dict[str, float]:
        """One train step (so the adapter is no longer zero and the probe compares trained
        weights) and a warm-up sync (plans the layout, allocates the buffer), then the median of
        ``reps`` syncs by wall time."""
        await self.trainer.train_step(await on_policy(self.trainer, make_batch(4)), objective(self.config))
        await self.sync.sync(self.trainer.version)
        runs = []
        for _ in range(reps):
            t0 = time.perf_counter()
            report = await self.sync.sync(self.trainer.version)
            runs.append({**report.metrics, "wall_s": time.perf_counter() - t0})
        return sorted(runs, key=lambda m: m["wall_s"])[len(runs) // 2]

    def probe_costs(self, reps: int) -> dict[str, float]:
        """The probe's two halves: the rollout engine scoring it (in every probed sync) and the
        trainer recording its log-probs (once per version, under its weights lock)."""
        from tandem.engines.shared.probe import probe_logprobs

        probe = self.trainer.probe
        assert probe is not None
        return {
            "score_s": median_s(lambda: self.rollout.probe_logprobs(probe.inputs), reps),
            "record_s": median_s(lambda: probe_logprobs(self.trainer.model, probe.inputs), reps),
        }

    def close(self) -> None:
        for close in (self.sync.close, self.rollout.close, self.trainer.close):
            close()


def sync_model(name: str, model_dir: Path, reps: int, repeat: int) -> dict[str, Any]:
    """Full and LoRA syncs of one model, alternating within each of ``repeat`` rounds."""
    from tandem.param_sync import unique_weights

    pairs = {mode: SyncPair(mode, model_dir) for mode in MODES}
    try:
        rounds: list[dict[str, dict[str, float]]] = []
        for _ in range(repeat):
            rounds.append({mode: asyncio.run(pair.timed_syncs(reps)) for mode, pair in pairs.items()})
        probe = pairs["lora"].probe_costs(reps)
        weights = unique_weights(pairs["full"].trainer.model)
        adapter = dict(pairs["lora"].trainer.named_tensors_for_sync())
    finally:
        for pair in pairs.values():
            pair.close()
    out: dict[str, Any] = {
        "model": name,
        "params": sum(t.numel() for t in weights.values()),
        "model_bytes": nbytes(weights),
        "adapter_params": sum(t.numel() for t in adapter.values()),
        "adapter_bytes": nbytes(adapter),
    }
    for mode in MODES:
        runs = [r[mode] for r in rounds]
        mid = sorted(runs, key=lambda m: m["wall_s"])[len(runs) // 2]
        out[mode] = {
            "bytes": int(mid["bytes"]),
            "sync_s": mid["wall_s"],
            "sync_s_runs": [r["wall_s"] for r in runs],
            **{k: mid[k] for k in ("gather_s", "checksum_s", "send_s", "load_s", "stall_s", "total_s")},
            **({"logprob_gap_max": max(r["logprob_gap"] for r in runs)} if mode == "lora" else {}),
        }
    out["bytes_ratio_lora_over_full"] = out["lora"]["bytes"] / out["full"]["bytes"]
    out["sync_s_ratio_lora_over_full_runs"] = [r["lora"]["wall_s"] / r["full"]["wall_s"] for r in rounds]
    out["probe"] = {
        **probe,
        "share_of_lora_sync": probe["score_s"] / out["lora"]["sync_s"],
        "score_over_full_sync": probe["score_s"] / out["full"]["sync_s"],
    }
    return out


def print_sync(console: Console, models: list[dict[str, Any]]) -> None:
    table = Table(title="sync: trainer -> embedded rollout engine (median of reps; spread over rounds)")
    for col in ("model", "params", "mode", "bytes", "sync ms", "spread ms", "lora/full s", "probe score ms", "probe record ms"):
        table.add_column(col, justify="right")
    for m in models:
        for mode in MODES:
            r = m[mode]
            lora = mode == "lora"
            ratios = m["sync_s_ratio_lora_over_full_runs"]
            table.add_row(
                m["model"], f"{m['params'] / 1e6:.1f}M", mode, f"{r['bytes']:,}", f"{1e3 * r['sync_s']:.2f}",
                "-".join(f"{1e3 * s:.2f}" for s in (min(r["sync_s_runs"]), max(r["sync_s_runs"]))),
                f"{min(ratios):.3f}-{max(ratios):.3f}" if lora else "",
                f"{1e3 * m['probe']['score_s']:.2f}" if lora else "", f"{1e3 * m['probe']['record_s']:.2f}" if lora else "",
            )  # fmt: skip
    console.print(table)


# --- train step --------------------------------------------------------------------------


def make_batch(trajectories: int) -> list[Trajectory]:
    """``trajectories`` sequences of fixed length in groups of 4, advantages +1/-1 (behaviour log-probs set later)."""
    rng = random.Random(0)
    out = []
    for i in range(trajectories):
        prompt = [rng.choice(BATCH_VOCAB) for _ in range(PROMPT_TOKENS)]
        response = [rng.choice(BATCH_VOCAB) for _ in range(RESPONSE_TOKENS)]
        t = token_trajectory(i // 4, i % 4, prompt, response, [0.0] * RESPONSE_TOKENS, [0] * RESPONSE_TOKENS, FinishReason.LENGTH)
        t.advantage = 1.0 if i % 2 == 0 else -1.0
        out.append(t)
    return out


async def on_policy(trainer: TorchTrainEngine, batch: list[Trajectory]) -> list[Trajectory]:
    """``batch`` with the trainer's own log-probs as behaviour log-probs: on-policy samples, every token's gradient flows."""
    for t, logprobs in zip(batch, await trainer.logprobs(batch), strict=True):
        t.behaviour_logprobs = logprobs
    return batch


def objective(config: TandemConfig) -> PolicyObjective:
    """The policy objective a run of ``config`` trains with (as its train role builds it)."""
    from tandem.algorithms.objective import PolicyObjective

    return PolicyObjective(config.algorithm, config.algorithm.proximal)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}: the train part measures memory on Linux only")


def quiet() -> None:
    """Warnings only, and no per-load progress bars (as a run's builder has it)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def train_row(mode: str, model_dir: Path, trajectories: int, steps: int) -> dict[str, Any]:
    """One row in a fresh process: seconds per train step (median of ``steps`` after a warm-up)
    and the resident-set peak the steps add (``VmHWM`` minus ``VmRSS`` before them, the mark reset)."""
    import torch

    from tandem.engines.text.build import train_engine
    from tandem.engines.trainers.torch_train import TorchTrainEngine
    from tandem.param_sync.bucket import MiB

    torch.set_num_threads(1)
    quiet()
    config = run_config(mode, model_dir)
    trainer = train_engine(config, 1)
    assert isinstance(trainer, TorchTrainEngine)
    loss = objective(config)

    async def steps_s() -> tuple[list[float], int, int]:
        batch = await on_policy(trainer, make_batch(trajectories))
        Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts from here
        before = _status_kib("VmRSS")
        times = []
        for _ in range(steps + 1):
            t0 = time.perf_counter()
            await trainer.train_step(batch, loss)
            times.append(time.perf_counter() - t0)
        return times[1:], before, _status_kib("VmHWM")

    try:
        times, before, peak = asyncio.run(steps_s())
        trained = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        adam = trainer.state_dict()["optimizer"]["state"].values()
        optimizer_bytes = sum(t.numel() * t.element_size() for state in adam for t in state.values() if t.dim() > 0)
    finally:
        trainer.close()
    return {
        "step_s": statistics.median(times), "peak_rss_delta_mb": (peak - before) * 1024 / MiB, "trained_params": trained,
        "optimizer_state_mb": optimizer_bytes / MiB,
    }  # fmt: skip


def train_rows(models: dict[str, Path], trajectories: int, steps: int, repeat: int) -> list[dict[str, Any]]:
    """Every (model, mode) row ``repeat`` times, rows interleaved within each round, each in a fresh process."""
    context = get_context("forkserver")
    # torch, transformers, peft and tandem imported once, in the server: each row starts in a fraction
    # of a second. Named, not "__main__": Python 3.11's fork server never preloads the script (it looks
    # for its path under a key spawn does not set), so each row runs this script's top again, whose
    # imports these cover.
    context.set_forkserver_preload(["learning_quality", *ENGINE_MODULES])
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    with ProcessPoolExecutor(max_workers=1, mp_context=context, max_tasks_per_child=1) as pool:
        for _ in range(repeat):
            for name, folder in models.items():
                for mode in MODES:
                    runs.setdefault((name, mode), []).append(pool.submit(train_row, mode, folder, trajectories, steps).result())
    rows = []
    for (name, mode), measured in runs.items():
        mid = sorted(measured, key=lambda r: r["step_s"])[len(measured) // 2]
        rows.append({
            "model": name, "mode": mode, "trained_params": mid["trained_params"], "optimizer_state_mb": mid["optimizer_state_mb"],
            "step_s": mid["step_s"],
            "step_s_runs": [r["step_s"] for r in measured],
            "peak_rss_delta_mb": statistics.median(r["peak_rss_delta_mb"] for r in measured),
            "peak_rss_delta_mb_runs": [r["peak_rss_delta_mb"] for r in measured],
        })  # fmt: skip
    for row in rows:
        full = next(r for r in rows if r["model"] == row["model"] and r["mode"] == "full")
        row["step_s_over_full"] = row["step_s"] / full["step_s"]
        row["peak_rss_delta_over_full"] = row["peak_rss_delta_mb"] / full["peak_rss_delta_mb"]
    return rows


def print_train(console: Console, rows: list[dict[str, Any]], trajectories: int) -> None:
    tokens = trajectories * (PROMPT_TOKENS + RESPONSE_TOKENS)
    table = Table(title=f"train step: {trajectories} trajectories ({tokens} tokens), one thread, fresh process per row")
    for col in ("model", "mode", "trained", "Adam MB", "step s", "spread s", "vs full", "peak RSS +MB", "spread MB", "vs full"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["model"], r["mode"], f"{r['trained_params']:,}", f"{r['optimizer_state_mb']:.1f}", f"{r['step_s']:.3f}",
            f"{min(r['step_s_runs']):.3f}-{max(r['step_s_runs']):.3f}", f"{r['step_s_over_full']:.2f}",
            f"{r['peak_rss_delta_mb']:.1f}", f"{min(r['peak_rss_delta_mb_runs']):.1f}-{max(r['peak_rss_delta_mb_runs']):.1f}",
            f"{r['peak_rss_delta_over_full']:.2f}",
        )  # fmt: skip
    console.print(table)


def probe_per_version(console: Console, models: list[dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    """The probe's whole cost per version (the engine's scoring plus the trainer's record)
    against the LoRA train step that makes the version: what keeping it on costs a run."""
    for m in models:
        step = next(r["step_s"] for r in rows if r["model"] == m["model"] and r["mode"] == "lora")
        probe = m["probe"]
        share = probe["per_version_over_lora_train_step"] = (probe["score_s"] + probe["record_s"]) / step
        console.print(f"{m['model']}: the probe costs {share:.1%} of a LoRA train step per version")


# --- learning ----------------------------------------------------------------------------


def effective_lr(config: TandemConfig) -> float:
    spec = config.engines
    assert isinstance(spec, TorchEnginesConfig)
    return spec.lr if spec.lora is None or spec.lora.lr is None else spec.lora.lr


def measure_name(config: TandemConfig) -> str:
    """What the job's held-out number counts (``exact_answer``, ``recognized``), as the builder picks it."""
    from tandem.pipeline.builders import load_config_task, reward_functions

    task = load_config_task(config)
    return held_out_measure(task, [f.name for f in reward_functions(config, task)]).name


def learn_row(
    job: str, mode: str, steps: int, seeds: list[int], heldout: int, output: Path, overrides: list[str]
) -> dict[str, Any]:
    """One config of ``job`` (with ``overrides``) trained ``steps`` steps per seed, then its final weights evaluated held out."""
    path = JOBS[job][MODES.index(mode)]
    runs, config = [], None
    for seed in seeds:
        config = load_config(path, [
            f"run.seed={seed}", f"run.max_steps={steps}", f"run.name=lora_bench_{job}_{mode}_s{seed}", f"run.output_dir={output}",
            "observability.write_run_dir=false", "observability.metrics_port=null", "observability.trace=false",
            "validation.every_versions=null", f"validation.prompts={heldout}", *overrides,
        ])  # fmt: skip
        runs.append(asyncio.run(train_and_evaluate(config, heldout)))
        print(f"  {job} {mode} seed={seed}: reward {runs[-1]['reward']:.3f} heldout {runs[-1]['heldout']:.3f} "
              f"({runs[-1]['wall_s']:.0f} s)", flush=True)  # fmt: skip
    assert config is not None
    rewards, held = [r["reward"] for r in runs], [r["heldout"] for r in runs]
    return {
        "job": job, "mode": mode, "config": path.name, "lr": effective_lr(config), "steps": steps, "seeds": seeds,
        "samples_trained": runs[0]["trained"], "heldout_prompts": heldout, "heldout_measure": measure_name(config),
        "reward_mean": statistics.fmean(rewards), "reward_ci95": ci95(rewards), "reward_per_seed": rewards,
        "heldout_mean": statistics.fmean(held), "heldout_ci95": ci95(held), "heldout_per_seed": held,
        "wall_s": sum(r["wall_s"] for r in runs),
    }  # fmt: skip


def learn_job(job: str, steps: int, seeds: list[int], heldout: int, overrides: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as output:
        rows = {mode: learn_row(job, mode, steps, seeds, heldout, Path(output), overrides) for mode in MODES}
    if rows["full"]["samples_trained"] != rows["lora"]["samples_trained"]:
        raise RuntimeError(f"{job}: the two configs trained {rows['full']['samples_trained']} and "
                           f"{rows['lora']['samples_trained']} samples: not a comparison at equal samples")  # fmt: skip
    delta: dict[str, Any] = {}
    for metric in ("reward", "heldout"):
        delta[f"{metric}_delta"], delta[f"{metric}_delta_ci95"] = paired(rows["lora"], rows["full"], metric)
    return {**rows, "lora_minus_full": delta}


def print_learning(console: Console, jobs: dict[str, dict[str, Any]]) -> None:
    table = Table(title="learning at equal samples, each config's learning rate (± 95 % interval; LoRA - full paired by seed)")
    for col in ("job", "mode", "lr", "steps", "samples", "reward (last 1/4)", "held-out", "lora - full", "lora - full"):
        table.add_column(col, justify="right")

    def pm(mean: float, half: float | None) -> str:
        return f"{mean:+.3f}" + ("" if half is None else f" ± {half:.3f}")

    for job, rows in jobs.items():
        d = rows["lora_minus_full"]
        for mode in MODES:
            r = rows[mode]
            lora = mode == "lora"
            table.add_row(
                job, mode, f"{r['lr']:g}", str(r["steps"]), str(r["samples_trained"]),
                pm(r["reward_mean"], r["reward_ci95"]).lstrip("+"), pm(r["heldout_mean"], r["heldout_ci95"]).lstrip("+"),
                pm(d["reward_delta"], d["reward_delta_ci95"]) if lora else "",
                pm(d["heldout_delta"], d["heldout_delta_ci95"]) if lora else "",
            )  # fmt: skip
    console.print(table)


# --- main --------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", nargs="+", choices=["sync", "train", "learning"], default=["sync", "train", "learning"])
    parser.add_argument("--repeat", type=int, default=3, help="rounds of the sync and train rows (the spread is reported)")
    parser.add_argument("--reps", type=int, default=5, help="timed syncs (and probe scorings) per mode and round")
    parser.add_argument("--train-steps", type=int, default=3, help="timed train steps per row, after one warm-up")
    parser.add_argument("--batch", type=int, default=32, help="trajectories in the train-step batch")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of every learning row")
    parser.add_argument("--arithmetic-steps", type=int, default=100, help="train steps of the default job's rows")
    parser.add_argument("--digits-steps", type=int, default=40, help="train steps of the digits job's rows")
    parser.add_argument("--heldout", type=int, default=512, help="held-out arithmetic problems after training")
    parser.add_argument("--digits-heldout", type=int, default=200, help="held-out digit prompts after training")
    parser.add_argument("--tiny", action="store_true", help="smoke test: 0.1M second model, 1 round, 1 step of 4 samples, 1 seed")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    import torch

    if args.tiny:
        args.repeat, args.reps, args.train_steps, args.batch, args.seeds = 1, 2, 1, 4, [0]
        args.arithmetic_steps, args.digits_steps, args.heldout, args.digits_heldout = 1, 1, 4, 4
    quiet()
    torch.set_num_threads(1)
    console = Console(width=200)
    started = time.perf_counter()
    shape = TINY_MODEL if args.tiny else BIG_MODEL
    doc: dict[str, Any] = {"benchmark": "lora", "tiny": args.tiny, "parts": args.parts}

    with tempfile.TemporaryDirectory() as scratch:
        big = f"qwen2_{'tiny' if args.tiny else '33m'}"
        models = {"arithmetic": arithmetic_model(), big: build_model(Path(scratch) / big, shape)}
        if "sync" in args.parts:
            console.log("sync")
            doc["sync"] = {"models": [sync_model(name, folder, args.reps, args.repeat) for name, folder in models.items()]}
            print_sync(console, doc["sync"]["models"])
        if "train" in args.parts:
            console.log("train steps")
            rows = train_rows(models, args.batch, args.train_steps, args.repeat)
            doc["train_step"] = {
                "trajectories": args.batch, "prompt_tokens": PROMPT_TOKENS, "response_tokens": RESPONSE_TOKENS,
                "train_threads": 1, "memory_measure": "VmHWM - VmRSS over the steps (mark reset), fresh process per row",
                "rows": rows,
            }  # fmt: skip
            print_train(console, rows, args.batch)
        if "sync" in args.parts and "train" in args.parts:
            probe_per_version(console, doc["sync"]["models"], doc["train_step"]["rows"])
    if "learning" in args.parts:
        console.log("learning")
        steps = {"arithmetic": (args.arithmetic_steps, args.heldout), "digits": (args.digits_steps, args.digits_heldout)}
        # The tiny step: two groups of two samples, the fewest that still give GRPO advantages to train on.
        batch = ["train.prompts_per_step=2", "rollout.samples_per_prompt=2"] if args.tiny else []
        doc["learning"] = {job: learn_job(job, n, args.seeds, heldout, batch) for job, (n, heldout) in steps.items()}
        print_learning(console, doc["learning"])

    doc["settings"] = {k: v for k, v in vars(args).items() if k != "out"} | {"big_model": shape}
    doc["wall_s"] = time.perf_counter() - started
    doc["machine"] = {
        "cores": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "machine": platform.machine(),
        # Other work on the machine shares its cores: read the times with this.
        "load_average_1m_at_end": os.getloadavg()[0],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    console.print(f"wrote {args.out} ({doc['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
