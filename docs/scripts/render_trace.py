"""Render a run's ``trace.json`` (the stage timeline) to a PNG, for the documentation.

``python docs/scripts/render_trace.py runs/default/trace.json docs/img/trace.png --start 20 --seconds 6``

One row per track (a role, or an engine's own track), one bar per state interval coloured by
state, over a window of the run: the picture Perfetto shows, without Perfetto.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

# The states of state_machines/base.py in a fixed colour each; anything else is grey.
COLOURS = {"running": "tab:green", "waiting_input": "tab:orange", "waiting_output": "tab:red",
           "paused": "tab:purple", "idle": "lightgrey"}


def render(trace: Path, out: Path, start_s: float, seconds: float) -> None:
    doc = json.loads(trace.read_text())
    events = doc["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    tids = sorted(names)
    end_s = start_s + seconds
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(tids) + 1.2))
    seen: set[str] = set()
    for row, tid in enumerate(tids):
        for e in events:
            if e.get("ph") != "X" or e["tid"] != tid:
                continue
            a, b = e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6
            if b < start_s or a > end_s:
                continue
            state = e["name"]
            label = state if state not in seen and state in COLOURS else None
            seen.add(state)
            ax.broken_barh([(max(a, start_s), min(b, end_s) - max(a, start_s))], (row - 0.4, 0.8),
                           color=COLOURS.get(state, "grey"), label=label)
    ax.set_yticks(range(len(tids)), [names[t] for t in tids])
    ax.invert_yaxis()
    ax.set_xlim(start_s, end_s)
    ax.set_xlabel("seconds since the run started")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(COLOURS), frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--start", type=float, default=0.0, help="window start, seconds since the run started")
    parser.add_argument("--seconds", type=float, default=5.0, help="window length")
    args = parser.parse_args()
    render(args.trace, args.out, args.start, args.seconds)


if __name__ == "__main__":
    main()
