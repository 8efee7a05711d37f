"""The layering holds (import-linter, contracts in pyproject.toml), and a breach would fail CI.

grimp finds a package's modules by walking its folder, and ``tandem``'s parts live in their own
folders beside ``tandem/`` (pyproject.toml maps them), so the linter runs over a copy of the
tree laid out as it is installed: ``tandem/<part>/...``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import package_dirs

ROOT = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).parent / "lint-imports"

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed (the dev extra)")


def installed_layout(tmp: Path) -> Path:
    """A copy of the code as the wheel lays it out, with pyproject.toml beside it."""
    for package, folder in sorted(package_dirs().items()):  # "tandem" first, then its parts
        shutil.copytree(ROOT / folder, tmp / package.replace(".", "/"), ignore=shutil.ignore_patterns("__pycache__", "model"))
    shutil.copy(ROOT / "pyproject.toml", tmp / "pyproject.toml")
    return tmp


def lint(tree: Path) -> subprocess.CompletedProcess[str]:
    # The copy first on the path, whatever the environment has installed.
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([str(LINT), "--no-cache"], cwd=tree, env=env, capture_output=True, text=True, timeout=300)


def test_the_contracts_are_kept(tmp_path: Path) -> None:
    result = lint(installed_layout(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:]
    assert "0 broken" in result.stdout


def test_an_upward_import_breaks_a_contract_naming_it(tmp_path: Path) -> None:
    tree = installed_layout(tmp_path)
    records = tree / "tandem" / "core" / "records.py"
    records.write_text(records.read_text() + "\nimport tandem.pipeline.flow  # an upward import: the vocabulary naming the app\n")
    result = lint(tree)
    assert result.returncode != 0
    assert "The vocabulary imports nothing of ours above it BROKEN" in result.stdout
    assert "tandem.core.records -> tandem.pipeline.flow" in result.stdout


def test_a_cycle_inside_the_engines_breaks_a_contract_naming_it(tmp_path: Path) -> None:
    tree = installed_layout(tmp_path)
    threads = tree / "tandem" / "engines" / "shared" / "threads.py"
    # Inside a function, as cycles hide: the text workload imports shared, now shared imports it back.
    threads.write_text(threads.read_text() + "\n\ndef _cycle() -> None:\n    import tandem.engines.text.rollout  # noqa: F401\n")
    result = lint(tree)
    assert result.returncode != 0
    assert re.search(r"No import cycles inside the engines, .*\s*BROKEN", result.stdout)
    assert "No cycles are allowed in tandem.engines." in result.stdout
    assert ".shared -> .text" in result.stdout or ".text -> .shared" in result.stdout
