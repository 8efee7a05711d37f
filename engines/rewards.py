"""A task's reward: its reward functions, weighted and summed, run so that none can stall the run.

What it owns: calling each :class:`~core.task.RewardFunction` on a micro-batch of trajectories
(rendered by the workload into what the function reads: the decoded text for text tasks), the
worker processes ``pool`` functions run in, and the combination ``reward = sum(weight * value)``
with every named value kept in ``RewardResult.components``.

Failure isolation: each sample is guarded on its own. A function that raises, returns something
that is not a finite number (or a ``RewardResult``), or, in the pool, hangs or kills its worker
past ``timeout_s`` fails that sample only, with the reason recorded: the sample scores 0 and is
marked failed; the run goes on. A pool call that times out replaces the pool and scores the
batch again one sample at a time, each under the same timeout, so only the culprit fails. The
timeout bounds scoring alone: a new worker first starts and imports the reward functions (seconds
on a loaded machine), bounded separately.

``multiprocessing.Pool`` rather than ``concurrent.futures``: it can be terminated, which a hung
worker needs. The ``spawn`` start method keeps the workers free of the trainer's threads.
Functions cross to the workers by dotted path and are imported there once.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import multiprocessing
import multiprocessing.pool
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

from tandem.core.config import import_named
from tandem.core.protocols import RewardResult
from tandem.core.records import PromptGroup, Trajectory
from tandem.core.task import RewardFunction
from tandem.core.threadsafe import post_to_loop

__all__ = ["TaskReward", "resolve_function"]

Verdict = tuple[float, bool, str]  # (value, ok, why it failed)
_STARTUP_TIMEOUT_S = 120.0  # a new worker process starts and imports the reward functions within this
_NO_CONTEXT: dict[str, Any] = {}
CONTEXT_KEYS = ("prompt", "meta", "trajectory")  # what a function may declare beyond (response, answer)


@cache
def resolve_function(path: str) -> Callable[..., Any]:
    """The function ``module:function`` names (imported once per process)."""
    fn = import_named(path, "task.rewards")
    if not callable(fn):
        raise ValueError(f"reward function {path!r} is not callable")
    return fn


def _wanted_context(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The context keywords ``fn`` declares (all of them if it takes ``**kwargs``)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return CONTEXT_KEYS
    names = {p.name for p in params}
    return tuple(k for k in CONTEXT_KEYS if k in names)


def _verdict(value: Any) -> Verdict:
    if isinstance(value, RewardResult):
        value, ok, info = value.reward, value.ok, value.info
        if not ok:
            return 0.0, False, info
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return 0.0, False, f"returned {value!r}, not a finite number"
    return float(value), True, ""


async def _call_each(fn: Callable[..., Any], responses: list[Any], answers: list[str | None],
                     contexts: list[dict[str, Any]]) -> list[Verdict]:
    out: list[Verdict] = []
    awaited = inspect.iscoroutinefunction(fn)
    for response, answer, context in zip(responses, answers, contexts, strict=True):
        try:
            value = fn(response, answer, **context)
            if awaited or (type(value) is not float and inspect.isawaitable(value)):
                value = await value
        except Exception as exc:
            out.append((0.0, False, f"raised {type(exc).__name__}: {exc}"))
            continue
        if type(value) is float and math.isfinite(value):  # the common case, decided at once
            out.append((value, True, ""))
        else:
            out.append(_verdict(value))
    return out


def _import_functions(paths: tuple[str, ...]) -> None:
    """Runs in a new worker process: import every pool function before any is timed."""
    for path in paths:
        resolve_function(path)


def _score_in_worker(path: str, responses: list[Any], answers: list[str | None],
                     contexts: list[dict[str, Any]]) -> list[Verdict]:
    """Runs in a worker process: one verdict per sample (an async function gets its own loop)."""
    return asyncio.run(_call_each(resolve_function(path), responses, answers, contexts))


class TaskReward:
    """Implements :class:`core.protocols.Reward` over a task's weighted reward functions.

    ``render(trajectory)`` is the workload's view of a trajectory that the functions score.
    Every function is imported here once (a bad path fails at build time, naming it); pool
    functions are imported again in each worker, by the same path.
    """

    def __init__(
        self,
        functions: Sequence[RewardFunction],
        render: Callable[[Trajectory], Any],
        *,
        timeout_s: float = 10.0,
        workers: int = 1,
    ) -> None:
        if not functions:
            raise ValueError("a reward needs at least one reward function")
        names = [f.name for f in functions]
        if len(set(names)) != len(names):
            raise ValueError(f"reward function names must be unique, got {names}")
        self.functions = list(functions)
        self._render = render
        self._timeout_s = timeout_s
        self._workers = workers
        self._pool: multiprocessing.pool.Pool | None = None
        # Resolved here too, pool functions included: a bad path fails before the run starts, and
        # the context a function declares is read off its signature once.
        resolved = {f.name: resolve_function(f.fn) for f in functions}
        self._inline = {f.name: resolved[f.name] for f in functions if f.runner == "inline"}
        self._context = {name: _wanted_context(fn) for name, fn in resolved.items()}
        self.restarts = 0  # pools replaced after a hang or a crash
        self._starting: asyncio.Task[multiprocessing.pool.Pool] | None = None

    async def score(self, trajectories: Sequence[Trajectory], groups: Sequence[PromptGroup]) -> list[RewardResult]:
        responses = [self._render(t) for t in trajectories]
        answers = [g.answer for g in groups]
        verdicts: dict[str, list[Verdict]] = {}
        for function in self.functions:
            wanted = self._context[function.name]
            if wanted:
                contexts = [_context(wanted, t, g) for t, g in zip(trajectories, groups, strict=True)]
            else:
                contexts = [_NO_CONTEXT] * len(trajectories)  # one shared empty mapping, never written
            if function.runner == "inline":
                verdicts[function.name] = await _call_each(self._inline[function.name], responses, answers, contexts)
            else:
                verdicts[function.name] = await self._in_pool(function.fn, responses, answers, contexts)
        return [self._combine(verdicts, i) for i in range(len(trajectories))]

    def _combine(self, verdicts: dict[str, list[Verdict]], i: int) -> RewardResult:
        if len(self.functions) == 1:  # one function: its weighted verdict is the result
            only = self.functions[0]
            value, ok, info = verdicts[only.name][i]
            return RewardResult(only.weight * value) if ok else RewardResult(0.0, ok=False, info=f"{only.name} {info}")
        components: dict[str, float] = {}
        failures: list[str] = []
        total = 0.0
        for function in self.functions:
            value, ok, info = verdicts[function.name][i]
            components[function.name] = value
            total += function.weight * value
            if not ok:
                failures.append(f"{function.name} {info}")
        if failures:
            return RewardResult(0.0, ok=False, info="; ".join(failures), components=components)
        return RewardResult(total, components=components if len(self.functions) > 1 else None)

    async def _ensure_pool(self) -> multiprocessing.pool.Pool:
        """The worker pool, started if need be and ready: every worker has imported the pool
        functions, so ``timeout_s`` bounds scoring alone, never a worker's start-up (seconds of
        interpreter start and imports on a loaded machine). Concurrent callers share one start."""
        if self._pool is not None:
            return self._pool
        loop = asyncio.get_running_loop()
        if self._starting is None or self._starting.get_loop() is not loop or self._starting.done():
            self._starting = loop.create_task(self._start_pool())
        # Shielded: a caller that stops waiting leaves the start to the others; the run's end
        # cancels the start itself, which then terminates its pool (no thread left waiting).
        return await asyncio.shield(self._starting)

    async def _start_pool(self) -> multiprocessing.pool.Pool:
        pool = multiprocessing.get_context("spawn").Pool(self._workers)
        paths = tuple(f.fn for f in self.functions if f.runner == "pool")
        try:
            ready = [_submitted(pool, _import_functions, (paths,)) for _ in range(self._workers)]
            await asyncio.wait_for(asyncio.gather(*ready), _STARTUP_TIMEOUT_S)
        except BaseException:
            pool.terminate()
            raise
        self._pool = pool
        return pool

    def _restart(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool = None
        self.restarts += 1

    async def _apply(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        return await asyncio.wait_for(_submitted(await self._ensure_pool(), fn, args), self._timeout_s)

    async def _in_pool(self, path: str, responses: list[Any], answers: list[str | None],
                       contexts: list[dict[str, Any]]) -> list[Verdict]:
        try:
            return await self._apply(_score_in_worker, (path, responses, answers, contexts))
        except TimeoutError:
            self._restart()
        verdicts: list[Verdict] = []
        for one in zip(responses, answers, contexts, strict=True):
            try:
                verdicts += await self._apply(_score_in_worker, (path, *([x] for x in one)))
            except TimeoutError:
                self._restart()
                verdicts.append((0.0, False, f"timed out after {self._timeout_s}s"))
        return verdicts

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None


def _submitted(pool: multiprocessing.pool.Pool, fn: Callable[..., Any], args: tuple[Any, ...]) -> asyncio.Future[Any]:
    """``fn(*args)`` in ``pool``, as a future of the running loop (nothing blocks a thread on it)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def settle(setter: Callable[[Any], None], value: Any) -> None:
        if not done.done():
            setter(value)

    # The callbacks run on the pool's result thread, which must never raise: it would die, later
    # results would never arrive, and ``terminate`` would fail on the job left behind. A closed
    # loop (its run ended while the job ran) has nobody waiting: post_to_loop drops the value.
    pool.apply_async(
        fn,
        args,
        callback=lambda r: post_to_loop(loop, settle, done.set_result, r),
        error_callback=lambda e: post_to_loop(loop, settle, done.set_exception, e),
    )
    return done


def _context(wanted: tuple[str, ...], trajectory: Trajectory, group: PromptGroup) -> dict[str, Any]:
    values = {"prompt": group.prompt, "meta": group.item.meta, "trajectory": trajectory}
    return {key: values[key] for key in wanted}
