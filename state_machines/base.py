"""The state machine every role runs: explicit states, a produce/consume loop, an error policy.

States and the transitions allowed between them::

    IDLE ──▶ WAITING_INPUT ◀──▶ RUNNING ──▶ WAITING_OUTPUT ──▶ WAITING_INPUT ...
                   │    ▲           ▲
                   ▼    │           │            any live state ──▶ STOPPED | FAILED (terminal)
                   PAUSED ──────────┘            (PAUSED = held by the staleness gate or a device lock)

Every transition is counted and timed (``state_seconds``) for the metrics, and each state
interval becomes a span on the role's track in the trace. A unit of work runs under the role's
error policy: retries with exponential backoff (tenacity), then either ``fail`` — the flow stops
and the error names the stage and the prompts — or ``drop`` — the prompts are recorded as
dropped with the error as reason and their admission slots are refilled.

Subclass :class:`Stage` and override :meth:`Stage.process` to add a stage; override
:meth:`StateMachine.main` for roles whose loop is not consume → process → produce.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import structlog
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

from tandem.core.channel import EndOfStream, ReceiveChannel, SendChannel
from tandem.core.config import RoleConfig, TandemConfig
from tandem.core.history import RunHistory
from tandem.core.ledger import Ledger, LedgerError
from tandem.core.protocols import PartialTrainStep
from tandem.core.records import PromptGroup, Trajectory, TrajectoryGroup
from tandem.core.staleness import StalenessGate, StalenessViolation, VersionClock
from tandem.core.trace import TraceRecorder

if TYPE_CHECKING:
    from tandem.core.checkpoint import Checkpointer, FlowState
    from tandem.core.components import Components

__all__ = ["FlowServices", "Stage", "StageError", "State", "StateMachine"]

In = TypeVar("In")
Out = TypeVar("Out")
R = TypeVar("R")


class State(str, Enum):
    IDLE = "idle"
    WAITING_INPUT = "waiting_input"
    RUNNING = "running"
    WAITING_OUTPUT = "waiting_output"
    PAUSED = "paused"
    STOPPED = "stopped"
    FAILED = "failed"


_LIVE = {State.WAITING_INPUT, State.RUNNING, State.WAITING_OUTPUT, State.PAUSED}
_ALLOWED: dict[State, frozenset[State]] = {
    State.IDLE: frozenset(_LIVE | {State.STOPPED, State.FAILED}),
    **{s: frozenset((_LIVE - {s}) | {State.STOPPED, State.FAILED}) for s in _LIVE},
    State.STOPPED: frozenset(),
    State.FAILED: frozenset(),
}

# Bugs in the flow itself are never retried or dropped: they stop the run. Nor is a train step
# that failed part-way: its weights are no version's, and neither a retry nor a drop repairs that.
_INVARIANT_ERRORS = (StalenessViolation, LedgerError, PartialTrainStep)


class StageError(RuntimeError):
    """A stage failed on a unit of work; names the stage and the prompt groups it held."""

    def __init__(self, stage: str, prompt_ids: Sequence[int], cause: BaseException) -> None:
        ids = list(prompt_ids)
        shown = ids if len(ids) <= 8 else [*ids[:8], "..."]
        super().__init__(f"stage {stage!r} failed on prompt(s) {shown}: {type(cause).__name__}: {cause}")
        self.stage = stage
        self.prompt_ids = ids
        self.cause = cause


@dataclass(slots=True)
class FlowServices:
    """What the flow owns and shares with every stage."""

    config: TandemConfig
    clock: VersionClock
    gate: StalenessGate
    ledger: Ledger
    components: Components
    trace: TraceRecorder
    history: RunHistory
    checkpoints: Checkpointer | None = None  # None: this run writes no resumable checkpoints
    resumed: FlowState | None = None  # the checkpoint this run continues, if any
    # Set by the flow when it is cancelled from outside (Ctrl-C), not by a failed stage: a role
    # that has begun a unit of work it must not abandon (a train step) finishes it first.
    stopping_cleanly: bool = False


def prompt_ids_of(items: Sequence[Any]) -> list[int]:
    """Prompt ids of a unit of work's items (groups, trajectories or prompts)."""
    return [item.prompt_id for item in items if isinstance(item, (PromptGroup, Trajectory, TrajectoryGroup))]


class StateMachine:
    """One role: its state, its loop, its error policy. ``run()`` is the task the flow owns."""

    role: ClassVar[str] = ""

    def __init__(
        self,
        name: str,
        services: FlowServices,
        inbox: ReceiveChannel[Any] | None = None,
        outbox: SendChannel[Any] | None = None,
        lock: asyncio.Lock | None = None,
    ) -> None:
        self.name = name
        self.services = services
        self.config: TandemConfig = services.config
        self.role_config: RoleConfig = services.config.role(name)
        self.micro_batch_size = services.config.micro_batch(name)
        self.inbox = inbox
        self.outbox = outbox
        self.lock = lock
        self.log = structlog.get_logger("tandem").bind(stage=name)
        self.state = State.IDLE
        self._since = asyncio.get_running_loop().time()
        self.state_seconds: Counter[State] = Counter()
        self.transitions: Counter[tuple[State, State]] = Counter()
        self.items_done = 0  # items that left this stage's units of work successfully
        self.version = 0  # the policy version this role last worked with

    # ------------------------------------------------------------------ states
    def set_state(self, new: State) -> None:
        """Move to ``new`` (a no-op if already there); account and trace the interval left."""
        old = self.state
        if new is old:
            return
        if new not in _ALLOWED[old]:
            raise RuntimeError(f"stage {self.name!r}: illegal transition {old.value} -> {new.value}")
        now = asyncio.get_running_loop().time()
        self.state_seconds[old] += now - self._since
        self.services.trace.span(self.name, old.value, self._since, now)
        self.transitions[(old, new)] += 1
        self.state = new
        self._since = now

    async def run(self) -> None:
        """The task body: ``main()`` framed by terminal states. Never swallows an error."""
        try:
            await self.main()
        except asyncio.CancelledError:
            self.set_state(State.STOPPED)
            raise
        except Exception as exc:
            self.set_state(State.FAILED)
            if self.outbox is not None:
                # Broken, not closed: downstream must not mistake a failure for a clean end.
                self.outbox.abort(exc)
            if isinstance(exc, StageError):
                raise
            raise StageError(self.name, [], exc) from exc
        self.set_state(State.STOPPED)

    async def main(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ work
    async def work(self, items: Sequence[Any], fn: Callable[[], Awaitable[R]]) -> R | None:
        """Run one unit of work under the lock and the error policy.

        Returns ``fn()``'s result, or ``None`` when the policy dropped the unit (its prompts
        are then recorded as dropped). Raises :class:`StageError` when the policy says fail.
        """
        policy = self.role_config
        try:
            if self.lock is not None:
                self.set_state(State.PAUSED)
                async with self.lock:
                    self.set_state(State.RUNNING)
                    return await self._attempts(policy, fn)
            self.set_state(State.RUNNING)
            return await self._attempts(policy, fn)
        except _INVARIANT_ERRORS:
            raise
        except Exception as exc:
            if policy.on_error == "drop":
                await self.drop(items, f"{type(exc).__name__}: {exc}")
                return None
            raise StageError(self.name, prompt_ids_of(items), exc) from exc

    async def _attempts(self, policy: RoleConfig, fn: Callable[[], Awaitable[R]]) -> R:
        if policy.max_retries == 0:
            return await fn()
        retrying = AsyncRetrying(
            stop=stop_after_attempt(policy.max_retries + 1),
            wait=wait_exponential(multiplier=policy.retry_backoff_s, min=policy.retry_backoff_s),
            retry=retry_if_exception(lambda e: isinstance(e, Exception) and not isinstance(e, _INVARIANT_ERRORS)),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                result = await fn()
        return result

    async def drop(self, items: Sequence[Any], reason: str) -> None:
        """Record these items' prompt groups as dropped by this stage, with ``reason``."""
        for prompt_id in dict.fromkeys(prompt_ids_of(items)):
            await self.services.ledger.drop(prompt_id, self.name, reason)
        self.log.warning("dropped", prompts=len(items), reason=reason)

    # ------------------------------------------------------------------ channels
    async def receive(self, waiting: State | None = State.WAITING_INPUT) -> list[Any] | None:
        """Wait for the next micro-batch; ``None`` at end of stream. The role shows ``waiting``
        meanwhile (``None``: its state stays as it is, e.g. RUNNING while it has work in flight)."""
        assert self.inbox is not None, f"stage {self.name!r} has no input channel"
        if waiting is not None:
            self.set_state(waiting)
        try:
            return await self.inbox.receive_batch(self.micro_batch_size, self.config.flow.batch_linger_s)
        except EndOfStream:
            return None

    async def emit(self, items: Sequence[Any]) -> None:
        if self.outbox is None or not items:
            return
        self.set_state(State.WAITING_OUTPUT)
        await self.outbox.send_many(items)


class Stage(StateMachine, Generic[In, Out]):
    """A consume → process → produce stage; subclasses implement :meth:`process`.

    Closes its output when its input ends, so end-of-stream flows down the chain.
    """

    async def process(self, items: list[In]) -> list[Out]:
        """Turn one micro-batch into outputs (any number, e.g. a filter returns fewer)."""
        raise NotImplementedError

    async def main(self) -> None:
        while (items := await self.receive()) is not None:
            outputs = await self.work(items, lambda: self.process(items))
            if outputs is None:
                continue
            self.items_done += len(outputs)
            await self.emit(outputs)
        if self.outbox is not None:
            self.outbox.close()
