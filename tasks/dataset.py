"""Task items from a file: JSONL or Parquet rows of ``{"prompt", "answer", ...}`` via ``datasets``.

What it owns: reading and checking a data file once, before the run starts, and the
deterministic order items are drawn in (a fresh shuffle per epoch from the seed), with a
position that jumps straight to item ``start`` (a resume continues where its checkpoint stood
without replaying the file). Columns other than ``prompt`` and ``answer`` become the item's
``meta``.

Invariants: a bad row fails here naming the file and the row (for JSONL, the 1-based line of
a line that is not JSON); an item's position ``i`` is the same item for the same seed on every
machine.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tandem.core.config import ConfigError
from tandem.core.records import TaskItem

__all__ = ["FileItems"]


class FileItems:
    """The rows of one data file as task items: ``items(seed, start)`` draws them in epochs."""

    def __init__(self, path: Path, field: str = "task.data_path") -> None:
        self.path = Path(path)
        self._field = field
        self.rows = self._read()

    def __len__(self) -> int:
        return len(self.rows)

    def __call__(self, seed: int, start: int = 0) -> Iterator[TaskItem]:
        """Items ``start, start + 1, ...`` of the endless order for ``seed``."""
        epoch, offset = divmod(start, len(self.rows))
        while True:
            order = list(range(len(self.rows)))
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
            for i in order[offset:]:
                yield self.rows[i]
            epoch, offset = epoch + 1, 0

    def first(self, n: int) -> list[TaskItem]:
        """The file's first ``n`` rows in file order (a held-out set read from its own file)."""
        if n > len(self.rows):
            raise ConfigError(f"{self._field}: {self.path} has {len(self.rows)} rows, {n} were asked for")
        return self.rows[:n]

    def _read(self) -> list[TaskItem]:
        import datasets

        datasets.disable_progress_bars()  # a bar per file read would cut through the run's own display
        path, field = self.path, self._field
        if not path.is_file():
            raise ConfigError(f"{field}: no such file {path}")
        kind = "parquet" if path.suffix == ".parquet" else "json"
        try:
            table = datasets.load_dataset(kind, data_files=str(path), split="train")
        except Exception as exc:
            raise ConfigError(f"{field}: cannot read {path}{_bad_json_line(path) if kind == 'json' else ''}: {exc}") from None
        rows: list[TaskItem] = []
        for i, row in enumerate(table):
            prompt, answer = row.get("prompt"), row.get("answer")
            if not isinstance(prompt, str) or not prompt:
                raise ConfigError(f"{field} {path}: row {i} has no non-empty string 'prompt': {row!r}")
            if answer is not None and not isinstance(answer, str):
                raise ConfigError(f"{field} {path}: row {i}: 'answer' must be a string, got {answer!r}")
            meta = {k: v for k, v in row.items() if k not in ("prompt", "answer")} or None
            rows.append(TaskItem(prompt=prompt, answer=answer, meta=meta))
        if not rows:
            raise ConfigError(f"{field} {path}: no rows")
        return rows


def _bad_json_line(path: Path) -> str:
    """Where a JSON-lines file breaks: ``" (line N: ...)"`` for its first line that is not a JSON
    object, else ``""``. Run only after ``datasets`` refused the file, to name the culprit."""
    with path.open(encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row: Any = json.loads(line)
            except ValueError as exc:
                return f" (line {number} is not valid JSON: {exc})"
            if not isinstance(row, dict):
                return f" (line {number} is a JSON {type(row).__name__}, not an object)"
    return ""
