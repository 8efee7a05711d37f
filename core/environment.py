"""Multi-turn environments: the protocol they implement and the runner that drives them from asyncio.

An environment is gymnasium-shaped but speaks text. ``reset(seed)`` starts an episode and returns
the first observation; ``step(action_text)`` takes one model turn (its decoded text, without the
end-of-turn token) and returns a :class:`StepResult`; ``max_turns`` is the turn limit it declares
and enforces (the step that reaches it reports ``truncated`` unless the episode terminated).
Gymnasium environments plug in through thin adapters that render observations as text and parse
actions (``tasks/frozenlake``); tools are environments too (``tasks/calculator``). A task of kind
``episode`` names its environment through :class:`EnvironmentTask`.

Environments are synchronous and not trusted to behave. :class:`EnvironmentRunner` drives each one
from the event loop through an :class:`EnvironmentSession`: every call (building the environment,
``reset``, ``step``) runs on a worker thread, with the environment either in this process
(``isolation="thread"``) or in a child process of its own (``isolation="process"``), under
``timeout_s``. Whatever goes wrong (the call raises, hangs past the timeout, the child process
dies, or the output breaks the protocol) becomes an :class:`EpisodeFailure` raised to the one
episode awaiting that call, with its kind and reason; the loop and the other episodes never see it.

Invariants:

- a session makes one call at a time, and a call returns a well-formed value or raises
  :class:`EpisodeFailure`; a caller's misuse (stepping before ``reset`` or after the episode
  ended, calling again after cancelling a call) raises ``RuntimeError`` instead;
- after an :class:`EpisodeFailure` the session is failed: every later call re-raises the same
  failure without touching the environment, whose state is unknown;
- an episode ends within ``max_turns`` steps: a step that reaches the limit with neither
  ``terminated`` nor ``truncated`` set is a ``malformed`` failure;
- a hung call never blocks the loop. In a process, the child is killed at the timeout, which frees
  its thread at once; in a thread it cannot be stopped (Python has no way to), so the thread stays
  busy until the call returns and is counted in :attr:`EnvironmentRunner.stuck_calls`. Hence:
  threads for cheap trusted environments (FrozenLake: a call costs microseconds), a process for
  untrusted, crash-prone or hang-prone ones (a call costs a pickling round trip, a session a
  process start).

This module imports only the standard library.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import multiprocessing
import numbers
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Literal, NoReturn, Protocol, runtime_checkable

__all__ = [
    "Environment",
    "EnvironmentFactory",
    "EnvironmentRunner",
    "EnvironmentSession",
    "EnvironmentTask",
    "EpisodeFailure",
    "FailureKind",
    "Isolation",
    "StepResult",
]

# raised: the environment raised; timeout: no answer within timeout_s; crashed: its process died;
# malformed: it answered, but not what the protocol promises.
FailureKind = Literal["raised", "timeout", "crashed", "malformed"]
Isolation = Literal["thread", "process"]


@dataclass(slots=True, frozen=True)
class StepResult:
    """What one step returns, gymnasium's five values with a text observation.

    ``observation`` is the text the environment appends to the episode after the model's turn
    (it is the next turn's prompt; empty once the episode is over, if the environment has
    nothing more to say). ``reward`` is this step's reward, finite. ``terminated``: the episode
    reached an end state (goal, failure, final answer); ``truncated``: it was cut off by the turn
    limit. ``info`` holds diagnostics (e.g. why an action was rejected), never needed to train.
    """

    observation: str
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """A synchronous text environment. Implementations need not be thread-safe: a session makes
    one call at a time."""

    @property
    def max_turns(self) -> int:
        """The most steps an episode takes; the step that reaches it reports ``truncated``."""
        ...

    def reset(self, seed: int) -> str:
        """Start an episode, deterministic in ``seed``; return the first observation."""
        ...

    def step(self, action_text: str) -> StepResult:
        """Apply one model turn (decoded text without the end-of-turn token)."""
        ...


# Builds a fresh environment. Under process isolation it is pickled into the child, so it must
# be importable by reference: a module-level class or function, or a functools.partial of one.
EnvironmentFactory = Callable[[], Environment]


@runtime_checkable
class EnvironmentTask(Protocol):
    """What a task of kind ``episode`` has beyond :class:`core.task.Task`: the environment it is played in.

    Each item's ``meta["seed"]`` is the seed its episodes reset the environment with; all samples
    of a group share it, so GRPO compares plays of the same start (as ROLL does) and only the
    sampling differs. The item's ``prompt`` is the first observation as text (logs, the admission
    budget); the environment's ``reset`` is what the episode actually starts from.
    """

    def environment(self) -> EnvironmentFactory:
        """A factory of fresh environments with the task's options (picklable: see ``EnvironmentFactory``)."""
        ...


class EpisodeFailure(Exception):
    """An episode that failed because its environment misbehaved; carries what to record."""

    def __init__(self, kind: FailureKind, call: str, detail: str) -> None:
        super().__init__(f"environment {call} {kind}: {detail}")
        self.kind: FailureKind = kind
        self.call = call  # "open" (building the environment), "reset" or "step"
        self.detail = detail

    @property
    def reason(self) -> str:
        """One line for the ledger and the logs."""
        return str(self)


class _Reported(Exception):
    """The child process answered with a failure of this kind."""

    def __init__(self, kind: FailureKind, detail: str) -> None:
        super().__init__(detail)
        self.kind: FailureKind = kind


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class _InThread:
    """The environment lives in this process; calls run on the runner's worker threads."""

    def __init__(self, factory: EnvironmentFactory) -> None:
        self._factory = factory
        self._environment: Environment | None = None

    def open(self) -> object:
        self._environment = self._factory()
        return self._environment.max_turns

    def call(self, method: str, argument: object) -> object:
        return getattr(self._environment, method)(argument)

    def abort(self) -> None:
        """Nothing to do: a running thread cannot be stopped; the runner counts it as stuck."""

    def close(self) -> None:
        self._environment = None


def _serve(connection: Connection, factory: EnvironmentFactory) -> None:
    """The child process's loop: build the environment, answer calls until told to stop (None)."""
    environment: Environment | None = None
    while (message := connection.recv()) is not None:
        method, argument = message
        try:
            if method == "open":
                environment = factory()
                reply: tuple[str, object] = ("ok", environment.max_turns)
            else:
                reply = ("ok", getattr(environment, method)(argument))
        except Exception as exc:
            reply = ("raised", _describe(exc))
        try:
            connection.send(reply)
        except Exception as exc:  # the answer does not pickle: nothing was written, say why instead
            connection.send(("malformed", f"answer cannot be sent back: {_describe(exc)}"))


class _InProcess:
    """The environment lives in a child process of its own; a call is a round trip on a pipe.

    ``spawn`` rather than ``fork``: the child starts without the parent's threads and locks.
    """

    def __init__(self, factory: EnvironmentFactory) -> None:
        context = multiprocessing.get_context("spawn")
        self._connection, child_end = context.Pipe()
        self._process = context.Process(target=_serve, args=(child_end, factory), daemon=True)
        self._child_end = child_end

    def open(self) -> object:
        self._process.start()
        self._child_end.close()  # so the parent's recv sees EOF when the child dies
        return self.call("open", None)

    def call(self, method: str, argument: object) -> object:
        try:
            self._connection.send((method, argument))
            kind, value = self._connection.recv()
        except (EOFError, OSError) as exc:
            self._process.join(timeout=1.0)  # the pipe broke: the child is gone or going
            raise _Reported("crashed", f"environment process exited (code {self._process.exitcode})") from exc
        if kind != "ok":
            raise _Reported(kind, value)
        return value

    def abort(self) -> None:
        """Kill the child: a call blocked on its answer then sees EOF and frees its thread."""
        if self._process.pid is not None:
            self._process.kill()

    def close(self) -> None:
        if self._process.pid is not None:
            self._process.kill()
            self._process.join(timeout=5.0)
        self._connection.close()


class EnvironmentSession:
    """One environment driven from the event loop, for one or more episodes in turn.

    Obtained from :meth:`EnvironmentRunner.open`. ``turns`` counts the steps of the current
    episode; ``failure`` is set once the environment has failed (see the module invariants).
    """

    def __init__(self, runner: EnvironmentRunner, transport: _InThread | _InProcess) -> None:
        self._runner = runner
        self._transport = transport
        self.max_turns = 0
        self.turns = 0
        self.failure: EpisodeFailure | None = None
        self._in_episode = False
        self._cancelled = False

    async def reset(self, seed: int) -> str:
        """Start an episode; its first observation."""
        observation = await self._call("reset", seed)
        if not isinstance(observation, str):
            self._fail("malformed", "reset", f"observation is {type(observation).__name__}, not str")
        self.turns = 0
        self._in_episode = True
        return observation

    async def step(self, action_text: str) -> StepResult:
        """Apply one model turn; a result whose types and turn count keep the protocol."""
        if not self._in_episode:
            raise RuntimeError("step outside an episode: call reset first (an ended episode needs a new reset)")
        result = await self._call("step", action_text)
        self.turns += 1
        result = self._checked(result)
        if result.terminated or result.truncated:
            self._in_episode = False
        elif self.turns >= self.max_turns:
            self._fail("malformed", "step", f"episode went past its max_turns ({self.max_turns}) without ending")
        return result

    async def _open(self) -> None:
        max_turns = await self._call("open", None)
        if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
            self._fail("malformed", "open", f"max_turns is {max_turns!r}, not a positive int")
        self.max_turns = max_turns

    async def _call(self, call: str, argument: object) -> object:
        if self.failure is not None:
            raise self.failure
        if self._cancelled:
            raise RuntimeError("a call of this session was cancelled while running: the environment is not reusable")
        if call == "open":
            future = self._runner._submit(self._transport.open)
        else:
            future = self._runner._submit(self._transport.call, call, argument)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self._runner.timeout_s)
        except TimeoutError:
            self._transport.abort()
            self._runner._count_stuck(future)
            self._fail("timeout", call, f"no answer within {self._runner.timeout_s} s")
        except asyncio.CancelledError:
            # The call may still be running: never start another on the same environment.
            self._cancelled = True
            self._in_episode = False
            self._transport.abort()
            self._runner._count_stuck(future)
            raise
        except _Reported as exc:
            self._fail(exc.kind, call, str(exc))
        except Exception as exc:
            self._fail("raised", call, _describe(exc))

    def _checked(self, result: object) -> StepResult:
        if not isinstance(result, StepResult):
            self._fail("malformed", "step", f"returned {type(result).__name__}, not StepResult")
        problems = []
        if not isinstance(result.observation, str):
            problems.append(f"observation is {type(result.observation).__name__}, not str")
        reward = result.reward
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
            problems.append(f"reward is {reward!r}, not a finite number")
        if not isinstance(result.terminated, bool) or not isinstance(result.truncated, bool):
            problems.append(f"terminated/truncated are {result.terminated!r}/{result.truncated!r}, not bool")
        if not isinstance(result.info, dict):
            problems.append(f"info is {type(result.info).__name__}, not dict")
        if problems:
            self._fail("malformed", "step", "; ".join(problems))
        return result if type(reward) is float else dataclasses.replace(result, reward=float(reward))

    def _fail(self, kind: FailureKind, call: str, detail: str) -> NoReturn:
        self.failure = EpisodeFailure(kind, call, detail)
        self._in_episode = False
        raise self.failure

    async def _close(self) -> None:
        # Off the loop: killing and reaping a child process may take a moment.
        await asyncio.to_thread(self._transport.close)


class EnvironmentRunner:
    """Drives environments from asyncio, each call on a worker thread under ``timeout_s``.

    ``max_workers`` bounds the environment calls in flight; a call waiting for a free thread is
    still under its timeout, so when stuck threads fill the pool the episodes fail as timeouts,
    visibly, instead of waiting forever.
    """

    def __init__(self, timeout_s: float, isolation: Isolation = "thread", max_workers: int = 16) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if isolation not in ("thread", "process"):
            raise ValueError(f"isolation must be 'thread' or 'process', got {isolation!r}")
        self.timeout_s = timeout_s
        self.isolation: Isolation = isolation
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="environment")
        self._stuck = 0
        self._stuck_lock = threading.Lock()

    @property
    def stuck_calls(self) -> int:
        """Calls given up on (timed out or cancelled) that still hold a worker thread.

        Under process isolation they end as soon as the killed child's pipe closes; under
        thread isolation, only when the environment's call returns.
        """
        return self._stuck

    @asynccontextmanager
    async def open(self, factory: EnvironmentFactory) -> AsyncIterator[EnvironmentSession]:
        """A session on a fresh environment from ``factory``, closed on exit.

        Raises :class:`EpisodeFailure` (call ``"open"``) if the environment cannot be built.
        """
        transport = _InThread(factory) if self.isolation == "thread" else _InProcess(factory)
        session = EnvironmentSession(self, transport)
        try:
            await session._open()
            yield session
        finally:
            await session._close()

    def shutdown(self) -> None:
        """Stop taking calls; queued calls are cancelled, stuck threads are left to finish."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _submit(self, fn: Callable[..., object], *args: object) -> Future[object]:
        return self._pool.submit(fn, *args)

    def _count_stuck(self, future: Future[object]) -> None:
        with self._stuck_lock:
            self._stuck += 1
        future.add_done_callback(self._release_stuck)  # runs at once if the call already ended

    def _release_stuck(self, _: Future[object]) -> None:
        with self._stuck_lock:
            self._stuck -= 1
