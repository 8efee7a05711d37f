"""Handing a value from a worker thread to an event loop that may already have closed.

Engine threads (decode loops, the reward pool's result thread, process watchers) outlive the
runs that call them: a run can end, and its loop close, while a sequence is mid-decode or a
reward job is still scoring. ``loop.call_soon_threadsafe`` then raises ``RuntimeError``, which
would kill the worker thread and strand every later caller. :func:`post_to_loop` is the one
place that turns that case into a return value the thread can act on (drop the value, stop
decoding the caller's rows).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

__all__ = ["post_to_loop"]


def post_to_loop(loop: asyncio.AbstractEventLoop, callback: Callable[..., Any], *args: Any) -> bool:
    """Schedule ``callback(*args)`` on ``loop`` from any thread; False when the loop has closed
    (its run is over and nobody waits for the value), True when it was scheduled."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        if not loop.is_closed():  # only a closed loop is an expected end; anything else is a bug to see
            raise
        return False
    return True
