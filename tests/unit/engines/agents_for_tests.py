"""Agents importable by path for the agent tests (``engines.servers.agent`` names a ``module:name``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tandem.core.protocols import Agent, AgentRun, AgentSession


async def one_completion(run: AgentRun) -> None:
    """A per-episode agent; the stand-in engines answer for it, so it does nothing itself."""


@dataclass
class SessionLog:
    """What a recording session saw: the tasks it was entered and exited in, and its episodes."""

    entered_in: list[asyncio.Task[object] | None] = field(default_factory=list)
    exited_in: list[asyncio.Task[object] | None] = field(default_factory=list)
    episodes: list[str] = field(default_factory=list)


def recording_session(log: SessionLog, *, hang_on_exit: bool = False) -> AgentSession:
    """A session that logs its entry, exit and episodes (``hang_on_exit``: its exit never ends)."""

    @contextlib.asynccontextmanager
    async def session() -> AsyncIterator[Agent]:
        log.entered_in.append(asyncio.current_task())

        async def agent(run: AgentRun) -> None:
            log.episodes.append(run.conversation_id)

        try:
            yield agent
        finally:
            log.exited_in.append(asyncio.current_task())
            if hang_on_exit:
                await asyncio.Event().wait()

    return session


@contextlib.asynccontextmanager
async def failing_session() -> AsyncIterator[Agent]:
    """A session whose setup fails (a sandbox pool that cannot start)."""
    raise ConnectionError("sandbox pool unreachable")
    yield one_completion  # unreachable: makes this an async generator, as every session is


@contextlib.asynccontextmanager
async def yields_no_agent() -> AsyncIterator[Agent]:
    yield "not an agent"  # type: ignore[misc]


COUNTED = SessionLog()


@contextlib.asynccontextmanager
async def counted_solver() -> AsyncIterator[Agent]:
    """The shipped arithmetic agent's session, logged in :data:`COUNTED` (needs ``openai``)."""
    from tandem.tasks.arithmetic.openai_agent import solver

    COUNTED.entered_in.append(asyncio.current_task())
    try:
        async with solver() as solve:
            yield solve
    finally:
        COUNTED.exited_in.append(asyncio.current_task())
