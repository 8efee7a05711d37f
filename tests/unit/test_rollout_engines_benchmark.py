"""``benchmarks/rollout_engines.py`` keeps running: its ``--tiny`` smoke mode (vLLM left out: it takes 20+ s to start)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_benchmark


@pytest.mark.slow
def test_tiny_run_measures_both_engines(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    rows = run_benchmark("rollout_engines.py", "--tiny", "--engines", "embedded", "generate", out=out, timeout_s=240)["rows"]
    assert {(r["model"], r["engine"]) for r in rows} == {("1m", "embedded"), ("1m", "generate")}
    assert all(r["tokens_per_s_median"] > 0 and len(r["runs"]) == 1 for r in rows)
