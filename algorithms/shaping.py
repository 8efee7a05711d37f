"""DAPO's reward shaping and group filter: pure functions of lengths and rewards (no torch).

Owns two pieces of DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning
System at Scale"):

- the **soft over-long punishment** (section 3.4, eq. 13), added to a response's reward: 0 up
  to ``max_length - cache_length`` tokens, then a linear ramp down to -1 at ``max_length``, and
  -1 beyond. It replaces the cliff of "truncated means reward 0 (or -1)" by a slope the policy
  can follow before it hits the limit. verl's ``DAPORewardManager`` computes the same ramp
  (``overlong_buffer.len`` is the cache length, at ``penalty_factor`` 1);
- **dynamic sampling** (section 3.2): a prompt group whose rewards are all equal (all correct
  or all wrong) gives every sample a zero group-baselined advantage (GRPO, RLOO), so it only
  dilutes the batch; DAPO drops such groups and samples more prompts until the batch is full.
  :func:`has_reward_variance` is the keep-predicate; the refill loop and its bound on extra
  generation belong to the train role. With a batch baseline (``reinforce``) equal-reward
  groups do carry signal: the filter is for the group-baselined estimators.

Invariants: pure and deterministic; inputs are validated (ValueError), never clipped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["has_reward_variance", "soft_overlong_penalty"]


def soft_overlong_penalty(length: int, *, max_length: int, cache_length: int) -> float:
    """DAPO's soft over-long punishment of a response of ``length`` tokens (eq. 13):

    ``0`` if ``length <= max_length - cache_length``; ``(max_length - cache_length - length) /
    cache_length`` (from 0 down to -1) up to ``max_length``; ``-1`` beyond. DAPO used
    ``max_length = 20480``, ``cache_length = 4096``.
    """
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    if not 0 < cache_length <= max_length:
        raise ValueError(f"need 0 < cache_length <= max_length, got cache_length={cache_length}, max_length={max_length}")
    expected = max_length - cache_length
    if length <= expected:
        return 0.0
    if length <= max_length:
        return (expected - length) / cache_length
    return -1.0


def has_reward_variance(rewards: Sequence[float]) -> bool:
    """Whether a prompt group's rewards differ (DAPO's dynamic-sampling keep-test,
    ``0 < #correct < G`` for 0/1 rewards). A group of one has no variance: its group-baselined
    advantage is 0 too. Equality is exact, as in :mod:`algorithms.advantages`."""
    values = [float(r) for r in rewards]
    if not values:
        raise ValueError("a group needs at least one reward")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"rewards must be finite, got {values}")
    return any(v != values[0] for v in values)
