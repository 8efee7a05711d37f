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
        if not np.isfinite(group).all():
            raise ValueError(f"group {i}: rewards must be finite, got {group.tolist()}")
        groups.append(group)
    return groups


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
    advantages: list[np.ndarray] = []
    for group in _as_groups(rewards_by_group):
        if group.size == 1 or _all_equal(group):
            advantages.append(np.zeros_like(group))
            continue
        centred = group - group.mean()
        advantages.append(centred / (group.std(ddof=1) + eps) if normalize_std else centred)
    return advantages


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
