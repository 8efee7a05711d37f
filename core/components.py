"""The compute a flow drives: engines, reward, weight sync and the prompt source, as one bundle.

The flow and its state machines see only these protocol-typed handles, so the in-process
fakes, the embedded torch engines and remote (Ray) engines are interchangeable.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from core.protocols import LogProbEngine, Reward, RolloutEngine, SamplingParams, TrainEngine, WeightSync

__all__ = ["Components", "PromptSource", "SourcePrompt"]


@dataclass(slots=True, frozen=True)
class SourcePrompt:
    """One prompt as a data source yields it, before it gets an id and a group."""

    prompt: str
    prompt_ids: list[int]
    answer: str | None = None


class PromptSource(Protocol):
    """Yields prompts in a deterministic order for a given seed; may be endless."""

    def __call__(self, seed: int) -> Iterator[SourcePrompt]: ...


@dataclass(slots=True)
class Components:
    """Everything the roles compute with. ``reference`` is None when no role needs it."""

    prompts: PromptSource
    rollout: RolloutEngine
    trainer: TrainEngine
    reward: Reward
    weight_sync: WeightSync
    sampling: SamplingParams
    reference: LogProbEngine | None = None
    close_callbacks: list[Callable[[], None]] = field(default_factory=list)
    save_checkpoint: Callable[[Path], Awaitable[None]] | None = None  # final weights, loadable by from_pretrained
    max_prompt_tokens: int | None = None  # longer prompts are dropped at admission (recorded); None: no limit
    held_out: Callable[[int], list[SourcePrompt]] | None = None  # held_out(n): the same n evaluation prompts each call

    def close(self) -> None:
        """Release engine threads and resources; safe to call once the flow has stopped."""
        for close in self.close_callbacks:
            close()
