"""Combining the metrics of a train step's micro-batches (and ranks) into an optimizer step's,
and its optimizer steps' into the train step's.

What it owns: the one rule every trainer applies, so a metric means the same whatever the
micro-batch plan, the number of ranks or of optimizer steps: a ``*_max`` metric is the largest
of its parts, a ``*_count`` metric their sum, and any other metric (a mean) the mean of its
parts, weighted by each micro-batch's share of the optimizer step (its share of the trained
tokens or sequences), and over a train step's optimizer steps equally, among those that
report it (the training-inference gap, say, is measured at the first only).
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["accumulate_metrics", "combine_optimizer_steps", "merge_metric_sums"]


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


def combine_optimizer_steps(steps: list[Mapping[str, float]]) -> dict[str, float]:
    """A train step's metrics from those of its optimizer steps, in order (one step: its own, unchanged)."""
    combined: dict[str, float] = {}
    for key in dict.fromkeys(key for step in steps for key in step):
        values = [step[key] for step in steps if key in step]
        if key.endswith("_max"):
            combined[key] = max(values)
        elif key.endswith("_count"):
            combined[key] = sum(values)
        else:
            combined[key] = sum(values) / len(values)
    return combined
