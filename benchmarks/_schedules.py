"""The synchronous baseline the end-to-end benchmarks compare async against: the better of two
thread budgets, measured in the same run (``e2e.py``, ``agentic.py``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
# The synchronous schedules tried for the baseline: (label, thread overrides). Explicit, since a
# Ray actor's default budget is its slots (one core), not the k = 0 default of all cores.
SYNC_BUDGETS = [
    ("all cores per phase", [f"engines.generation_threads={CORES}", f"engines.train_threads={CORES}"]),
    ("one core per phase", ["engines.generation_threads=1", "engines.train_threads=1"]),
]


def best_sync_row(measure: Callable[[list[str]], dict[str, Any]], rate: str, kept: tuple[str, ...]) -> dict[str, Any]:
    """Run ``measure(thread_overrides)`` (a k = 0 row) under every budget of ``SYNC_BUDGETS``; return
    the row with the highest ``rate``, labelled by its budget, with the others' ``kept`` fields
    (and labels) under ``other_sync_schedules``."""
    tried = [{**measure(budget), "threads": label} for label, budget in SYNC_BUDGETS]
    best = max(tried, key=lambda r: r[rate])
    best["other_sync_schedules"] = [{k: r[k] for k in ("threads", *kept)} for r in tried if r is not best]
    return best
