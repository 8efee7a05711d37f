"""mkdocs hook: lay the package out as it is installed, so the API reference can read it.

The repository keeps ``tandem``'s parts in folders beside ``tandem/`` (``core/``, ``pipeline/``,
...; ``pyproject.toml`` maps each to ``tandem.<part>``), but griffe, which mkdocstrings reads the
source with, finds a package's modules by walking its folder. Before the build this hook makes
``build/docs-layout/tandem/`` (its own modules copied, each part a symlink), following
``pyproject.toml``'s ``package-dir`` (the one source of the mapping), and ``mkdocs.yml`` points
mkdocstrings there.
"""

from __future__ import annotations

import os
import shutil
import tomllib
from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority

REPO = Path(__file__).resolve().parents[2]
LAYOUT = REPO / "build" / "docs-layout"


def lay_out(repo: Path, layout: Path) -> None:
    """``layout/tandem`` as the wheel has it: ``tandem/__init__.py`` and one link per mapped part."""
    package_dir: dict[str, str] = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    shutil.rmtree(layout, ignore_errors=True)
    (layout / "tandem").mkdir(parents=True)
    for package, folder in package_dir.items():
        if package == "tandem":
            for entry in (repo / folder).iterdir():
                if entry.suffix == ".py":  # copied: griffe resolves a linked file to its real folder
                    shutil.copy(entry, layout / "tandem" / entry.name)
        else:
            os.symlink(repo / folder, layout / Path(*package.split(".")), target_is_directory=True)


@event_priority(100)  # before mkdocstrings' own on_config, which drops a search path that does not exist yet
def on_config(config: Any) -> Any:
    """mkdocs' hook, before any page is rendered and before mkdocstrings reads its paths."""
    lay_out(REPO, LAYOUT)
    return config
