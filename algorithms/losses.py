"""Policy-gradient losses over :class:`~algorithms.batch.LossInputs`.

Owns the map from one micro-batch of token-aligned tensors to a scalar loss and its metrics:
:func:`compute_policy_loss` resolves which policy the ratio is taken against, applies the
behaviour importance weight, dispatches to a per-token loss from :data:`POLICY_LOSSES`, adds
the KL penalty and aggregates. The per-token losses only see ``(logprobs, log_ratio,
advantages, cfg)``, so every loss gets decoupling, padding and KL handling the same way.

Notation, per token: ``A`` advantage, ``r = exp(log pi_theta - log pi_anchor)`` the ratio,
``sg`` stop-gradient. The anchor is the proximal policy ``pi_prox`` when ``cfg.decoupled``
(the default) and the behaviour policy ``pi_behav`` (the rollout engine's) otherwise.

Decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy optimization";
Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for
Language Reasoning") separates the two roles the "old" policy plays: the trust region is
around ``pi_prox`` (log-probs recomputed by the trainer), and the off-policy correction is
the behaviour weight ``w = pi_prox / pi_behav`` that multiplies each token's loss. ``w`` is
capped at ``behaviour_weight_cap``: ``"clamp"`` uses ``min(w, cap)``; ``"mask"`` (AReaL's
choice) gives weight 0 to tokens with ``w > cap`` -- they stay in the aggregation's
denominator, exactly as a zero weight would.

Invariants:
- padding (``mask == 0``) contributes nothing to the loss, its gradient or the metrics, even
  where padded positions hold inf or NaN;
- the behaviour weight is never silently 1: with ``decoupled=True`` a missing
  ``prox_logprobs`` raises ValueError, and a KL penalty with missing ``ref_logprobs`` too;
- only ``logprobs`` receives gradient; every other input is treated as data;
- a micro-batch without real tokens gives a loss of 0 that is still part of the graph;
- rate metrics (clip fraction, mean ratio, ...) are token means over real tokens whatever
  the loss aggregation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from algorithms.batch import LossInputs
from algorithms.kl import KL_ESTIMATORS, compute_kl, kl_k3

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
BehaviourWeightMode = Literal["clamp", "mask"]
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)
BEHAVIOUR_WEIGHT_MODES: tuple[str, ...] = get_args(BehaviourWeightMode)

# exp(20) ~ 4.9e8: every loss here has truncated such a ratio long before; the clamp keeps
# exp() finite so a single wild token cannot make the loss or its gradient inf/NaN.
_MAX_LOG_RATIO = 20.0


@dataclass(frozen=True, slots=True)
class LossConfig:
    """Which policy loss to use and its parameters; validated on construction.

    A field only matters to the losses named in its comment; the others ignore it.
    """

    name: str = "ppo"  # a key of POLICY_LOSSES
    clip_eps_low: float = 0.2  # ppo: ratio clipped below at 1 - clip_eps_low
    clip_eps_high: float = 0.2  # ppo: ratio clipped above at 1 + clip_eps_high (DAPO: 0.28)
    dual_clip_c: float | None = None  # ppo: dual-clip constant c > 1 (Ye et al. 2020: 3)
    decoupled: bool = True  # all: anchor on pi_prox and weight tokens by pi_prox / pi_behav
    behaviour_weight_cap: float = 5.0  # decoupled: cap on pi_prox / pi_behav (AReaL uses 5)
    behaviour_weight_mode: BehaviourWeightMode = "mask"  # decoupled: "clamp" or "mask" above cap
    tis_cap: float = 1.0  # tis: upper truncation of the ratio (ROLL's default bound)
    topr_positive_weight: float = 1.0  # topr: coefficient of the A > 0 (SFT-like) term
    topr_negative_weight: float = 1.0  # topr: coefficient of the A <= 0 (truncated IS) term
    cispo_eps_low: float = 1.0  # cispo: IS weight floor 1 - eps; 1.0 = none, as in MiniMax-M1
    cispo_eps_high: float = 0.2  # cispo: IS weight ceiling 1 + eps
    kimi15_tau: float = 0.1  # kimi15: coefficient of the squared log-ratio penalty
    kl_estimator: str | None = None  # all: "k1" | "k2" | "k3" against ref_logprobs, or None
    kl_coef: float = 0.0  # all: weight of the KL term; > 0 needs kl_estimator
    aggregation: Aggregation = "token-mean"

    def __post_init__(self) -> None:
        get_policy_loss(self.name)
        if not 0.0 <= self.clip_eps_low <= 1.0 or self.clip_eps_high < 0.0:
            raise ValueError(
                "clip_eps_low must be in [0, 1] and clip_eps_high >= 0, got "
                f"{self.clip_eps_low}, {self.clip_eps_high}"
            )
        if self.dual_clip_c is not None and self.dual_clip_c <= 1.0:
            raise ValueError(f"dual_clip_c must be > 1 (Ye et al. 2020), got {self.dual_clip_c}")
        if self.behaviour_weight_cap < 1.0:
            raise ValueError(
                "behaviour_weight_cap must be >= 1 (a lower cap would cut on-policy tokens), "
                f"got {self.behaviour_weight_cap}"
            )
        if self.behaviour_weight_mode not in BEHAVIOUR_WEIGHT_MODES:
            raise ValueError(
                f"behaviour_weight_mode must be one of {list(BEHAVIOUR_WEIGHT_MODES)}, "
                f"got {self.behaviour_weight_mode!r}"
            )
        if self.tis_cap <= 0.0:
            raise ValueError(f"tis_cap must be > 0, got {self.tis_cap}")
        if self.topr_positive_weight < 0.0 or self.topr_negative_weight < 0.0:
            raise ValueError("topr_positive_weight and topr_negative_weight must be >= 0")
        if not 0.0 <= self.cispo_eps_low <= 1.0 or self.cispo_eps_high < 0.0:
            raise ValueError(
                "cispo_eps_low must be in [0, 1] and cispo_eps_high >= 0, got "
                f"{self.cispo_eps_low}, {self.cispo_eps_high}"
            )
        if self.kimi15_tau < 0.0:
            raise ValueError(f"kimi15_tau must be >= 0, got {self.kimi15_tau}")
        if self.kl_estimator is not None and self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"unknown kl_estimator {self.kl_estimator!r}; allowed: {sorted(KL_ESTIMATORS)}"
            )
        if self.kl_coef < 0.0 or (self.kl_coef > 0.0 and self.kl_estimator is None):
            raise ValueError(
                f"kl_coef must be >= 0, and > 0 only with a kl_estimator; got {self.kl_coef} "
                f"with kl_estimator={self.kl_estimator!r}"
            )
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(
                f"aggregation must be one of {list(AGGREGATIONS)}, got {self.aggregation!r}"
            )


@dataclass(frozen=True, slots=True)
class TokenLoss:
    """What a per-token policy loss returns: the loss and where it clipped, per token."""

    loss: torch.Tensor  # [rows, tokens]; padding positions are ignored by the caller
    clipped: torch.Tensor  # bool [rows, tokens]: the loss clipped or truncated this token
    dual_clipped: torch.Tensor | None = None  # bool, ppo with dual clip only


# (logprobs, log_ratio, advantages, cfg) -> TokenLoss; log_ratio = log pi_theta - log pi_anchor.
PolicyLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, LossConfig], TokenLoss]


def _all_false(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like, dtype=torch.bool)


def ppo_loss(
    logprobs: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor, cfg: LossConfig
) -> TokenLoss:
    """PPO clipped surrogate (Schulman et al. 2017), with optional dual clip (Ye et al. 2020,
    "Mastering Complex Control in MOBA Games with Deep Reinforcement Learning").

    ``loss = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)``; with dual clip, for
    ``A < 0`` only, ``loss = -max(min(...), c * A)``, which bounds the loss of a negative
    token whose ratio has run far above 1. Clipped tokens (``A > 0, r > 1 + eps_high`` or
    ``A < 0, r < 1 - eps_low``) and dual-clipped ones get no gradient.
    """
    ratio = log_ratio.exp()
    clipped_ratio = ratio.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    surrogate = torch.minimum(ratio * advantages, clipped_ratio * advantages)
    clipped = ((advantages > 0) & (ratio > 1.0 + cfg.clip_eps_high)) | (
        (advantages < 0) & (ratio < 1.0 - cfg.clip_eps_low)
    )
    dual_clipped = None
    if cfg.dual_clip_c is not None:
        floor = cfg.dual_clip_c * advantages
        dual_clipped = (advantages < 0) & (surrogate < floor)
        surrogate = torch.where(dual_clipped, floor, surrogate)
    return TokenLoss(loss=-surrogate, clipped=clipped, dual_clipped=dual_clipped)


def vanilla_loss(
    logprobs: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor, cfg: LossConfig
) -> TokenLoss:
    """Plain policy gradient, REINFORCE (Williams 1992); ROLL's ``vanilla``.

    ``loss = -A * log pi_theta``; no ratio, no clipping: on-policy by construction.
    """
    return TokenLoss(loss=-advantages * logprobs, clipped=_all_false(logprobs))


def tis_loss(
    logprobs: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor, cfg: LossConfig
) -> TokenLoss:
    """Truncated importance sampling policy gradient; ROLL's ``tis`` (cf. Yao et al. 2025,
    "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training").

    ``loss = -sg(min(r, tis_cap)) * A * log pi_theta``: REINFORCE re-weighted by the ratio,
    truncated above so that no token's weight exceeds the cap (ROLL's default cap is 1).
    """
    ratio = log_ratio.detach().exp()
    weight = ratio.clamp(max=cfg.tis_cap)
    return TokenLoss(loss=-weight * advantages * logprobs, clipped=ratio > cfg.tis_cap)


def topr_loss(
    logprobs: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor, cfg: LossConfig
) -> TokenLoss:
    """Tapered Off-Policy REINFORCE (Le Roux et al. 2025, "Tapered Off-Policy REINFORCE:
    Stable and efficient reinforcement learning for LLMs"); ROLL's ``topr``.

    ``loss = -w_pos * A * log pi_theta`` on positive tokens (SFT-like, no importance weight)
    and ``-w_neg * sg(clip(r, 0, 1)) * A * log pi_theta`` on the others (truncated IS).
    ROLL splits on the sign of the raw score; LossInputs carries advantages only, so the
    split here is ``A > 0``. With binary rewards and a group baseline the two agree.
    ``clipped`` marks the negative tokens whose ratio was truncated at 1.
    """
    ratio = log_ratio.detach().exp()
    positive = advantages > 0
    positive_term = -cfg.topr_positive_weight * advantages * logprobs
    negative_term = -cfg.topr_negative_weight * ratio.clamp(max=1.0) * advantages * logprobs
    return TokenLoss(
        loss=torch.where(positive, positive_term, negative_term),
        clipped=~positive & (ratio > 1.0),
    )


def cispo_loss(
    logprobs: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor, cfg: LossConfig
) -> TokenLoss:
    """Clipped IS-weight Policy Optimization (MiniMax 2025, "MiniMax-M1: Scaling Test-Time
    Compute Efficiently with Lightning Attention"); ROLL's ``cispo``.

    ``loss = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi_theta``: the importance
    weight is clipped instead of the update, so every token keeps a gradient (PPO drops the
    clipped ones, often the rare "reflection" tokens).
    """
    ratio = log_ratio.detach().exp()
    low, high = 1.0 - cfg.cispo_eps_low, 1.0 + cfg.cispo_eps_high
    return TokenLoss(
        loss=-ratio.clamp(low, high) * advantages * logprobs,
        clipped=(ratio < low) | (ratio > high),
    )


def kimi15_loss(
    logprobs: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor, cfg: LossConfig
) -> TokenLoss:
    """Kimi k1.5's policy mirror-descent surrogate (Kimi Team 2025, "Kimi k1.5: Scaling
    Reinforcement Learning with LLMs", eq. 3); ROLL's ``kimi15``.

    ``loss = -A * log pi_theta + tau / 2 * (log pi_theta - log pi_anchor)^2``: REINFORCE
    with a squared log-ratio penalty that keeps the policy near the anchor instead of clipping.
    """
    return TokenLoss(
        loss=-advantages * logprobs + 0.5 * cfg.kimi15_tau * log_ratio.square(),
        clipped=_all_false(logprobs),
    )


POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "ppo": ppo_loss,
    "vanilla": vanilla_loss,
    "tis": tis_loss,
    "topr": topr_loss,
    "cispo": cispo_loss,
    "kimi15": kimi15_loss,
}


def get_policy_loss(name: str) -> PolicyLossFn:
    """The per-token loss registered as ``name``; a ValueError lists the allowed names."""
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy loss {name!r}; allowed: {sorted(POLICY_LOSSES)}"
        ) from None


def aggregate_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Reduce a ``[rows, tokens]`` loss to a scalar over real tokens (``mask > 0``).

    - ``token-mean``: sum over all real tokens / their number. Every token weighs the same,
      so long answers are not diluted: DAPO (Yu et al. 2025) and AReaL use it.
    - ``seq-mean-token-mean``: mean over sequences of each sequence's token mean, as GRPO is
      written in DeepSeekMath (Shao et al. 2024): ``1/G sum_i 1/|o_i| sum_t``.
    - ``seq-mean-token-sum``: mean over sequences of each sequence's token sum: the gradient of
      the whole response's log-prob, as in REINFORCE/RLOO on full sequences (Williams 1992;
      Ahmadian et al. 2024) and, up to its constant divisor, Dr. GRPO (Liu et al. 2025).

    Rows without real tokens are left out of the sequence means; no real token at all gives 0.
    """
    real = mask > 0
    token_loss = torch.where(real, loss_mat, 0.0)
    if mode == "token-mean":
        return token_loss.sum() / real.sum().clamp(min=1)
    row_tokens = real.sum(dim=-1)
    row_sum = token_loss.sum(dim=-1)
    if mode == "seq-mean-token-mean":
        row_loss = row_sum / row_tokens.clamp(min=1)
    elif mode == "seq-mean-token-sum":
        row_loss = row_sum
    else:
        raise ValueError(f"unknown aggregation {mode!r}; allowed: {list(AGGREGATIONS)}")
    return row_loss.sum() / (row_tokens > 0).sum().clamp(min=1)


def _token_mean(values: torch.Tensor, real: torch.Tensor) -> float:
    """Mean of ``values`` over real tokens, as a float metric (0.0 without real tokens)."""
    values = torch.where(real, values.detach().to(torch.float32), 0.0)
    return (values.sum() / real.sum().clamp(min=1)).item()


def _check_inputs(inputs: LossInputs, cfg: LossConfig) -> None:
    if inputs.logprobs.dim() != 2:
        raise ValueError(
            f"logprobs must be [rows, tokens], got shape {tuple(inputs.logprobs.shape)}"
        )
    for field in (
        "behaviour_logprobs", "advantages", "mask", "prox_logprobs", "ref_logprobs", "entropy"
    ):
        tensor = getattr(inputs, field)
        if tensor is not None and tensor.shape != inputs.logprobs.shape:
            raise ValueError(
                f"{field} has shape {tuple(tensor.shape)}, logprobs {tuple(inputs.logprobs.shape)}"
            )
    if cfg.decoupled and inputs.prox_logprobs is None:
        raise ValueError(
            "decoupled loss (LossConfig.decoupled=True) needs prox_logprobs, the proximal "
            "policy's log-probs recomputed by the trainer, but got None; refusing to use a "
            "behaviour weight of 1. Recompute them, or set decoupled=False to anchor on the "
            "behaviour log-probs."
        )
    if cfg.kl_estimator is not None and inputs.ref_logprobs is None:
        raise ValueError(
            f"KL penalty (kl_estimator={cfg.kl_estimator!r}) needs ref_logprobs from the "
            "reference model, but got None; compute them or set kl_estimator=None."
        )


def compute_policy_loss(
    inputs: LossInputs, cfg: LossConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """The scalar loss of one micro-batch and its metrics.

    ``loss = aggregate(w * policy_loss) + kl_coef * aggregate(kl(pi_theta, pi_ref))`` with
    ``w`` the capped behaviour weight when decoupled (else 1 by configuration).

    Metrics: ``loss``, ``pg_loss`` and ``kl_loss`` (with a KL estimator; the estimate before
    ``kl_coef``) aggregated as the loss is; the others are token means over real tokens:
    ``clip_fraction`` (0 for losses that do
    not clip), ``dual_clip_fraction`` (ppo with dual clip), ``ratio_mean`` (pi_theta /
    pi_anchor), ``approx_kl_behaviour`` (k3 estimate of KL(pi_behav || pi_theta)),
    ``importance_weight_mean`` (decoupled: the behaviour weight after the cap),
    ``masked_fraction`` (tokens zeroed by the "mask" cap) and ``entropy_mean`` (with entropy).
    """
    _check_inputs(inputs, cfg)
    real = inputs.mask > 0
    # Zero the padding before any arithmetic: exp/log of garbage there would otherwise
    # leak NaN into the backward pass even through torch.where.
    logprobs = torch.where(real, inputs.logprobs, 0.0)
    behaviour = torch.where(real, inputs.behaviour_logprobs.detach(), 0.0)
    advantages = torch.where(real, inputs.advantages.detach(), 0.0)

    metrics: dict[str, float] = {}
    weight: torch.Tensor | None = None
    masked = _all_false(logprobs)
    if cfg.decoupled:
        assert inputs.prox_logprobs is not None  # checked by _check_inputs
        anchor = torch.where(real, inputs.prox_logprobs.detach(), 0.0)
        weight = (anchor - behaviour).exp()
        if cfg.behaviour_weight_mode == "clamp":
            weight = weight.clamp(max=cfg.behaviour_weight_cap)
        else:
            masked = real & (weight > cfg.behaviour_weight_cap)
            weight = torch.where(masked, 0.0, weight)
        metrics["importance_weight_mean"] = _token_mean(weight, real)
    else:
        anchor = behaviour

    log_ratio = (logprobs - anchor).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    token = get_policy_loss(cfg.name)(logprobs, log_ratio, advantages, cfg)
    per_token = token.loss if weight is None else token.loss * weight
    pg_loss = aggregate_loss(per_token, real, cfg.aggregation)
    loss = pg_loss

    if cfg.kl_estimator is not None:
        assert inputs.ref_logprobs is not None  # checked by _check_inputs
        ref = torch.where(real, inputs.ref_logprobs.detach(), 0.0)
        kl_loss = aggregate_loss(compute_kl(cfg.kl_estimator, logprobs, ref), real, cfg.aggregation)
        loss = loss + cfg.kl_coef * kl_loss
        metrics["kl_loss"] = kl_loss.item()

    metrics["loss"] = loss.item()
    metrics["pg_loss"] = pg_loss.item()
    metrics["clip_fraction"] = _token_mean(token.clipped, real)
    if token.dual_clipped is not None:
        metrics["dual_clip_fraction"] = _token_mean(token.dual_clipped, real)
    metrics["ratio_mean"] = _token_mean(log_ratio.exp(), real)
    # Tokens were sampled from pi_behav, so k3 with pi_behav as "q" is an unbiased estimate.
    metrics["approx_kl_behaviour"] = _token_mean(kl_k3(behaviour, logprobs.detach()), real)
    metrics["masked_fraction"] = _token_mean(masked, real)
    if inputs.entropy is not None:
        metrics["entropy_mean"] = _token_mean(inputs.entropy, real)
    return loss, metrics
