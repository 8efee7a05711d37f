"""``benchmarks/rollout_engines.py`` keeps running: its ``--tiny`` smoke mode (vLLM left out: it takes 20+ s to start)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_tiny_run_measures_both_engines(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    script = ROOT / "benchmarks" / "rollout_engines.py"
    cmd = [sys.executable, str(script), "--tiny", "--out", str(out), "--engines", "embedded", "generate"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["model"], r["engine"]) for r in rows} == {("1m", "embedded"), ("1m", "generate")}
    assert all(r["tokens_per_s_median"] > 0 and len(r["runs"]) == 1 for r in rows)
