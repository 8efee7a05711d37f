"""The version clock and the admission gate that bound off-policy lag.

Versions: the trainer's version ``v`` counts optimizer steps (0 before the first); the rollout
engines serve a loaded version ``w <= v``, raised by parameter sync.

Admission (AReaL-style, at generation start): a prompt group is assigned a training step
``s`` when it is admitted, and may be admitted only while

    s <= w + k        (k = max_staleness; w = the version generation will start with)

and while fewer than ``max_concurrent`` groups are in flight. Train step ``t`` consumes exactly
the groups assigned to step ``t``. Hence the invariant every test checks: a sample trained
in step ``t`` was started at a version ``>= t - k``.

The rule is written against the *loaded* version ``w`` rather than the trained version ``v``:
the version a sample starts with is the one the rollout engine serves, and gating on ``v``
would let a lagging sync break the bound. With ``k = 0``, step ``t`` is admitted only once
version ``t`` is loaded, which is exactly the synchronous schedule.

A dropped group gives its slot back, so its step is refilled by a fresh prompt and the step
still trains a full batch; no step is ever assigned more than ``prompts_per_step`` live groups.

Staleness at consumption (``staleness.max_consumption_staleness`` / ``max_version_span``, the
tighter of which is the *refill bound* ``b``): a slot given back is refilled only by an admission
made while ``s <= w + min(k, b)``, and a stale group the train role sends back for regeneration
(:meth:`StalenessGate.regenerate`, same prompt, same step, slot kept) is handed to generation
only under that bound too. Every token of such a group is then sampled at a version in
``[s - b, s]`` (the trainer cannot pass step ``s`` before the group is trained), so its
staleness and its version span are at most ``b``: it is never stale itself, and each stale
group costs at most one refill. A group withheld to the next step moves its slot there
(:meth:`StalenessGate.move`) and gives its old one back.

The bound *in force* may drop below the configured ``k`` while weight syncs fail and come back
when they succeed again: the gate owns this degradation. The param_update role reports each
sync's outcome (:meth:`StalenessGate.sync_failed`, :meth:`StalenessGate.sync_succeeded`);
after ``degrade_after`` failures in a row the bound in force becomes 0 (synchronous admission
against the weights actually serving), after ``recover_after`` successes in a row it is ``k``
again. Each admission records the bound in force when it was granted, and a group is checked
against that bound: since its samples start at versions ``>= w``, ``s - start <= s - w <=
k_admitted``. Lowering the bound never invalidates a group already admitted under the higher one.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from tandem.core.records import PromptGroup

__all__ = ["Admission", "StalenessGate", "StalenessViolation", "SyncHealth", "VersionClock"]


class StalenessViolation(RuntimeError):
    """A group reached training older than the staleness bound allows (a bug, never tolerated)."""


class VersionClock:
    """Trained and loaded policy versions, with event-driven waits on their changes.

    Invariants: both only move forward; ``loaded <= trained``.
    """

    def __init__(self, trained: int = 0, loaded: int = 0) -> None:
        if not 0 <= loaded <= trained:
            raise ValueError(f"need 0 <= loaded <= trained, got loaded={loaded} trained={trained}")
        self.trained = trained
        self.loaded = loaded
        self.changed = asyncio.Condition()

    async def advance_trained(self, version: int) -> None:
        if version <= self.trained:
            raise ValueError(f"trained version must move forward: {self.trained} -> {version}")
        async with self.changed:
            self.trained = version
            self.changed.notify_all()

    async def set_loaded(self, version: int) -> None:
        if version < self.loaded or version > self.trained:
            raise ValueError(
                f"loaded version must satisfy {self.loaded} <= new <= trained={self.trained}, got {version}"
            )
        async with self.changed:
            self.loaded = version
            self.changed.notify_all()

    async def wait_trained_beyond(self, version: int) -> int:
        """Wait until the trained version exceeds ``version``; return it."""
        return await self.wait_trained_at_least(version + 1)

    async def wait_trained_at_least(self, version: int) -> int:
        """Wait until the trained version is at least ``version``; return it."""
        async with self.changed:
            await self.changed.wait_for(lambda: self.trained >= version)
            return self.trained

    @property
    def lag(self) -> int:
        """Param-update lag: trained minus loaded."""
        return self.trained - self.loaded


@dataclass(slots=True, frozen=True)
class Admission:
    """A granted slot: train step ``step``, admitted while version ``version`` was loaded and
    the bound in force was ``k``."""

    step: int
    version: int
    k: int


@dataclass(slots=True)
class SyncHealth:
    """The weight syncs' record as the gate keeps it (and a checkpoint saves it)."""

    failures: int = 0  # failed syncs over the run (each after its retries)
    failures_in_a_row: int = 0
    successes_in_a_row: int = 0
    degraded: bool = False  # the bound in force is 0 because syncs keep failing
    degradations: int = 0  # times admission went synchronous


class StalenessGate:
    """Grants admission slots under the staleness rule and the concurrency cap, and owns the bound
    in force: the configured ``k``, or 0 while weight syncs keep failing.

    Owned by the flow; the generate role asks for slots, the train role completes them, any
    role that drops a group releases its slot, and the param_update role reports each sync.
    ``degrade_after`` None never degrades. ``refill_bound`` (the consumption bound, see the module
    docstring) None refills slots under the bound in force, and allows no regeneration.
    """

    def __init__(
        self,
        clock: VersionClock,
        max_staleness: int,
        prompts_per_step: int,
        max_steps: int,
        max_concurrent: int,
        *,
        degrade_after: int | None = None,
        recover_after: int = 1,
        refill_bound: int | None = None,
    ) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if prompts_per_step < 1 or max_steps < 1 or max_concurrent < 1:
            raise ValueError("prompts_per_step, max_steps and max_concurrent must be >= 1")
        if (degrade_after is not None and degrade_after < 1) or recover_after < 1:
            raise ValueError("degrade_after and recover_after must be >= 1")
        if refill_bound is not None and refill_bound < 0:
            raise ValueError(f"refill_bound must be >= 0, got {refill_bound}")
        self.clock = clock
        self.configured_k = max_staleness
        self.k = max_staleness  # the bound in force
        self.degrade_after = degrade_after
        self.recover_after = recover_after
        self.syncs = SyncHealth()
        self.prompts_per_step = prompts_per_step
        self.max_steps = max_steps
        self.max_concurrent = max_concurrent
        self._live: dict[int, int] = {}  # step -> groups admitted and not dropped
        # Lowest step that may still have a free slot; steps below the trained version are done
        # (a resumed run's clock starts at its checkpoint's version, so its admissions do too).
        self._frontier = clock.trained
        self.in_flight = 0  # admitted, neither trained nor dropped
        self.refill_bound = refill_bound  # None: a slot given back is refilled like any other
        self._refills: dict[int, int] = {}  # step -> slots given back, not refilled yet (refill_bound only)
        self._regenerations: deque[PromptGroup] = deque()  # stale groups to generate again, slots kept

    def _bound_for(self, step: int) -> int:
        """The bound an admission for ``step`` is made under: the refill bound while it has slots
        given back, else the bound in force."""
        if self.refill_bound is not None and self._refills.get(step, 0) > 0:
            return min(self.k, self.refill_bound)
        return self.k

    def _open_step(self) -> int | None:
        while self._live.get(self._frontier, 0) >= self.prompts_per_step:
            self._frontier += 1
        s = self._frontier
        if s >= self.max_steps or s > self.clock.loaded + self._bound_for(s) or self.in_flight >= self.max_concurrent:
            return None
        return s

    async def admit(self) -> Admission:
        """Wait for a free slot; take it. Wakes on version changes, completions and drops."""
        cond = self.clock.changed
        async with cond:
            await cond.wait_for(lambda: self._open_step() is not None)
            admission = self.try_admit()
            assert admission is not None  # wait_for just saw a slot open, under the same lock
            return admission

    def try_admit(self) -> Admission | None:
        """Take a free slot if there is one now, without waiting."""
        step = self._open_step()
        if step is None:
            return None
        bound = self._bound_for(step)
        if self._refills.get(step, 0) > 0:
            self._refills[step] -= 1
        self._live[step] = self._live.get(step, 0) + 1
        self.in_flight += 1
        return Admission(step=step, version=self.clock.loaded, k=bound)

    async def regenerate(self, group: PromptGroup) -> None:
        """Queue a stale group to be generated again for its step; it keeps its slot (and its
        ledger entry). :meth:`next_regeneration` hands it out under the refill bound."""
        if self.refill_bound is None:
            raise ValueError("regeneration needs a refill bound (staleness.max_consumption_staleness or max_version_span)")
        async with self.clock.changed:
            self._regenerations.append(group)
            self.clock.changed.notify_all()

    def _ready_regeneration(self) -> PromptGroup | None:
        assert self.refill_bound is not None  # only regenerate() queues, and it checks
        bound = min(self.k, self.refill_bound)
        return next((g for g in self._regenerations if g.step <= self.clock.loaded + bound), None)

    async def next_regeneration(self) -> PromptGroup:
        """Wait for a queued group whose step the rollout's loaded version is close enough to (the
        refill bound); return it re-admitted: its admitted version and bound are this admission's."""
        cond = self.clock.changed
        async with cond:
            await cond.wait_for(lambda: self._ready_regeneration() is not None)
            group = self._ready_regeneration()
            assert group is not None and self.refill_bound is not None
            self._regenerations.remove(group)
            group.admitted_version, group.admitted_k = self.clock.loaded, min(self.k, self.refill_bound)
            return group

    async def move(self, from_step: int, to_step: int) -> bool:
        """Move one live group's slot from ``from_step`` to ``to_step`` (a withheld group), if
        ``to_step`` has a free slot; the slot left behind is given back (refilled under the
        refill bound). False, and nothing changes, when ``to_step`` is full or past the run."""
        async with self.clock.changed:
            if to_step >= self.max_steps or self._live.get(to_step, 0) >= self.prompts_per_step:
                return False
            self._live[to_step] = self._live.get(to_step, 0) + 1
            self._give_back(from_step)
            self.clock.changed.notify_all()
            return True

    def _give_back(self, step: int) -> None:
        self._live[step] -= 1
        if self.refill_bound is not None:
            self._refills[step] = self._refills.get(step, 0) + 1
        if step < self._frontier:
            self._frontier = step

    @property
    def degraded(self) -> bool:
        return self.syncs.degraded

    async def sync_failed(self) -> bool:
        """Record a failed sync; True if this failure put the synchronous bound in force."""
        health = self.syncs
        health.failures += 1
        health.failures_in_a_row += 1
        health.successes_in_a_row = 0
        if self.degrade_after is None or health.degraded or health.failures_in_a_row < self.degrade_after:
            return False
        await self._degrade(True)
        return True

    async def sync_succeeded(self) -> bool:
        """Record a successful sync; True if this success restored the configured bound."""
        health = self.syncs
        health.failures_in_a_row = 0
        health.successes_in_a_row += 1
        if not health.degraded or health.successes_in_a_row < self.recover_after:
            return False
        await self._degrade(False)
        return True

    async def restore(self, health: SyncHealth) -> None:
        """Continue a resumed run's sync record, degraded or not, as its checkpoint saved it."""
        self.syncs = SyncHealth(**{f: getattr(health, f) for f in SyncHealth.__dataclass_fields__})
        async with self.clock.changed:
            self.k = 0 if health.degraded else self.configured_k
            self.clock.changed.notify_all()

    async def _degrade(self, degraded: bool) -> None:
        """Put the synchronous bound (or the configured one) in force for admissions from now on
        (groups already admitted keep the bound they were admitted under); raising it may open
        slots, so waiters are woken."""
        self.syncs.degraded = degraded
        self.syncs.degradations += degraded
        async with self.clock.changed:
            self.k = 0 if degraded else self.configured_k
            self.clock.changed.notify_all()

    async def release(self, step: int) -> None:
        """A group of ``step`` was dropped: its slot opens again for a fresh prompt."""
        async with self.clock.changed:
            self._give_back(step)
            self.in_flight -= 1
            self.clock.changed.notify_all()

    async def complete(self, step: int, groups: int) -> None:
        """Step ``step`` trained ``groups`` groups: they leave flight, their slots stay used."""
        async with self.clock.changed:
            self.in_flight -= groups
            self._live.pop(step, None)  # a trained step can never be released again
            self._refills.pop(step, None)
            self.clock.changed.notify_all()

    @staticmethod
    def check(trained_step: int, oldest_version: int, prompt_id: int, k: int) -> int:
        """Return the staleness of a group trained at ``trained_step``; raise if over ``k``, the
        bound in force when the group was admitted."""
        staleness = trained_step - oldest_version
        if staleness > k:
            raise StalenessViolation(
                f"prompt {prompt_id} trained at step {trained_step} was started at version "
                f"{oldest_version}: staleness {staleness} > the bound {k} it was admitted under"
            )
        return staleness
