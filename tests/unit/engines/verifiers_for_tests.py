"""Verifiers with known misbehaviour, importable by the reward's worker process."""

from __future__ import annotations

import os
import time


def exact(response: str, answer: str | None) -> float:
    """1.0 for the right answer; hangs on "hang", kills its process on "crash", raises on "boom"."""
    if response == "hang":
        time.sleep(60)
    if response == "crash":
        os._exit(1)
    if response == "boom":
        raise ValueError("cannot parse")
    if response == "nan":
        return float("nan")
    return 1.0 if response == answer else 0.0
