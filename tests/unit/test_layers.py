"""The layering holds (import-linter, contracts in pyproject.toml), and a breach would fail CI."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["core", "algorithms", "param_sync", "engines", "state_machines", "tasks", "pipeline"]
LINT = Path(sys.executable).parent / "lint-imports"

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed (the dev extra)")


def lint(tree: Path) -> subprocess.CompletedProcess[str]:
    # The tree's own packages first on the path, whatever the environment has installed.
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([str(LINT), "--no-cache"], cwd=tree, env=env, capture_output=True, text=True, timeout=300)


def test_the_contracts_are_kept() -> None:
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "0 broken" in result.stdout


def test_an_upward_import_breaks_a_contract_naming_it(tmp_path: Path) -> None:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__", "model*"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    records = tmp_path / "core" / "records.py"
    records.write_text(records.read_text() + "\nimport pipeline.flow  # an upward import: the vocabulary naming the app\n")
    result = lint(tmp_path)
    assert result.returncode != 0
    assert "The vocabulary imports nothing of ours above it BROKEN" in result.stdout
    assert "core.records -> pipeline.flow" in result.stdout
