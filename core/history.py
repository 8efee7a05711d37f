"""The record of a run: one row per optimizer step and per weight sync, evaluation and mode change.

The train role appends a :class:`StepRecord` per step; listeners (the JSONL writer, the
Prometheus metrics, the progress bar) are told of each. The validate role appends a
:class:`ValidationRecord` per held-out evaluation, and the param_update role a
:class:`ModeChange` whenever weight-sync failures degrade admission to synchronous or it
recovers; the critic role a :class:`CriticRecord` per critic step. ``metrics.jsonl`` gets one
row per record, its ``kind`` saying which (``step``, ``validation``, ``mode``, ``critic``). Rows
stream to the file; memory keeps bounded summaries only (see :class:`RunHistory`), so a run of
any length holds the same few records.
"""

from __future__ import annotations

import json
import math
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "CriticRecord", "ModeChange", "RunHistory", "StepRecord", "SyncRecord", "ValidationRecord", "read_step_rows",
]


@dataclass(slots=True)
class StepRecord:
    """One train step (one version; ``train_metrics`` count its ``optimizer_steps`` and the run's
    ``optimizer_steps_total``). ``staleness`` holds, per group, trained step minus start version;
    ``staleness_bound`` is the admission bound in force when the step trained (below the
    configured k while weight-sync failures hold the flow degraded).

    The lag of every trained trajectory, in the batch's order: ``trajectory_staleness`` (step
    minus the version of its first token: its staleness at consumption), ``version_span`` (its
    newest token's version minus its oldest's: > 0 for a partial rollout that went on through a
    weight update), ``in_flight_s`` (from the request to the rollout workflow to its delivery:
    waiting for a decode slot and decoding) and ``queued_s`` (from its delivery to the start of
    this step: assembling its group, the later stages, waiting for its step); with a critic,
    ``value_staleness`` (step minus the critic version its values came from). ``consumption``
    counts what happened to this step's slots on the way (``state_machines.consumption``)."""

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
    trajectory_staleness: list[int] = field(default_factory=list)
    version_span: list[int] = field(default_factory=list)
    in_flight_s: list[float] = field(default_factory=list)
    queued_s: list[float] = field(default_factory=list)
    value_staleness: list[int] = field(default_factory=list)
    consumption: dict[str, int] = field(default_factory=dict)

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
    ``score`` is the share of samples that met the task's held-out measure, named ``measure``
    (:class:`~core.task.HeldOutMeasure`: ``exact_answer``, ``recognized``, ``accuracy``...); its
    row carries the score under that name.
    """

    version: int
    max_token_version: int
    time_s: float
    duration_s: float
    samples: int
    reward_mean: float
    measure: str
    score: float

    def to_json(self) -> dict[str, Any]:
        row = {"kind": "validation", **asdict(self), "reward_mean": _finite_or_none(self.reward_mean)}
        row[self.measure] = row.pop("score")
        return row


@dataclass(slots=True, frozen=True)
class CriticRecord:
    """One optimizer step of the critic (the value model of ``algorithm.advantage: gae``): the
    version it reached, the policy step whose batch it trained on, and its loss metrics."""

    version: int
    policy_step: int
    time_s: float
    metrics: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        return {"kind": "critic", **asdict(self)}


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
    """The run's records as they land: every row streams to ``metrics.jsonl`` (and to the row
    listeners, e.g. experiment trackers), while memory keeps only bounded summaries.

    Invariant: what is kept in memory does not grow with the run's length: the most recent
    ``keep`` step and sync records (the whole run is in the file), running totals, the staleness
    histogram (bounded by the staleness bound) and the rewards of the first and last tenth of
    ``max_steps`` steps (the summary's start and end). Validations and mode changes are kept
    whole: one per evaluation interval or per degradation, not per step.
    """

    def __init__(
        self, jsonl_path: Path | None = None, append: bool = False, *, keep: int = 1000, max_steps: int = 10
    ) -> None:
        if keep < 1 or max_steps < 1:
            raise ValueError("keep and max_steps must be >= 1")
        self.steps: deque[StepRecord] = deque(maxlen=keep)
        self.syncs: deque[SyncRecord] = deque(maxlen=keep)
        self.critic: CriticRecord | None = None  # the critic's latest step, if the run has a critic
        self.validations: list[ValidationRecord] = []
        self.mode_changes: list[ModeChange] = []
        self.staleness_counts: Counter[int] = Counter()
        self.total_steps = 0
        self.samples = 0
        self.tokens = 0
        self._tenth = max(1, max_steps // 10)
        self.first_rewards: list[float] = []  # of the first tenth of the steps
        self.last_rewards: deque[float] = deque(maxlen=self._tenth)  # of the latest tenth
        self._listeners: list[Callable[[StepRecord], None]] = []
        self._validation_listeners: list[Callable[[ValidationRecord], None]] = []
        self._sync_listeners: list[Callable[[SyncRecord], None]] = []
        self._row_listeners: list[Callable[[dict[str, Any]], None]] = []
        # append: a resumed run continues its file (``core.checkpoint.trim_metrics``).
        self._jsonl = jsonl_path.open("a" if append else "w") if jsonl_path is not None else None

    def on_step(self, listener: Callable[[StepRecord], None]) -> None:
        self._listeners.append(listener)

    def on_validation(self, listener: Callable[[ValidationRecord], None]) -> None:
        self._validation_listeners.append(listener)

    def on_sync(self, listener: Callable[[SyncRecord], None]) -> None:
        self._sync_listeners.append(listener)

    def on_row(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Call ``listener(row)`` with every row written to ``metrics.jsonl`` (steps,
        validations, mode changes), file or not."""
        self._row_listeners.append(listener)

    def add(self, record: StepRecord) -> None:
        self.steps.append(record)
        self.total_steps += 1
        self.samples += record.samples
        self.tokens += record.tokens
        self.staleness_counts.update(record.staleness)
        if not math.isnan(record.reward_mean):
            if len(self.first_rewards) < self._tenth:
                self.first_rewards.append(record.reward_mean)
            self.last_rewards.append(record.reward_mean)
        if self._jsonl is not None or self._row_listeners:  # the row costs a deep copy: only if read
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
        for listener in self._row_listeners:
            listener(row)

    def add_sync(self, version: int, metrics: dict[str, float]) -> None:
        record = SyncRecord(version, dict(metrics))
        self.syncs.append(record)
        for listener in self._sync_listeners:
            listener(record)

    def add_critic(self, record: CriticRecord) -> None:
        """A critic step: streamed to ``metrics.jsonl`` and the row listeners; the latest kept."""
        self.critic = record
        self._write(record.to_json())

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None


def read_step_rows(path: Path) -> list[dict[str, Any]]:
    """The step rows of a ``metrics.jsonl`` (the whole run, whatever memory kept)."""
    if not path.is_file():
        return []
    rows = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return [row for row in rows if row.get("kind") == "step"]
