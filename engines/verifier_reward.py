"""Rule-based rewards scored in a worker process, so a slow or broken verifier never blocks.

The verifier is a plain function ``verify(response_text, answer) -> float``, importable by
name (it crosses to the worker process by reference). A micro-batch is scored in one call;
each sample is guarded inside the worker, so a verifier that raises fails only its sample,
with the exception recorded as the reason. A call that hangs or kills its worker runs into
``timeout_s``: the pool is replaced and the batch is scored again one sample at a time, each
under the same timeout, so only the culprit is scored as failed ("timed out"). The run goes
on in every case.

``multiprocessing.Pool`` rather than ``concurrent.futures``: it can be terminated, which a
hung worker needs. The ``spawn`` start method keeps the worker free of the trainer's threads.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import multiprocessing.pool
from collections.abc import Callable, Sequence
from typing import Any

from core.protocols import RewardResult
from core.records import Sample

__all__ = ["VerifierReward"]

Verifier = Callable[[str, str | None], float]


def _score_batch(verify: Verifier, responses: list[str], answers: list[str | None]) -> list[tuple[float, bool, str]]:
    """Runs in the worker: one verdict per sample; an exception fails only its sample."""
    out: list[tuple[float, bool, str]] = []
    for response, answer in zip(responses, answers, strict=True):
        try:
            value = verify(response, answer)
        except Exception as exc:
            out.append((0.0, False, f"verifier raised {type(exc).__name__}: {exc}"))
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            out.append((0.0, False, f"verifier returned {value!r}, not a finite number"))
        else:
            out.append((float(value), True, ""))
    return out


class VerifierReward:
    """Implements the ``Reward`` protocol with ``verify`` run in a worker process pool."""

    def __init__(self, verify: Verifier, timeout_s: float = 10.0, workers: int = 1) -> None:
        self._verify = verify
        self._timeout_s = timeout_s
        self._workers = workers
        self._pool: multiprocessing.pool.Pool | None = None
        self.restarts = 0  # pools replaced after a hang or a crash

    def _ensure_pool(self) -> multiprocessing.pool.Pool:
        if self._pool is None:
            self._pool = multiprocessing.get_context("spawn").Pool(self._workers)
        return self._pool

    def _restart(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool = None
        self.restarts += 1

    async def _call(self, responses: list[str], answers: list[str | None]) -> list[tuple[float, bool, str]]:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()

        def settle(setter: Callable[[Any], None], value: Any) -> None:
            if not done.done():
                setter(value)

        self._ensure_pool().apply_async(
            _score_batch,
            (self._verify, responses, answers),
            callback=lambda r: loop.call_soon_threadsafe(settle, done.set_result, r),
            error_callback=lambda e: loop.call_soon_threadsafe(settle, done.set_exception, e),
        )
        return await asyncio.wait_for(done, self._timeout_s)

    async def score(self, samples: Sequence[Sample], answers: Sequence[str | None]) -> list[RewardResult]:
        responses = [s.response_text for s in samples]
        try:
            verdicts = await self._call(responses, list(answers))
        except TimeoutError:
            self._restart()
            verdicts = []
            for response, answer in zip(responses, answers, strict=True):
                try:
                    verdicts += await self._call([response], [answer])
                except TimeoutError:
                    self._restart()
                    verdicts.append((0.0, False, f"verifier timed out after {self._timeout_s}s"))
        return [RewardResult(reward, ok, info) for reward, ok, info in verdicts]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None
