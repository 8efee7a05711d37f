"""Task items from a file: JSONL or Parquet rows, read by ``datasets``, in the formats peers use.

What it owns: reading and checking a data file once, before the run starts, and the
deterministic order items are drawn in (a fresh shuffle per epoch from the seed), with a
position that jumps straight to item ``start`` (a resume continues where its checkpoint stood
without replaying the file).

Row formats (``task.data_format``; ``auto`` picks ``verl`` when the file has a
``reward_model`` column, else ``plain``):

- ``plain``: ``{"prompt", "answer"?}``; TRL's conversational rows are these with ``prompt`` a
  list of chat messages;
- ``verl``: verl's RL parquet rows: ``prompt`` (chat messages), ``reward_model.ground_truth``
  (the answer), ``data_source``, ``extra_info``, ...

A ``prompt`` is a non-empty string (used as is) or a non-empty list of ``{"role", "content"}``
messages (the item's ``messages``, rendered by the engines through the model's chat template).
Every column but ``prompt`` and ``answer`` reaches rewards as the item's ``meta`` (a verl row's
``reward_model`` included).

Invariants: a bad row fails here naming the file, the row and the field (for JSONL, the 1-based
line of a line that is not JSON); an item's position ``i`` is the same item for the same seed on
every machine.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from tandem.core.config import ConfigError
from tandem.core.records import TaskItem

__all__ = ["DataFormat", "FileItems", "chat_messages"]

DataFormat = Literal["auto", "plain", "verl"]


class FileItems:
    """The rows of one data file as task items: ``items(seed, start)`` draws them in epochs."""

    def __init__(self, path: Path, field: str = "task.data_path", data_format: DataFormat = "auto") -> None:
        self.path = Path(path)
        self._field = field
        self._format = data_format
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
        data_format = self._format
        if data_format == "auto":
            data_format = "verl" if "reward_model" in (table.column_names or []) else "plain"
        rows = [_item(row, data_format, f"{field} {path}: row {i}") for i, row in enumerate(table)]
        if not rows:
            raise ConfigError(f"{field} {path}: no rows")
        return rows


def _item(row: dict[str, Any], data_format: str, where: str) -> TaskItem:
    """The task item of one row in ``data_format``; ``ConfigError`` naming ``where`` and the field."""
    prompt = row.get("prompt")
    messages = None
    if isinstance(prompt, list):
        messages = chat_messages(prompt, f"{where}: 'prompt'")
        prompt = messages[-1]["content"]
    elif not isinstance(prompt, str) or not prompt:
        raise ConfigError(f"{where} has no non-empty 'prompt' (a string or a list of chat messages): {row!r}")
    if data_format == "verl":
        reward_model = row.get("reward_model")
        truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
        if isinstance(truth, bool) or not isinstance(truth, str | int | float):
            raise ConfigError(f"{where}: 'reward_model.ground_truth' must be a string or a number, got {truth!r}")
        answer: str | None = str(truth)
        meta = {k: v for k, v in row.items() if k != "prompt"}
    else:
        answer = row.get("answer")
        if answer is not None and not isinstance(answer, str):
            raise ConfigError(f"{where}: 'answer' must be a string, got {answer!r}")
        meta = {k: v for k, v in row.items() if k not in ("prompt", "answer")}
    return TaskItem(prompt=prompt, answer=answer, meta=meta or None, messages=messages)


def chat_messages(value: Any, where: str) -> tuple[dict[str, Any], ...]:
    """``value`` as chat messages: a non-empty list of dicts with string ``role`` and ``content``
    (keys whose value is None, which a columnar file adds for fields other rows have, dropped).
    ``ConfigError`` naming ``where`` and the message otherwise."""
    if not isinstance(value, list | tuple) or not value:
        raise ConfigError(f"{where} must be a non-empty list of chat messages, got {value!r}")
    messages = []
    for j, message in enumerate(value):
        if not isinstance(message, dict):
            raise ConfigError(f"{where}[{j}] must be a {{'role', 'content'}} object, got {message!r}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ConfigError(f"{where}[{j}] has no string {key!r}: {message!r}")
        messages.append({k: v for k, v in message.items() if v is not None})
    return tuple(messages)


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
