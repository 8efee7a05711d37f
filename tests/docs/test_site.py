"""The documentation site builds with ``mkdocs build --strict``: a broken link, a missing anchor,
a page left out of the nav or an API reference that does not resolve fails the build."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FRONT_PAGE_MAX_LINES = 200

pytest.importorskip("mkdocs", reason="the docs extra is not installed")


def test_the_site_builds_strict(tmp_path: Path) -> None:
    shutil.rmtree(REPO / "build" / "docs-layout", ignore_errors=True)  # as on a clean clone: the build makes it
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    config_page = (tmp_path / "reference" / "config" / "index.html").read_text()
    assert "run.max_steps" in config_page and "observability.metrics_port" in config_page  # generated
    assert "Runs one training job" in (tmp_path / "reference" / "api" / "index.html").read_text()  # a docstring


def test_the_readme_is_a_front_page() -> None:
    assert len((REPO / "README.md").read_text().splitlines()) <= FRONT_PAGE_MAX_LINES
