"""Every Python and shell example in the README and the documentation runs, or says why not.

Each fenced ``python`` or ``bash`` block is one test, evaluated with Sybil in the order of its
page: the blocks of one page share a namespace and a working folder (a later block may use a file
or a name an earlier one made). A block that is not run is marked in the page with
``<!-- skip: next "reason" -->`` (or ``skip: start "reason"`` ... ``skip: end``) and shows as
skipped with that reason, so pytest's summary line counts the examples executed (passed) and the
ones not run (skipped); ``-rs`` lists the reasons.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import SkipTest

import pytest
import structlog

pytest.importorskip("sybil", reason="the docs extra is not installed")
from sybil import Document, Example
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser, SkipParser

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\S*)", re.MULTILINE)
NOT_EXAMPLES = {"text"}  # diagrams and sample output: nothing to run


def run_bash(example: Example) -> None:
    """Run a shell block in the page's folder, with this interpreter's ``tandem`` and ``python`` first on PATH."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", str(example.parsed)], cwd=os.getcwd(), env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def _parse(path: Path) -> Document:
    return Document.parse(str(path), PythonCodeBlockParser(), CodeBlockParser("bash", run_bash), SkipParser())


def _is_code(example: Example) -> bool:
    return not isinstance(example.parsed, tuple)  # a skip directive parses to (action, reason)


class _Page:
    """One page's examples (skip directives included), evaluated in order, each once."""

    def __init__(self, path: Path, folder: Path) -> None:
        self.examples = list(_parse(path).examples())
        self.folder = folder
        self.next = 0

    def evaluate_through(self, index: int) -> None:
        """Evaluate every example before ``index`` not yet evaluated (their skips are theirs), then it."""
        while self.next < index:
            example, self.next = self.examples[self.next], self.next + 1
            try:
                example.evaluate()
            except SkipTest:
                pass
        self.next = index + 1
        self.examples[index].evaluate()


def _code_examples() -> Iterator[Any]:
    for path in PAGES:
        for i, example in enumerate(_parse(path).examples()):
            if _is_code(example):
                # One page's examples share a namespace and a folder: under xdist they run in one worker.
                yield pytest.param(path, i, id=f"{path.relative_to(REPO)}:{example.line}",
                                   marks=pytest.mark.xdist_group(f"docs:{path.relative_to(REPO)}"))


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> dict[Path, _Page]:
    return {path: _Page(path, tmp_path_factory.mktemp(path.stem)) for path in PAGES}


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """Examples run the CLI and flows in this process; give later tests their quiet logging back."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.mark.slow  # about a minute and a half together: several examples train the shipped models for a step or two
@pytest.mark.parametrize(("page", "index"), list(_code_examples()))
def test_example(page: Path, index: int, pages: dict[Path, _Page], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(pages[page].folder)
    try:
        pages[page].evaluate_through(index)
    except SkipTest as marked:  # marked in the page as not run: report it as pytest's skip, with its reason
        pytest.skip(f"not run: {marked}")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_code_block_is_python_bash_or_text(page: Path) -> None:
    """A block in another language (``sh``, none at all) would silently never run."""
    text = page.read_text()
    opening = FENCE.findall(text)[::2]  # fences alternate: opening, closing
    assert [lang for lang in opening if lang not in {"python", "bash", *NOT_EXAMPLES}] == []
    code_blocks = sum(lang in {"python", "bash"} for lang in opening)
    assert code_blocks == sum(_is_code(e) for e in _parse(page).examples())
