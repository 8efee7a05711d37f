"""Exactly-once accounting of prompt groups.

Every prompt group that is admitted enters the ledger and leaves it exactly once: trained,
or dropped with a recorded reason. Leaving twice, or leaving without entering, raises
``LedgerError`` at once (a bug, never tolerated). ``balanced`` holds at every instant:
``admitted == trained + dropped + in_flight``.

A drop gives the group's admission slot back to the staleness gate, so its step is refilled
by a fresh prompt, and tells listeners (the rollout role discards half-assembled groups).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tandem.core.staleness import StalenessGate

__all__ = ["DropRecord", "Ledger", "LedgerError"]


class LedgerError(RuntimeError):
    """A prompt group was accounted for twice, or was never admitted."""


@dataclass(slots=True, frozen=True)
class DropRecord:
    prompt_id: int
    step: int
    stage: str
    reason: str


class Ledger:
    """Which prompt groups are in flight, and how every finished one ended."""

    def __init__(self, gate: StalenessGate) -> None:
        self._gate = gate
        self._in_flight: dict[int, int] = {}  # prompt_id -> step
        self.admitted = 0
        self.trained = 0
        self.drops: list[DropRecord] = []
        self._dropped_ids: set[int] = set()
        self._drop_listeners: list[Callable[[int], Awaitable[None] | None]] = []
        self.next_prompt_id = 0  # one past the highest prompt id ever admitted (the data position)

    def on_drop(self, listener: Callable[[int], Awaitable[None] | None]) -> None:
        """Call ``listener(prompt_id)`` whenever a group is dropped."""
        self._drop_listeners.append(listener)

    def admit(self, prompt_id: int, step: int) -> None:
        if prompt_id in self._in_flight:
            raise LedgerError(f"prompt {prompt_id} admitted twice")
        self._in_flight[prompt_id] = step
        self.admitted += 1
        self.next_prompt_id = max(self.next_prompt_id, prompt_id + 1)

    def restore(self, trained: int, drops: list[DropRecord], next_prompt_id: int) -> None:
        """Continue a resumed run's accounts: what it trained and dropped before. Its in-flight
        prompts are not restored as in flight: they are admitted again when generated again."""
        if self.admitted:
            raise LedgerError("restore() on a ledger that has already admitted prompts")
        self.trained = trained
        self.drops = list(drops)
        self._dropped_ids = {d.prompt_id for d in drops}
        self.admitted = trained + len(drops)
        self.next_prompt_id = next_prompt_id

    def in_flight_ids(self) -> list[int]:
        """Prompt ids admitted and neither trained nor dropped yet."""
        return list(self._in_flight)

    def is_live(self, prompt_id: int) -> bool:
        return prompt_id in self._in_flight

    def reassign(self, prompt_id: int, step: int) -> None:
        """A group in flight now belongs to ``step`` (withheld to a later step): a later drop
        gives back that step's slot. Still in flight once, so the accounts do not change."""
        if prompt_id not in self._in_flight:
            raise LedgerError(f"prompt {prompt_id} reassigned to step {step} but not in flight")
        self._in_flight[prompt_id] = step

    def mark_trained(self, prompt_id: int) -> None:
        if self._in_flight.pop(prompt_id, None) is None:
            if prompt_id in self._dropped_ids:
                raise LedgerError(f"prompt {prompt_id} reached training after it was dropped")
            raise LedgerError(f"prompt {prompt_id} trained but not in flight (trained twice or dropped?)")
        self.trained += 1

    async def drop(self, prompt_id: int, stage: str, reason: str) -> None:
        """Record a drop and give the slot back. Dropping an already-dropped group is a no-op,
        since several samples of one group can fail independently."""
        step = self._in_flight.pop(prompt_id, None)
        if step is None:
            if prompt_id in self._dropped_ids:
                return
            raise LedgerError(f"prompt {prompt_id} dropped by {stage} but not in flight")
        self.drops.append(DropRecord(prompt_id, step, stage, reason))
        self._dropped_ids.add(prompt_id)
        await self._gate.release(step)
        for listener in self._drop_listeners:
            result = listener(prompt_id)
            if result is not None:
                await result

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def balanced(self) -> bool:
        return self.admitted == self.trained + len(self.drops) + self.in_flight

    def drop_counts(self) -> dict[str, int]:
        """Drops per stage."""
        return dict(Counter(d.stage for d in self.drops))

    def summary(self) -> dict[str, object]:
        return {
            "admitted": self.admitted,
            "trained": self.trained,
            "dropped": len(self.drops),
            "dropped_by_stage": self.drop_counts(),
            "in_flight": self.in_flight,
            "balanced": self.balanced,
        }
