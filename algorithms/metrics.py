"""Combining the metrics of a train step's micro-batches (and ranks) into the step's.

What it owns: the one rule every trainer applies, so a metric means the same whatever the
micro-batch plan or the number of ranks: a ``*_max`` metric is the largest of its parts, a
``*_count`` metric their sum, and any other metric (a mean) the mean of its parts weighted by
each part's share of the step (its share of the trained tokens or sequences).
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["accumulate_metrics", "merge_metric_sums"]


def accumulate_metrics(sums: dict[str, float], metrics: Mapping[str, float], share: float) -> None:
    """Add one part's ``metrics`` (a part that is ``share`` of the step) into ``sums`` in place."""
    for key, value in metrics.items():
        if key.endswith("_max"):
            sums[key] = max(sums.get(key, value), value)
        elif key.endswith("_count"):
            sums[key] = sums.get(key, 0.0) + value
        else:
            sums[key] = sums.get(key, 0.0) + share * value


def merge_metric_sums(parts: list[Mapping[str, float]]) -> dict[str, float]:
    """Sums from several ranks (each already weighted by its shares of the whole step) as one."""
    total: dict[str, float] = {}
    for part in parts:
        accumulate_metrics(total, part, 1.0)
    return total
