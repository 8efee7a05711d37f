"""A Chrome/Perfetto trace of stage states (open ``trace.json`` in ui.perfetto.dev).

Each state interval of each state machine becomes one complete event ("ph": "X") on that
role's track, so the timeline shows when every role was running, waiting or paused.
Timestamps come from the event loop's clock, so a virtual-clock run has a virtual timeline.
Recording stops at ``max_events`` and the file says how many were left out, so a long run's
memory stays bounded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["TraceRecorder"]


class TraceRecorder:
    """Collects complete events in memory and writes them as Chrome trace JSON."""

    def __init__(self, origin_s: float, max_events: int, enabled: bool = True) -> None:
        self.origin_s = origin_s
        self.max_events = max_events
        self.enabled = enabled
        self.events: list[dict[str, Any]] = []
        self.dropped = 0
        self._tracks: dict[str, int] = {}

    def track(self, name: str) -> int:
        """The thread id of a named track (one per role), created on first use."""
        tid = self._tracks.get(name)
        if tid is None:
            tid = self._tracks[name] = len(self._tracks) + 1
        return tid

    def span(self, track: str, name: str, start_s: float, end_s: float, args: dict[str, Any] | None = None) -> None:
        if not self.enabled:
            return
        if len(self.events) >= self.max_events:
            self.dropped += 1
            return
        event: dict[str, Any] = {
            "name": name,
            "ph": "X",
            "pid": 1,
            "tid": self.track(track),
            "ts": (start_s - self.origin_s) * 1e6,
            "dur": max(0.0, end_s - start_s) * 1e6,
        }
        if args:
            event["args"] = args
        self.events.append(event)

    def write(self, path: Path) -> None:
        meta = [
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}}
            for name, tid in self._tracks.items()
        ]
        doc = {"traceEvents": meta + self.events, "otherData": {"events_left_out": self.dropped}}
        path.write_text(json.dumps(doc))
