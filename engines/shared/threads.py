"""Per-role CPU thread budgets for the torch compute that engines run on their worker threads.

Why budgets: on the 2-core machines this project targets, two roles each letting torch use
every core oversubscribe the CPU (measured: generation 36x and training 7x slower), while
one thread per concurrent role keeps each at ~98 % of its solo speed.

What ``torch.set_num_threads`` does on this build (torch 2.13+cpu, OpenMP backend, MKL),
measured by ``tests/unit/engines/test_threads.py``:

- it sets the *calling thread's* OpenMP team size (and MKL's thread-local count): a thread
  that has already used torch keeps its own setting when another thread calls it (the main
  thread stayed at 2 while a worker set 1; a 1024x1024 matmul x20 took 0.34 s there against
  0.63 s on the 1-thread worker);
- it also records a process-wide default that a thread adopts the first time it touches
  torch's thread pool, so a *fresh* thread inherits whatever value some other thread set last.

Hence the invariant this module keeps: every engine worker thread applies its own budget
first thing, before any torch work, and never relies on the process default.

Also here: :class:`ClosesOnAThread`, the ``async with`` / ``aclose()`` every engine with a
blocking ``close()`` (joining its threads or processes) offers, run off the event loop.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Self

import torch

__all__ = ["ClosesOnAThread", "apply_thread_budget", "budgeted_executor"]


class ClosesOnAThread:
    """Mixin for an engine whose ``close()`` blocks: ``aclose()`` and ``async with`` run it on a
    thread, so the event loop keeps serving while threads or processes are joined."""

    def close(self) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def apply_thread_budget(num_threads: int) -> None:
    """Limit torch's intra-op parallelism in the calling thread to ``num_threads``."""
    if num_threads < 1:
        raise ValueError(f"a thread budget must be >= 1, got {num_threads}")
    torch.set_num_threads(num_threads)


def budgeted_executor(name: str, num_threads: int) -> ThreadPoolExecutor:
    """One dedicated worker thread whose torch compute uses at most ``num_threads`` cores.

    A single worker serialises the engine's compute (one model, one optimizer: no locks
    needed around them). The caller owns the executor and must ``shutdown()`` it.
    """
    if num_threads < 1:
        raise ValueError(f"a thread budget must be >= 1, got {num_threads}")
    return ThreadPoolExecutor(
        max_workers=1,
        thread_name_prefix=name,
        initializer=apply_thread_budget,
        initargs=(num_threads,),
    )
