"""Typed records that flow through the channels between roles, the same for every workload.

The unit of admission, accounting and training is the :class:`PromptGroup` (one task item
sampled ``n`` times, as GRPO needs whole groups). A group is assigned a training step at
admission; its :class:`Trajectory` records carry the policy version of every action, so
staleness is explicit all the way to the loss, whatever the workload:

- single-turn text: an action is a response token;
- a multi-turn episode: an action is a token after the first prompt, the model's own tokens
  trained and the environment's masked out (``loss_mask``);
- an image generator: an action is a denoising step.

What a workload's engines alone understand (token ids, latents and timesteps, turns) lives in
``Trajectory.payload``; the flow, staleness gate, ledger, param sync and checkpoints read only
the generic fields. :class:`TokenPayload` is the payload of the token workloads (text and
episodes) and lives here because several engines and workflows share it.

Invariants kept by the producers of these records:
- ``len(behaviour_logprobs) == len(versions)`` (= ``num_actions``), and every other per-action
  list (``loss_mask``, the proximal, reference and teacher log-probs...), when set, has that
  length too;
- ``start_version == versions[0]`` when there is at least one action;
- versions never decrease along a trajectory (weights only move forward);
- a :class:`TrajectoryGroup` holds exactly ``group.n`` trajectories, indexed ``0..n-1``.

These are plain slotted dataclasses (hot path, no validation cost); config and API
boundaries use pydantic instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = [
    "FinishReason",
    "PromptGroup",
    "ResumePolicy",
    "TaskItem",
    "TokenPayload",
    "Trajectory",
    "TrajectoryGroup",
    "token_trajectory",
]


class FinishReason(str, Enum):
    """Why a trajectory stopped growing."""

    STOP = "stop"  # end-of-sequence token, a stop string, or the environment ended the episode
    LENGTH = "length"  # hit the action budget (max_new_tokens, denoising steps)
    TRUNCATED = "truncated"  # an episode cut short by its turn limit or the context budget


class ResumePolicy(str, Enum):
    """What an in-flight trajectory did when the weights changed under it (partial rollouts)."""

    RECOMPUTE = "recompute"  # prefix re-encoded under the new weights, then decoding continued
    KEEP_CACHE = "keep_cache"  # decoding continued on the KV cache built by the old weights


@dataclass(slots=True, frozen=True)
class TaskItem:
    """One item as a task's source yields it, before it gets an id and a group.

    ``prompt`` is its human-readable form (for logs and text rewards), ``answer`` what a
    verifier checks against, ``meta`` anything else the task's workflow or rewards need (an
    environment seed, a class label). ``messages``, when set, is the prompt as a chat
    (``{"role", "content"}`` dicts): token workloads render it through the model's chat
    template, and ``prompt`` is then its last message's content. Token workloads fill
    ``prompt_ids`` when they load it.
    """

    prompt: str
    prompt_ids: list[int] = field(default_factory=list)
    answer: str | None = None
    meta: Mapping[str, Any] | None = None
    messages: tuple[Mapping[str, Any], ...] | None = None


@dataclass(slots=True)
class PromptGroup:
    """A task item to be sampled ``n`` times; admitted, trained and accounted for as one unit.

    ``step`` is the training step the group is assigned to at admission (-1 before),
    ``admitted_version`` the rollout policy version that was loaded when it was admitted, and
    ``admitted_k`` the staleness bound in force then (its trained staleness may not exceed it).
    A regeneration (``staleness.on_stale: recompute``) re-admits the group for the same step:
    these then describe the regeneration's admission.
    """

    prompt_id: int
    item: TaskItem
    n: int
    step: int = -1
    admitted_version: int = -1
    admitted_k: int = -1
    # Event-loop time its trajectories were last requested from the rollout workflow (admission,
    # or a regeneration): where a trajectory's time in flight starts. None before.
    requested_s: float | None = None

    @property
    def prompt(self) -> str:
        return self.item.prompt

    @property
    def prompt_ids(self) -> list[int]:
        return self.item.prompt_ids

    @property
    def answer(self) -> str | None:
        return self.item.answer


@dataclass(slots=True)
class TokenPayload:
    """The payload of a token trajectory: the context the first action saw and every token after it.

    ``response_ids[i]`` is action ``i``; in an episode the environment's tokens are among them
    (masked out of the loss by the trajectory's ``loss_mask``). ``text`` is the decoded
    response, what text rewards read.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    text: str = ""


@dataclass(slots=True)
class Trajectory:
    """One sampled trajectory of a prompt group, action-aligned with everything the losses need."""

    prompt_id: int
    index: int
    behaviour_logprobs: list[float]  # one per action: the rollout engine's log-prob when it acted
    versions: list[int]  # one per action: the policy version that produced it
    start_version: int
    finish_reason: FinishReason
    payload: Any  # what the workload's engines read (TokenPayload for text and episodes)
    loss_mask: list[int] | None = None  # 1: trained, 0: not (environment tokens); None: all trained
    resumed: ResumePolicy | None = None  # set when the weights changed during generation
    prox_logprobs: list[float] | None = None  # recomputed by the trainer (decoupled PPO's pi_prox)
    prox_version: int = -1  # trainer version the proximal log-probs were computed with
    ref_logprobs: list[float] | None = None  # from the reference model (ref_logp role)
    # From the teacher (teacher_logp role, on-policy distillation): its log-prob of each action at
    # the sampling temperature, and the teacher's version that scored them (fixed: it never trains).
    teacher_logprobs: list[float] | None = None
    teacher_version: int = -1
    reward: float | None = None  # the weighted sum of ``rewards``
    rewards: dict[str, float] | None = None  # each named reward before weighting
    reward_info: str = ""  # verifier detail, or the reason a reward failed
    advantage: float | None = None  # filled by the train role from the group's rewards
    metrics: dict[str, float] | None = None  # the workload's own per-trajectory facts (turns, env seconds)
    # Set by a workflow that could not produce this trajectory through no fault of the policy (its
    # environment raised, hung or broke its protocol): the reason. The generate role then drops the
    # trajectory's group with that reason in the ledger, so it is never trained.
    failure: str | None = None
    finished_s: float | None = None  # event-loop time the generate role received it (end of its time in flight)
    # With a critic (``algorithm.advantage: gae``): the critic's value of the state before each
    # action, the critic version that scored them, and what the train role derives from them by
    # GAE: per-action advantages and returns (the critic's regression targets).
    values: list[float] | None = None
    value_version: int = -1
    # Per-action advantages, which the engines train with instead of ``advantage``: set by the
    # train role from GAE (with a critic) or from the teacher's log-probs (with a teacher).
    token_advantages: list[float] | None = None
    returns: list[float] | None = None

    @property
    def num_actions(self) -> int:
        return len(self.behaviour_logprobs)

    @property
    def num_trained(self) -> int:
        """Actions that carry a gradient."""
        return len(self.behaviour_logprobs) if self.loss_mask is None else sum(self.loss_mask)


@dataclass(slots=True)
class TrajectoryGroup:
    """All ``n`` trajectories of one prompt group, assembled by the rollout role."""

    group: PromptGroup
    trajectories: list[Trajectory]

    @property
    def step(self) -> int:
        return self.group.step

    @property
    def prompt_id(self) -> int:
        return self.group.prompt_id

    @property
    def oldest_version(self) -> int:
        """The oldest version any action of the group was sampled with (its staleness)."""
        return min(t.start_version for t in self.trajectories)

    @property
    def num_actions(self) -> int:
        return sum(t.num_actions for t in self.trajectories)


def token_trajectory(
    prompt_id: int,
    index: int,
    prompt_ids: list[int],
    response_ids: list[int],
    behaviour_logprobs: list[float],
    versions: list[int],
    finish_reason: FinishReason,
    *,
    text: str = "",
    loss_mask: list[int] | None = None,
    resumed: ResumePolicy | None = None,
) -> Trajectory:
    """A token trajectory (text or episode) with its payload; ``start_version`` is the first
    token's version (0-token trajectories start at version 0)."""
    return Trajectory(
        prompt_id=prompt_id,
        index=index,
        behaviour_logprobs=behaviour_logprobs,
        versions=versions,
        start_version=versions[0] if versions else 0,
        finish_reason=finish_reason,
        payload=TokenPayload(prompt_ids, response_ids, text),
        loss_mask=loss_mask,
        resumed=resumed,
    )
