"""The seams between the flow and the compute: small protocols every engine backend implements.

The state machines only ever talk to these protocols, so the same flow drives the fake
engines (tests, simulator), the embedded transformers/torch engines, and the large-scale
backends. Engines own their blocking compute: every ``async`` method here must return to the
event loop while the work runs (a thread, a process or a remote actor), never block it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from core.records import RolloutGroup, Sample


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How to sample one sequence. ``top_k = 0`` and ``top_p = 1.0`` disable those filters."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()


@dataclass(slots=True, frozen=True)
class GenerationRequest:
    """One sequence to sample: sample ``index`` of prompt group ``prompt_id``."""

    prompt_id: int
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int = 0


@runtime_checkable
class RolloutEngine(Protocol):
    """Samples sequences with the weights it has loaded.

    Invariant: every token of a returned :class:`Sample` is stamped with the weight version
    that produced it, and ``version`` only moves forward.
    """

    @property
    def version(self) -> int:
        """The policy version currently loaded (serving new tokens)."""
        ...

    def generate(self, requests: Sequence[GenerationRequest]) -> AsyncIterator[Sample]:
        """Start sampling every request now; yield each sequence as soon as it finishes."""
        ...


@runtime_checkable
class LogProbEngine(Protocol):
    """Scores given token sequences with the weights it holds (policy or reference)."""

    @property
    def version(self) -> int: ...

    async def logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Per-token log-probs of each sample's response tokens, aligned with ``response_ids``."""
        ...


@runtime_checkable
class TrainEngine(LogProbEngine, Protocol):
    """Holds the trained policy; one ``train_step`` is one optimizer step (version + 1)."""

    async def train_step(self, groups: Sequence[RolloutGroup]) -> dict[str, float]:
        """Run one optimizer step on these groups and return its metrics."""
        ...

    async def save_state(self, folder: Path) -> None:
        """Write everything a resume needs (weights, optimizer, schedule, version, RNG) as files
        into the existing ``folder``, after queued work; the checkpoint manifests them."""
        ...

    async def load_state(self, folder: Path) -> None:
        """Restore what ``save_state`` wrote into ``folder``; ``version`` is then the saved one."""
        ...


@dataclass(slots=True, frozen=True)
class SyncReport:
    """What a weight sync did: the version now serving, and its timing/byte metrics."""

    version: int
    metrics: dict[str, float]


@runtime_checkable
class WeightSync(Protocol):
    """Moves the trainer's weights into the rollout engines."""

    async def sync(self, version: int) -> SyncReport:
        """Make at least ``version`` the one the rollout engines serve.

        The trainer may have moved on while the sync waited its turn: loading a newer version
        than asked is allowed (fresher is never staler) and the report says which. On failure
        the rollout engines keep serving their old weights and this raises.
        """
        ...


@dataclass(slots=True, frozen=True)
class RewardResult:
    """A sample's score; ``ok`` False means the verifier failed and ``info`` says why."""

    reward: float
    ok: bool = True
    info: str = ""


@runtime_checkable
class Reward(Protocol):
    """Scores finished samples; must never block the event loop."""

    async def score(self, samples: Sequence[Sample], answers: Sequence[str | None]) -> list[RewardResult]:
        ...
