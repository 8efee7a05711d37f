"""The record of a run: one row per optimizer step and per weight sync.

The train role appends a :class:`StepRecord` per step; listeners (the JSONL writer, the
Prometheus metrics, the progress bar) are told of each. Rows are small and O(steps), so the
history of a long run stays bounded by its step count.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["RunHistory", "StepRecord", "SyncRecord"]


@dataclass(slots=True)
class StepRecord:
    """One optimizer step. ``staleness`` holds, per group, trained step minus start version."""

    step: int
    time_s: float
    step_time_s: float
    groups: int
    samples: int
    tokens: int
    reward_mean: float
    staleness: list[int]
    loaded_version: int
    prompt_ids: list[int]
    train_metrics: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        row = asdict(self)
        row["reward_mean"] = None if math.isnan(self.reward_mean) else self.reward_mean
        return row


@dataclass(slots=True, frozen=True)
class SyncRecord:
    version: int
    metrics: dict[str, float]


class RunHistory:
    """Steps and syncs of one run, with listeners and an optional JSONL file."""

    def __init__(self, jsonl_path: Path | None = None, append: bool = False) -> None:
        self.steps: list[StepRecord] = []
        self.syncs: list[SyncRecord] = []
        self.staleness_counts: Counter[int] = Counter()
        self._listeners: list[Callable[[StepRecord], None]] = []
        # append: a resumed run continues its file (``pipeline.checkpoint.trim_metrics``).
        self._jsonl = jsonl_path.open("a" if append else "w") if jsonl_path is not None else None

    def on_step(self, listener: Callable[[StepRecord], None]) -> None:
        self._listeners.append(listener)

    def add(self, record: StepRecord) -> None:
        self.steps.append(record)
        self.staleness_counts.update(record.staleness)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record.to_json()) + "\n")
            self._jsonl.flush()
        for listener in self._listeners:
            listener(record)

    def add_sync(self, version: int, metrics: dict[str, float]) -> None:
        self.syncs.append(SyncRecord(version, dict(metrics)))

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
