"""Outcome-reward advantage estimators over prompt groups (numpy, no torch).

Owns the map from the scalar rewards of each group (one prompt sampled ``n`` times) to one
advantage per sample; the train role computes them and the loss broadcasts each over its
sample's trained actions. numpy rather than torch: rewards are a handful of floats per group,
and the train role runs this for every workload and engine, fakes included, without torch.

Every estimator takes ``rewards_by_group`` (a sequence of 1-D reward sequences or arrays, one
per group) and returns one 1-D float64 array per group, same order and lengths. Invariants:
- outputs are finite; rewards that are not finite, or empty groups, raise ValueError;
- a group whose rewards are all equal carries no learning signal: for the group-baselined
  estimators (GRPO, RLOO) its advantages are exactly 0, never NaN;
- the estimators are pure: no state, inputs are not modified.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimator",
    "RewardGroup",
    "compute_advantages",
    "grpo_advantages",
    "reinforce_advantages",
    "rloo_advantages",
]

RewardGroup = Sequence[float] | np.ndarray
AdvantageEstimator = Callable[..., list[np.ndarray]]


def _as_groups(rewards_by_group: Sequence[RewardGroup]) -> list[np.ndarray]:
    groups: list[np.ndarray] = []
    for i, rewards in enumerate(rewards_by_group):
        group = np.array(rewards, dtype=np.float64)  # a copy: inputs are never modified
        if group.ndim != 1 or group.size == 0:
            raise ValueError(f"group {i}: rewards must be a non-empty 1-D sequence, got shape {group.shape}")
        groups.append(group)
        if not np.isfinite(group).all():
            raise ValueError(f"group {i}: rewards must be finite, got {group.tolist()}")
    return groups


def _as_table(rewards_by_group: Sequence[RewardGroup]) -> np.ndarray | None:
    """The rewards as one ``[groups, n]`` array when every group has the same size (a copy),
    else None; one numpy call instead of one per group, for the train role's usual batch."""
    if len(rewards_by_group) < 2:
        return None
    try:
        table = np.array(rewards_by_group, dtype=np.float64)
    except ValueError:  # ragged
        return None
    if table.ndim != 2 or table.shape[1] == 0 or not np.isfinite(table).all():
        return None  # the group-by-group path names the bad group
    return table


def _all_equal(group: np.ndarray) -> bool:
    # Checked explicitly rather than trusting std == 0: the float mean of equal values can be
    # off by one ulp, and (tiny deviation) / eps would then be a sizeable made-up advantage.
    return bool((group == group[0]).all())


def grpo_advantages(
    rewards_by_group: Sequence[RewardGroup], *, normalize_std: bool = True, eps: float = 1e-6
) -> list[np.ndarray]:
    """Group-normalised advantages of GRPO (Shao et al. 2024, "DeepSeekMath").

    ``A_i = (r_i - mean(r)) / (std(r) + eps)`` within each group, with the unbiased (Bessel)
    sample std as in the TRL and verl implementations. ``normalize_std=False`` gives the
    mean-centred form ``A_i = r_i - mean(r)`` that Dr. GRPO (Liu et al. 2025, "Understanding
    R1-Zero-Like Training") recommends, which does not up-weight low-variance groups.

    Invariants: each group's advantages sum to 0 (up to rounding); a group of one sample or
    of equal rewards gets zeros.
    """
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    table = _as_table(rewards_by_group)
    if table is not None and table.shape[1] > 1:
        return list(_grpo_equal_sizes(table, normalize_std, eps))
    advantages: list[np.ndarray] = []
    for group in _as_groups(rewards_by_group):
        if group.size == 1 or _all_equal(group):
            advantages.append(np.zeros_like(group))
            continue
        centred = group - group.mean()
        advantages.append(centred / (group.std(ddof=1) + eps) if normalize_std else centred)
    return advantages


def _grpo_equal_sizes(rewards: np.ndarray, normalize_std: bool, eps: float) -> np.ndarray:
    """``grpo_advantages`` of ``[groups, n]`` rewards in one pass (the train role's usual batch):
    the same numbers as group by group, without a numpy call per group."""
    centred = rewards - rewards.mean(axis=1, keepdims=True)
    if normalize_std:
        centred = centred / (rewards.std(axis=1, ddof=1, keepdims=True) + eps)
    equal = (rewards == rewards[:, :1]).all(axis=1)  # exact zeros, never an ulp over eps
    centred[equal] = 0.0
    return centred


def rloo_advantages(rewards_by_group: Sequence[RewardGroup]) -> list[np.ndarray]:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, "Back to Basics: Revisiting
    REINFORCE Style Optimization for Learning from Human Feedback in LLMs"; Kool et al. 2019).

    ``A_i = r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean(r))``: each sample's baseline
    is the mean reward of the other samples of its group, so the baseline is independent of
    the sample and the gradient estimate stays unbiased.

    Invariants: each group's advantages sum to 0; equal rewards give zeros; a group needs
    at least two samples (otherwise ValueError: there is no one left to leave out).
    """
    advantages: list[np.ndarray] = []
    for i, group in enumerate(_as_groups(rewards_by_group)):
        n = group.size
        if n < 2:
            raise ValueError(f"group {i}: RLOO needs at least 2 samples per group, got {n}")
        if _all_equal(group):
            advantages.append(np.zeros_like(group))
            continue
        advantages.append((group - group.mean()) * (n / (n - 1)))
    return advantages


def reinforce_advantages(rewards_by_group: Sequence[RewardGroup]) -> list[np.ndarray]:
    """REINFORCE with a batch-mean baseline (Williams 1992, "Simple statistical
    gradient-following algorithms for connectionist reinforcement learning").

    ``A_i = r_i - mean of all rewards in the batch``; groups only keep the output's shape,
    the baseline ignores them. Invariant: all advantages of the batch sum to 0.
    """
    groups = _as_groups(rewards_by_group)
    if not groups:
        return []
    baseline = np.concatenate(groups).mean()
    return [group - baseline for group in groups]


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce": reinforce_advantages,
}


def compute_advantages(name: str, rewards_by_group: Sequence[RewardGroup], **options: Any) -> list[np.ndarray]:
    """Advantages of every group with the estimator registered as ``name``.

    ``options`` go to the estimator as keyword arguments (e.g. ``normalize_std``, ``eps`` for
    ``"grpo"``); an option the estimator does not take raises TypeError.
    """
    try:
        estimator = ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}; allowed: {sorted(ADVANTAGE_ESTIMATORS)}") from None
    return estimator(rewards_by_group, **options)
