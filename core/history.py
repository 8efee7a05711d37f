"""The record of a run: one row per optimizer step and per weight sync, evaluation and mode change.

The train role appends a :class:`StepRecord` per step; listeners (the JSONL writer, the
Prometheus metrics, the progress bar) are told of each. The validate role appends a
:class:`ValidationRecord` per held-out evaluation, and the param_update role a
:class:`ModeChange` whenever weight-sync failures degrade admission to synchronous or it
recovers. ``metrics.jsonl`` gets one row per record, its ``kind`` saying which (``step``,
``validation``, ``mode``). Rows are small and O(steps), so the history of a long run stays
bounded by its step count.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ModeChange", "RunHistory", "StepRecord", "SyncRecord", "ValidationRecord"]


@dataclass(slots=True)
class StepRecord:
    """One optimizer step. ``staleness`` holds, per group, trained step minus start version;
    ``staleness_bound`` is the admission bound in force when the step trained (below the
    configured k while weight-sync failures hold the flow degraded)."""

    step: int
    time_s: float
    step_time_s: float
    groups: int
    samples: int
    tokens: int
    reward_mean: float
    staleness: list[int]
    loaded_version: int
    staleness_bound: int
    prompt_ids: list[int]
    train_metrics: dict[str, float] = field(default_factory=dict)
    rollout_metrics: dict[str, float] = field(default_factory=dict)  # means of the trajectories' own metrics

    def to_json(self) -> dict[str, Any]:
        row = {"kind": "step", **asdict(self)}
        row["reward_mean"] = _finite_or_none(self.reward_mean)
        return row


def _finite_or_none(value: float) -> float | None:
    return None if math.isnan(value) else value


@dataclass(slots=True, frozen=True)
class SyncRecord:
    version: int
    metrics: dict[str, float]


@dataclass(slots=True, frozen=True)
class ValidationRecord:
    """One held-out evaluation of the serving policy.

    ``version`` is the weight version evaluated: every sample started with it. If a weight
    update landed while the evaluation ran, some tokens came from newer weights, up to
    ``max_token_version`` (equal to ``version`` when the evaluation saw one version only).
    ``accuracy`` is the fraction of samples with full reward (>= 1.0).
    """

    version: int
    max_token_version: int
    time_s: float
    duration_s: float
    samples: int
    reward_mean: float
    accuracy: float

    def to_json(self) -> dict[str, Any]:
        return {"kind": "validation", **asdict(self), "reward_mean": _finite_or_none(self.reward_mean)}


@dataclass(slots=True, frozen=True)
class ModeChange:
    """Admission turned synchronous because weight syncs kept failing (``degraded``), or back."""

    time_s: float
    degraded: bool
    staleness_bound: int
    loaded_version: int
    trained_version: int
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"kind": "mode", **asdict(self)}


class RunHistory:
    """Steps and syncs of one run, with listeners and an optional JSONL file."""

    def __init__(self, jsonl_path: Path | None = None, append: bool = False) -> None:
        self.steps: list[StepRecord] = []
        self.syncs: list[SyncRecord] = []
        self.validations: list[ValidationRecord] = []
        self.mode_changes: list[ModeChange] = []
        self.staleness_counts: Counter[int] = Counter()
        self._listeners: list[Callable[[StepRecord], None]] = []
        self._validation_listeners: list[Callable[[ValidationRecord], None]] = []
        # append: a resumed run continues its file (``core.checkpoint.trim_metrics``).
        self._jsonl = jsonl_path.open("a" if append else "w") if jsonl_path is not None else None

    def on_step(self, listener: Callable[[StepRecord], None]) -> None:
        self._listeners.append(listener)

    def on_validation(self, listener: Callable[[ValidationRecord], None]) -> None:
        self._validation_listeners.append(listener)

    def add(self, record: StepRecord) -> None:
        self.steps.append(record)
        self.staleness_counts.update(record.staleness)
        self._write(record.to_json())
        for listener in self._listeners:
            listener(record)

    def add_validation(self, record: ValidationRecord) -> None:
        self.validations.append(record)
        self._write(record.to_json())
        for listener in self._validation_listeners:
            listener(record)

    def add_mode_change(self, record: ModeChange) -> None:
        self.mode_changes.append(record)
        self._write(record.to_json())

    def _write(self, row: dict[str, Any]) -> None:
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(row) + "\n")
            self._jsonl.flush()

    def add_sync(self, version: int, metrics: dict[str, float]) -> None:
        self.syncs.append(SyncRecord(version, dict(metrics)))

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
