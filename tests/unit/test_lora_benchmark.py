"""``benchmarks/lora.py`` keeps running at its toy size and its results keep the invariants LoRA
promises: a sync moves exactly the adapter's bytes, fewer than the model's; the probe checked every
LoRA sync and found it landed; only the adapter trains; both learning jobs compare equal samples."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_benchmark

pytest.importorskip("peft", reason="LoRA needs the lora extra (peft)")


@pytest.mark.slow
def test_tiny_run_syncs_the_adapter_alone_and_produces_every_row(tmp_path: Path) -> None:
    out = tmp_path / "lora.json"
    doc = run_benchmark("lora.py", "--tiny", out=out, timeout_s=240)
    assert doc["parts"] == ["sync", "train", "learning"]

    models = doc["sync"]["models"]
    assert [m["model"] for m in models] == ["arithmetic", "qwen2_tiny"]
    for m in models:
        assert m["lora"]["bytes"] == m["adapter_bytes"] < m["full"]["bytes"] == m["model_bytes"]
        assert m["lora"]["logprob_gap_max"] < 1e-4  # the probe ran on every LoRA sync, and the adapter landed
        assert "logprob_gap_max" not in m["full"]
        assert m["probe"]["score_s"] > 0 and m["probe"]["record_s"] > 0
        assert len(m["sync_s_ratio_lora_over_full_runs"]) == doc["settings"]["repeat"]

    rows = {(r["model"], r["mode"]): r for r in doc["train_step"]["rows"]}
    assert set(rows) == {(m["model"], mode) for m in models for mode in ("full", "lora")}
    for m in models:
        assert rows[m["model"], "lora"]["trained_params"] == m["adapter_params"] < rows[m["model"], "full"]["trained_params"]
        assert rows[m["model"], "lora"]["optimizer_state_mb"] < rows[m["model"], "full"]["optimizer_state_mb"]
        assert m["probe"]["per_version_over_lora_train_step"] > 0  # the probe's cost set against a version's work
    assert all(r["step_s"] > 0 and r["peak_rss_delta_mb"] > 0 for r in rows.values())

    learning = doc["learning"]
    assert {job: rows["lora"]["heldout_measure"] for job, rows in learning.items()} == {
        "arithmetic": "exact_answer",
        "digits": "recognized",  # the OCR judge's first choice is the prompted digit
    }
    for job in learning.values():
        full, lora = job["full"], job["lora"]
        assert full["samples_trained"] == lora["samples_trained"] > 0 and full["seeds"] == lora["seeds"]
        assert lora["lr"] > full["lr"]  # each config's own rate: the adapter's is the larger
        assert set(job["lora_minus_full"]) == {"reward_delta", "reward_delta_ci95", "heldout_delta", "heldout_delta_ci95"}
