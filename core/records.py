"""Typed records that flow through the channels between roles.

The unit of admission, accounting and training is the :class:`PromptGroup` (one prompt sampled
``n`` times, as GRPO needs whole groups). A group is assigned a training step at admission;
its samples carry the policy version that started them and the version of every token, so
staleness is explicit all the way to the loss.

Invariants kept by the producers of these records:
- ``len(Sample.response_ids) == len(Sample.behaviour_logprobs) == len(Sample.token_versions)``;
- ``Sample.start_version == Sample.token_versions[0]`` when there is at least one token;
- token versions never decrease along a sequence (weights only move forward);
- a :class:`RolloutGroup` holds exactly ``group.n`` samples, indexed ``0..n-1``.

These are plain slotted dataclasses (hot path, no validation cost); config and API
boundaries use pydantic instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class FinishReason(str, Enum):
    """Why a sequence stopped growing."""

    STOP = "stop"  # end-of-sequence token or a stop string
    LENGTH = "length"  # hit max_new_tokens


class ResumePolicy(str, Enum):
    """What an in-flight sequence did when the weights changed under it (partial rollouts)."""

    RECOMPUTE = "recompute"  # prefix re-encoded under the new weights, then decoding continued
    KEEP_CACHE = "keep_cache"  # decoding continued on the KV cache built by the old weights


@dataclass(slots=True)
class PromptGroup:
    """A prompt to be sampled ``n`` times; admitted, trained and accounted for as one unit.

    ``step`` is the training step the group is assigned to at admission (-1 before),
    ``admitted_version`` the rollout policy version that was loaded when it was admitted, and
    ``admitted_k`` the staleness bound in force then (its trained staleness may not exceed it).
    """

    prompt_id: int
    prompt: str
    prompt_ids: list[int]
    n: int
    answer: str | None = None
    step: int = -1
    admitted_version: int = -1
    admitted_k: int = -1


@dataclass(slots=True)
class Sample:
    """One sampled completion of a prompt, token-aligned with everything the losses need."""

    prompt_id: int
    index: int
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]
    token_versions: list[int]
    start_version: int
    finish_reason: FinishReason
    response_text: str = ""
    resumed: ResumePolicy | None = None  # set when the weights changed during generation
    prox_logprobs: list[float] | None = None  # recomputed by the logp role
    prox_version: int = -1  # trainer version the proximal log-probs were computed with
    ref_logprobs: list[float] | None = None  # from the reference model (ref_logp role)
    reward: float | None = None
    reward_info: str = ""  # verifier detail, or the reason a reward failed
    advantage: float | None = None  # filled by the train role from the group's rewards

    @property
    def num_tokens(self) -> int:
        return len(self.response_ids)


@dataclass(slots=True)
class RolloutGroup:
    """All ``n`` samples of one prompt group, assembled by the rollout role."""

    group: PromptGroup
    samples: list[Sample]

    @property
    def step(self) -> int:
        return self.group.step

    @property
    def prompt_id(self) -> int:
        return self.group.prompt_id

    @property
    def oldest_version(self) -> int:
        """The oldest version any token of the group was sampled with (its staleness)."""
        return min(s.start_version for s in self.samples)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)
