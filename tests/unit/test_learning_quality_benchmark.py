"""``benchmarks/learning_quality.py`` keeps running and answers its two headline questions: a
one-step smoke of the rows they read (two seeds, so intervals exist) and the Markdown table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_benchmark

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_smoke_pairs_rows_with_the_baseline_and_answers_the_headlines(tmp_path: Path) -> None:
    out = tmp_path / "lq.json"
    script = ROOT / "benchmarks" / "learning_quality.py"
    rows = ["naive_m4_k4", "decoupled_m4_k4", "distill", "grpo"]
    # Four prompts a step, the fewest that four mini-batches can split (32 samples a run; distill's
    # config samples half as many per prompt, so it still takes two steps), and one thread per
    # engine: at k = 0 generation would take both cores, whose threads stall on each other beside
    # the suite's other worker.
    job = ["train.prompts_per_step=4", "engines.generation_threads=1", "engines.train_threads=1"]
    args = [*job, "--steps", "1", "--seeds", "0", "1", "--heldout", "4", "--rows", *rows]
    doc = run_benchmark("learning_quality.py", *args, out=out, timeout_s=240)
    by_name = {r["row"]: r for r in doc["rows"]}
    assert list(by_name) == ["decoupled_k0", *rows]  # the baseline always runs, first
    assert all(r["samples_trained"] == doc["settings"]["samples"] == 32 for r in doc["rows"])  # equal samples
    assert by_name["distill"]["steps"] == 2 and by_name["naive_m4_k4"]["mini_batches"] == 4
    assert "heldout_delta_vs_baseline_ci95" in by_name["grpo"] and "heldout_delta_vs_baseline" not in by_name["decoupled_k0"]
    [naive_vs_decoupled] = doc["naive_vs_decoupled_k4"]
    assert naive_vs_decoupled["mini_batches"] == 4 and naive_vs_decoupled["heldout_delta_ci95"] is not None
    distill = doc["distill_vs_grpo"]
    assert all(s is not None for s in distill["grpo_samples_per_seed"])  # grpo reaches its own final accuracy
    assert all(curve[-1][0] == 32 for curve in by_name["grpo"]["curve_per_seed"])
    markdown = subprocess.run(
        [sys.executable, str(script), "--markdown", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert "| naive_m4_k4 | 4 | 4 |" in markdown and "Distill − GRPO" in markdown
