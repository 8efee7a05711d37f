"""Problems on disk: one JSON object per line, ``{"prompt": ..., "answer": ...}``.

Owns the file format so prompts can come from a file instead of the generator. Reading is
strict: a row that is not an object with string ``prompt`` and ``answer`` fields raises a
ValueError that names the file and the 1-based line, rather than being skipped (a silently
shorter dataset is a bug nobody sees). Blank lines are allowed and ignored.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tandem.tasks.arithmetic.problems import Problem


def write_jsonl(problems: Iterable[Problem], path: str | Path) -> None:
    """Write one problem per line (UTF-8), replacing the file."""
    with Path(path).open("w", encoding="utf-8") as f:
        for problem in problems:
            f.write(json.dumps({"prompt": problem["prompt"], "answer": problem["answer"]}) + "\n")


def load_jsonl(path: str | Path) -> list[Problem]:
    """Read problems written by :func:`write_jsonl` (or by hand), validating every row."""
    problems: list[Problem] = []
    with Path(path).open(encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            problems.append(_parse_row(line, f"{path}, line {line_number}"))
    return problems


def _parse_row(line: str, where: str) -> Problem:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg})") from exc
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key in ("prompt", "answer"):
        if not isinstance(row.get(key), str):
            raise ValueError(f"{where}: field {key!r} must be a string")
    return Problem(prompt=row["prompt"], answer=row["answer"])
