"""Mismatch corrections: the importance weight between the trainer's and the rollout engine's
probabilities of the sampled tokens, truncated or masked, per token or per sequence.

Owns :func:`behaviour_importance_weights`, the weight decoupled PPO multiplies each token's loss
by, ``rho = pi_target / pi_behav`` with ``pi_behav`` the rollout engine's log-probs and
``pi_target`` the trainer's (``pi_prox`` in :func:`algorithms.losses.compute_policy_loss`). The
gap has two causes that the weight corrects together: staleness (``pi_behav`` is an older
version) and numerics (another engine, kernels, dtype: the "training-inference mismatch").

Three choices, each from a named source:

- **level**: ``token``, ``rho_t`` per token (biased, low variance); ``sequence``, the product
  ``prod_t rho_t`` broadcast to the sequence's tokens (the unbiased trajectory weight, high
  variance); ``geometric``, the geometric mean ``(prod_t rho_t)^(1/|T|)`` (biased, low variance,
  free of the "length trap" where long answers get extreme products). verl
  (``verl/trainer/ppo/rollout_corr_helper.py``, Liu, Li et al. 2025, "When Speed Kills Stability:
  Demystifying RL Collapse from the Training-Inference Mismatch") and slime
  (``examples/train_infer_mismatch_helper/mis.py``).
- **mode**: ``clamp``, truncated IS (TIS; Yao et al. 2025, "Your Efficient RL Framework Secretly
  Brings You Off-Policy RL Training"): the weight is clipped into ``[floor, cap]`` and every token
  keeps a gradient; ``mask``, masked IS (MIS, rejection sampling; Liu, Li et al. 2025, AReaL's
  ``behave_imp_weight_mode=mask``): a token or sequence whose ratio leaves ``[floor, cap]`` gets
  weight 0, the others keep their untruncated ratio.
- **band**: ``cap`` above, ``floor`` below (None: no lower bound). A two-sided mask at token
  level is IcePop (Ling Team 2025, "Every Step Evolves: Scaling Reinforcement Learning for
  Trillion-Scale Thinking Model", Ring-1T: ``M(k) = k if alpha <= k <= beta else 0`` with
  ``alpha = 0.5, beta = 5``). AReaL's decoupled PPO default is the one-sided token mask at 5.

Not to be confused with the ``tis`` *policy loss* in :mod:`algorithms.losses` (ROLL's), which
truncates ``pi_theta / pi_anchor`` inside a REINFORCE loss; the weight here multiplies whatever
loss is configured.

Invariants: the weight is data (no gradient); positions with ``mask == 0`` (padding, and the
environment's tokens in multi-turn episodes) take no part in any ratio, sum or metric and get
weight 0; a real token whose log-ratio is not finite (``-inf - (-inf)`` is NaN, and NaN passes
every ``>`` test as False) is never trusted: it is left out of its sequence's ratio and masked;
ratios are exponentiated from log-ratios clamped to ``+-`` :data:`SAFETY_LOG_RATIO` (verl's
``SAFETY_BOUND``) while band tests compare the unclamped log-ratio, so the clamp changes no
decision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch

__all__ = [
    "CORRECTION_LEVELS",
    "CORRECTION_MODES",
    "ICEPOP_BAND",
    "SAFETY_LOG_RATIO",
    "BehaviourWeights",
    "CorrectionLevel",
    "CorrectionMode",
    "behaviour_importance_weights",
    "behaviour_weight_metrics",
    "mismatch_metrics",
]

ICEPOP_BAND = (0.5, 5.0)  # Ring-1T's alpha and beta: where IcePop keeps a token

CorrectionLevel = Literal["token", "sequence", "geometric"]
CorrectionMode = Literal["clamp", "mask"]
CORRECTION_LEVELS: tuple[str, ...] = get_args(CorrectionLevel)
CORRECTION_MODES: tuple[str, ...] = get_args(CorrectionMode)

# exp(20) ~ 4.9e8, exp(-20) ~ 2e-9: far beyond any sensible cap or floor.
SAFETY_LOG_RATIO = 20.0


@dataclass(frozen=True, slots=True)
class BehaviourWeights:
    """The corrected weight and where it acted; every tensor is ``[rows, tokens]``."""

    weight: torch.Tensor  # float, detached: the weight to multiply each token's loss by; 0 where masked
    ratio: torch.Tensor  # float: rho at the chosen level before the band, safety-bounded; 0 outside ``valid``
    valid: torch.Tensor  # bool: real tokens with a finite log-ratio (the others get weight 0)
    clamped: torch.Tensor  # bool: valid tokens whose weight was truncated ("clamp")
    masked: torch.Tensor  # bool: valid tokens given weight 0 by the band ("mask")


def behaviour_importance_weights(
    target_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str = "token",
    mode: str = "mask",
    cap: float,
    floor: float | None = None,
) -> BehaviourWeights:
    """``rho = pi_target / pi_behav`` at ``level``, truncated (``clamp``) into or masked
    (``mask``) outside ``[floor, cap]``; see the module docstring for the sources.

    ``target_logprobs`` and ``behaviour_logprobs`` are ``[rows, tokens]`` log-probs of the sampled
    tokens, one row per sequence; ``mask`` is 1 on the tokens that count. With ``level="token"``,
    ``mode="mask"`` and no floor this is AReaL's decoupled-PPO weight ``w`` (0 above the cap).
    """
    if level not in CORRECTION_LEVELS:
        raise ValueError(f"unknown correction level {level!r}; allowed: {list(CORRECTION_LEVELS)}")
    if mode not in CORRECTION_MODES:
        raise ValueError(f"unknown correction mode {mode!r}; allowed: {list(CORRECTION_MODES)}")
    if not cap > 0 or (floor is not None and not 0 < floor <= cap):
        raise ValueError(f"the band needs 0 < floor <= cap, got floor={floor}, cap={cap}")

    real = mask > 0
    raw = target_logprobs.detach() - behaviour_logprobs.detach()
    valid = real & torch.isfinite(raw)
    log_ratio = torch.where(valid, raw, 0.0)
    if level == "token":
        level_log_ratio = log_ratio
    else:
        row_sum = log_ratio.sum(dim=-1, keepdim=True)
        if level == "geometric":
            row_sum = row_sum / valid.sum(dim=-1, keepdim=True).clamp(min=1)
        level_log_ratio = row_sum.expand_as(log_ratio)

    ratio = torch.where(valid, level_log_ratio.clamp(-SAFETY_LOG_RATIO, SAFETY_LOG_RATIO).exp(), 0.0)
    outside = level_log_ratio > math.log(cap)
    if floor is not None:
        outside = outside | (level_log_ratio < math.log(floor))
    outside = valid & outside
    no_token = torch.zeros_like(valid)
    if mode == "clamp":
        weight = torch.where(valid, ratio.clamp(min=0.0 if floor is None else floor, max=cap), 0.0)
        clamped, masked = outside, no_token
    else:
        weight = torch.where(outside, 0.0, ratio)
        clamped, masked = no_token, outside
    return BehaviourWeights(weight=weight, ratio=ratio, valid=valid, clamped=clamped, masked=masked)


def behaviour_weight_metrics(weights: BehaviourWeights, mask: torch.Tensor) -> dict[str, float]:
    """The ratio's distribution for one micro-batch: ``behaviour_ratio_mean`` and
    ``behaviour_ratio_max`` (rho before the band, over valid tokens; 0 without any),
    ``importance_weight_mean`` (the weight after the band), ``behaviour_weight_clamped_fraction``
    and ``masked_fraction``: token means over real tokens (``mask > 0``).

    A ``*_max`` metric is the micro-batch's maximum: combine micro-batches with ``max``, not a mean.
    """
    real = mask > 0
    num_real = real.sum().clamp(min=1)
    num_valid = weights.valid.sum().clamp(min=1)
    ratio = weights.ratio.to(torch.float32)
    any_valid = bool(weights.valid.any())
    return {
        "behaviour_ratio_mean": float(ratio.sum() / num_valid),
        "behaviour_ratio_max": float(ratio[weights.valid].max()) if any_valid else 0.0,
        "importance_weight_mean": float(torch.where(real, weights.weight, 0.0).to(torch.float32).sum() / num_real),
        "behaviour_weight_clamped_fraction": float(weights.clamped.sum() / num_real),
        "masked_fraction": float(weights.masked.sum() / num_real),
    }


def mismatch_metrics(behaviour: torch.Tensor, train: torch.Tensor, fresh: torch.Tensor) -> dict[str, float]:
    """The training-inference mismatch of one micro-batch: ``log pi_rollout - log pi_train`` over
    the tokens ``fresh`` marks, those sampled by the very weights ``train`` scores them with
    (any other token's gap mixes in the policy's change since it was sampled).

    ``rollout_gap_mean`` (signed), ``rollout_gap_abs_max`` (combine micro-batches with max),
    ``rollout_gap_icepop_fraction`` (tokens whose ratio ``pi_train / pi_rollout`` leaves IcePop's
    band [0.5, 5], which IcePop would mask) and ``rollout_gap_count`` (how many were compared; a
    count: sum it). All 0 without such tokens.
    """
    valid = (fresh > 0) & torch.isfinite(behaviour) & torch.isfinite(train)
    count = int(valid.sum())
    if count == 0:
        return {"rollout_gap_mean": 0.0, "rollout_gap_abs_max": 0.0, "rollout_gap_icepop_fraction": 0.0,
                "rollout_gap_count": 0.0}
    gap = (behaviour - train).to(torch.float64)[valid]
    low, high = math.log(ICEPOP_BAND[0]), math.log(ICEPOP_BAND[1])
    outside = (-gap < low) | (-gap > high)  # log ratio = train - behaviour = -gap
    return {
        "rollout_gap_mean": float(gap.mean()),
        "rollout_gap_abs_max": float(gap.abs().max()),
        "rollout_gap_icepop_fraction": float(outside.to(torch.float64).mean()),
        "rollout_gap_count": float(count),
    }
