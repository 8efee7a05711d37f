"""Reward functions with known behaviour (and misbehaviour), importable by the reward's workers."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping
from typing import Any


def exact(response: str, answer: str | None) -> float:
    """1.0 for the right answer; hangs on "hang", takes a second on "slow", kills its process on
    "crash", raises on "boom"."""
    if response == "hang":
        time.sleep(60)
    if response == "slow":
        time.sleep(1.0)
    if response == "crash":
        os._exit(1)
    if response == "boom":
        raise ValueError("cannot parse")
    if response == "nan":
        return float("nan")
    return 1.0 if response == answer else 0.0


def shortness(response: str, answer: str | None) -> float:
    """1 / (1 + characters): a second reward to weigh against correctness."""
    return 1.0 / (1.0 + len(response))


async def async_exact(response: str, answer: str | None) -> float:
    """``exact`` as a coroutine function (an async reward, e.g. one that calls a judge)."""
    await asyncio.sleep(0)
    return 1.0 if response == answer else 0.0


def prompt_echo(response: str, answer: str | None, *, prompt: str, meta: Mapping[str, Any] | None) -> float:
    """1.0 when the response repeats the prompt, plus the item's ``bonus`` meta field: a reward
    that reads its context."""
    return float(response == prompt) + float((meta or {}).get("bonus", 0.0))
