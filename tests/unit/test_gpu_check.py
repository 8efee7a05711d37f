"""``benchmarks/gpu_check.py`` keeps running between GPUs: its ``--tiny`` mode runs every part on CPU.

The GPU check is run only when a GPU is lent (minutes at a time), so it must not rot on the CPU
machines in between: the tiny mode runs the same code at toy shapes for a few steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_benchmark


@pytest.mark.slow
def test_tiny_mode_runs_every_part_and_reports_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    doc = run_benchmark("gpu_check.py", "--tiny", out=out, timeout_s=280)
    assert doc["tiny"] and doc["device"] == "cpu" and doc["versions"]["torch"]
    assert set(doc["parts"]) == {"text", "images", "trainer_groups"}
    failed = {name: part.get("traceback") for name, part in doc["parts"].items() if part["status"] != "ok"}
    assert not failed, failed

    text = doc["parts"]["text"]
    assert {(r["engine"], r["batch"]) for r in text["decode"]} == {("generate", 4), ("embedded", 4)}
    assert all(r["tokens_per_s_median"] > 0 for r in text["decode"])
    assert [r["mode"] for r in text["schedule"]] == ["sync", "k1"]
    assert text["schedule"][1]["staleness_counts"].get("1", 0) > 0  # k = 1 did train one step off
    # Each sync moved the whole model (float32 in tiny mode): every parameter, once.
    assert text["weight_sync"]["bytes"] == 4 * text["params"]

    images = doc["parts"]["images"]
    assert images["rollout_images_per_s"] > 0 and images["train_step_s"] > 0
    assert images["sync_samples_per_s"] > 0 and images["k1_samples_per_s"] > 0
    assert images["k1_staleness_counts"].get("1", 0) > 0

    groups = doc["parts"]["trainer_groups"]
    assert groups["plain_tokens_per_s"] > 0 and groups["fsdp2_over_plain"] > 0
    # The same weights and batch: each trainer's first step (before any update) computes the same
    # loss, up to float32 rounding of different kernels.
    losses = [groups[row]["first_loss"] for row in ("plain", "fsdp2", "megatron")]
    assert max(losses) - min(losses) <= 1e-5 * max(1.0, max(abs(x) for x in losses))
