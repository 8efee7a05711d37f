"""A picture of a run: reward and staleness per step, as a PNG in the run folder.

matplotlib is an optional dependency (the ``torch`` extra); without it the plot is skipped
with a log line, never an error, since the numbers are in ``metrics.jsonl`` anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog

__all__ = ["plot_run"]


def plot_run(steps: Sequence[dict[str, Any]], path: Path) -> bool:
    """Plot the step rows of ``metrics.jsonl`` (the whole run) into ``path``."""
    # False (and a log line) when matplotlib is missing or there are no steps.
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: never needs a display
        import matplotlib.pyplot as plt
    except ImportError:
        structlog.get_logger("tandem").info("plot skipped: matplotlib is not installed")
        return False
    if not steps:
        return False
    x = [s["step"] + 1 for s in steps]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    rewards = [s["reward_mean"] if s["reward_mean"] is not None else float("nan") for s in steps]
    top.plot(x, rewards, marker=".", color="tab:green", alpha=0.35, label="per step")
    # One step's batch is small, so its reward is noisy: the moving average shows the trend.
    window = max(1, min(10, len(rewards) // 5))
    smooth = [sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1])
              for i in range(len(rewards))]
    top.plot(x, smooth, color="tab:green", linewidth=2, label=f"mean of last {window} steps")
    top.set_ylabel("mean reward")
    top.legend()
    top.grid(alpha=0.3)
    bottom.plot(x, [sum(s["staleness"]) / len(s["staleness"]) for s in steps], marker=".", label="mean")
    bottom.plot(x, [max(s["staleness"]) for s in steps], linestyle="--", label="max")
    bottom.set_ylabel("staleness (versions)")
    bottom.set_xlabel("optimizer step")
    bottom.legend()
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
