"""Policy-gradient losses over :class:`~algorithms.batch.LossInputs`.

Owns the map from one micro-batch of token-aligned tensors to a scalar loss and its metrics:
:func:`compute_policy_loss` resolves which policy the ratio is taken against, applies the
behaviour importance weight (a mismatch correction from :mod:`algorithms.corrections`),
dispatches to a per-token loss from :data:`POLICY_LOSSES`, adds the KL penalty and aggregates.
The per-token losses only see ``(logprobs, log_ratio, advantages, cfg)``, so every loss gets
decoupling, corrections, padding and KL handling the same way.

Notation, per token: ``A`` advantage, ``r = exp(log pi_theta - log pi_anchor)`` the ratio,
``sg`` stop-gradient. The anchor is the proximal policy ``pi_prox`` when ``cfg.decoupled``
(the default) and the behaviour policy ``pi_behav`` (the rollout engine's) otherwise.

Decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy optimization";
Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for
Language Reasoning") separates the two roles the "old" policy plays: the trust region is
around ``pi_prox`` (log-probs recomputed by the trainer), and the off-policy correction is
the behaviour weight ``w = pi_prox / pi_behav`` that multiplies each token's loss. ``w`` is
corrected by :func:`~algorithms.corrections.behaviour_importance_weights` with the settings
``behaviour_weight_level`` (token, sequence or geometric ratio), ``behaviour_weight_mode``
(``"clamp"``: truncated IS; ``"mask"``: masked IS, AReaL's choice) and the band
``[behaviour_weight_floor, behaviour_weight_cap]`` (a two-sided token mask is IcePop). The
defaults (token, mask, no floor, cap 5) are AReaL's decoupled loss. Masked tokens stay in the
aggregation's denominator, exactly as a zero weight would. The corrections act only in the
decoupled loss: with ``decoupled=False`` the anchor is ``pi_behav`` and every ratio-based loss
already weights by ``pi_theta / pi_behav`` (PPO's clipped ratio, the truncated weights of tis,
topr and cispo), so a second behaviour weight would count the gap twice; the
``behaviour_weight_*`` settings then do nothing.

Tokens that are never trained, each counted in a metric instead of failing silently:
- a real token whose behaviour, proximal or reference log-prob is not finite
  (``nonfinite_fraction``): ``-inf - (-inf)`` is NaN, and NaN passes a ``w > cap`` test as
  False, so without this one such token made the whole loss NaN; AReaL sanitises the same
  log-ratio (``areal/utils/functional/functional.py``), we mask the token rather than give it
  weight 1;
- a token with ``|log pi_theta - log pi_anchor| > 20`` (``out_of_range_fraction``): ``exp``
  must stay finite, and the clamp that used to do it silently zeroed such a token's PPO
  gradient (while adding up to ``e^20 |A|`` to the loss's value) and let the other losses train
  it on a meaningless weight;
- tokens outside the correction's band (``masked_fraction``).
All three stay in the aggregation's denominator with loss 0 and no gradient, in every term.

Invariants:
- padding (``mask == 0``) contributes nothing to the loss, its gradient or the metrics, even
  where padded positions hold inf or NaN;
- the behaviour weight is never silently 1: with ``decoupled=True`` a missing
  ``prox_logprobs`` raises ValueError, and a KL penalty with missing ``ref_logprobs`` too;
- only ``logprobs`` receives gradient; every other input is treated as data;
- a micro-batch without real tokens gives a loss of 0 that is still part of the graph;
- rate metrics (clip fraction, masked fraction, ...) are token means over real tokens whatever
  the loss aggregation; ``ratio_mean`` and ``approx_kl_behaviour`` are means over the tokens
  that were scored (real, finite, in range).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

import torch

from tandem.algorithms.batch import LossInputs
from tandem.algorithms.corrections import (
    CORRECTION_MODES,
    CorrectionMode,
    behaviour_importance_weights,
    behaviour_weight_metrics,
    mismatch_metrics,
)
from tandem.algorithms.kl import KL_LOSS_ESTIMATORS, MAX_LOG_RATIO, compute_kl, importance_weighted_kl, k3_clamped, kl_k3

__all__ = [
    "AGGREGATIONS",
    "BEHAVIOUR_WEIGHT_MODES",
    "EXACT_KL",
    "POLICY_LOSSES",
    "Aggregation",
    "BehaviourWeightMode",
    "LossSettings",
    "PolicyLossFn",
    "TokenLoss",
    "aggregate_loss",
    "cispo_loss",
    "compute_policy_loss",
    "get_policy_loss",
    "kimi15_loss",
    "ppo_loss",
    "tis_loss",
    "topr_loss",
    "vanilla_loss",
]

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
# The KL term's name for an exact KL the engine computed (``LossInputs.kl``) rather than one
# estimated from log-probs of the sampled actions (the estimators of ``algorithms.kl``).
EXACT_KL = "exact"
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)
# The behaviour weight's modes are the corrections' ("clamp": truncated IS, "mask": masked IS).
BehaviourWeightMode = CorrectionMode
BEHAVIOUR_WEIGHT_MODES: tuple[str, ...] = CORRECTION_MODES


class LossSettings(Protocol):
    """What the losses read from their configuration: the attributes, by these names.

    One type serves: ``core.config.AlgorithmConfig`` (the run config's ``algorithm`` section,
    which validates every value and documents each field) has exactly these attributes, and
    any object with them (a dataclass, a ``SimpleNamespace``) works in pure use. A field only
    matters to the losses named in its comment; the others ignore it.
    """

    loss: str  # a key of POLICY_LOSSES
    clip_eps_low: float  # ppo: ratio clipped below at 1 - clip_eps_low
    clip_eps_high: float  # ppo: ratio clipped above at 1 + clip_eps_high (DAPO: 0.28)
    dual_clip_c: float | None  # ppo: dual-clip constant c > 1 (Ye et al. 2020: 3)
    decoupled: bool  # all: anchor on pi_prox and weight tokens by pi_prox / pi_behav
    behaviour_weight_level: str  # decoupled: ratio per "token", or per "sequence" (product) or "geometric" (mean)
    behaviour_weight_mode: str  # decoupled: "clamp" (truncated IS) or "mask" (masked IS) outside the band
    behaviour_weight_cap: float  # decoupled: upper end of the band (AReaL uses 5)
    behaviour_weight_floor: float | None  # decoupled: lower end of the band, None = none (IcePop: 0.5)
    tis_cap: float  # tis: upper truncation of the ratio (ROLL's default bound)
    topr_positive_weight: float  # topr: coefficient of the A > 0 (SFT-like) term
    topr_negative_weight: float  # topr: coefficient of the A <= 0 (truncated IS) term
    cispo_eps_low: float  # cispo: IS weight floor 1 - eps; 1.0 = none, as in MiniMax-M1
    cispo_eps_high: float  # cispo: IS weight ceiling 1 + eps
    kimi15_tau: float  # kimi15: coefficient of the squared log-ratio penalty
    kl_estimator: str | None  # all: a key of KL_LOSS_ESTIMATORS ("k2" | "k3") against ref_logprobs, EXACT_KL, or None
    kl_coef: float  # all: weight of the KL term; > 0 needs kl_estimator
    kl_importance_weight: bool  # decoupled: KL term times pi_theta / pi_behav (DeepSeek-V3.2's unbiased KL)
    aggregation: str  # "token-mean" | "seq-mean-token-mean" | "seq-mean-token-sum"


@dataclass(frozen=True, slots=True)
class TokenLoss:
    """What a per-token policy loss returns: the loss and where it clipped, per token."""

    loss: torch.Tensor  # [rows, tokens]; padding positions are ignored by the caller
    clipped: torch.Tensor  # bool [rows, tokens]: the loss clipped or truncated this token
    dual_clipped: torch.Tensor | None = None  # bool, ppo with dual clip only


# (logprobs, log_ratio, advantages, cfg) -> TokenLoss; log_ratio = log pi_theta - log pi_anchor.
PolicyLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, LossSettings], TokenLoss]


def _all_false(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like, dtype=torch.bool)


def ppo_loss(
    logprobs: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor, cfg: LossSettings
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
    logprobs: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor, cfg: LossSettings
) -> TokenLoss:
    """Plain policy gradient, REINFORCE (Williams 1992); ROLL's ``vanilla``.

    ``loss = -A * log pi_theta``; no ratio, no clipping: on-policy by construction.
    """
    return TokenLoss(loss=-advantages * logprobs, clipped=_all_false(logprobs))


def tis_loss(
    logprobs: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor, cfg: LossSettings
) -> TokenLoss:
    """Truncated importance sampling policy gradient; ROLL's ``tis`` (cf. Yao et al. 2025,
    "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training").

    ``loss = -sg(min(r, tis_cap)) * A * log pi_theta``: REINFORCE re-weighted by the ratio,
    truncated above so that no token's weight exceeds the cap (ROLL's default cap is 1). Under
    decoupled PPO the token's loss is also multiplied by the behaviour weight ``w``, so its total
    weight is ``w * min(pi_theta / pi_prox, tis_cap)``.
    """
    ratio = log_ratio.detach().exp()
    weight = ratio.clamp(max=cfg.tis_cap)
    return TokenLoss(loss=-weight * advantages * logprobs, clipped=ratio > cfg.tis_cap)


def topr_loss(
    logprobs: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor, cfg: LossSettings
) -> TokenLoss:
    """Tapered Off-Policy REINFORCE (Le Roux et al. 2025, "Tapered Off-Policy REINFORCE:
    Stable and efficient reinforcement learning for LLMs"); ROLL's ``topr``.

    ``loss = -w_pos * A * log pi_theta`` on positive tokens (SFT-like, no importance weight)
    and ``-w_neg * sg(clip(r, 0, 1)) * A * log pi_theta`` on the others (truncated IS).
    ROLL splits on the sign of the raw score; LossInputs carries advantages only, so the
    split here is ``A > 0``. With binary rewards and a group baseline the two agree.
    ``clipped`` marks the negative tokens whose ratio was truncated at 1. Under decoupled PPO
    both terms are also multiplied by the behaviour weight ``w`` (the positive one too).
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
    logprobs: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor, cfg: LossSettings
) -> TokenLoss:
    """Clipped IS-weight Policy Optimization (MiniMax 2025, "MiniMax-M1: Scaling Test-Time
    Compute Efficiently with Lightning Attention"); ROLL's ``cispo``.

    ``loss = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi_theta``: the importance
    weight is clipped instead of the update, so every token keeps a gradient (PPO drops the
    clipped ones, often the rare "reflection" tokens). Under decoupled PPO the token's loss is
    also multiplied by the behaviour weight ``w``.
    """
    ratio = log_ratio.detach().exp()
    low, high = 1.0 - cfg.cispo_eps_low, 1.0 + cfg.cispo_eps_high
    return TokenLoss(
        loss=-ratio.clamp(low, high) * advantages * logprobs,
        clipped=(ratio < low) | (ratio > high),
    )


def kimi15_loss(
    logprobs: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor, cfg: LossSettings
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


def _check_inputs(inputs: LossInputs, cfg: LossSettings) -> None:
    if inputs.logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [rows, tokens], got shape {tuple(inputs.logprobs.shape)}")
    for field in ("behaviour_logprobs", "advantages", "mask", "prox_logprobs", "ref_logprobs", "entropy", "kl"):
        tensor = getattr(inputs, field)
        if tensor is not None and tensor.shape != inputs.logprobs.shape:
            raise ValueError(f"{field} has shape {tuple(tensor.shape)}, logprobs {tuple(inputs.logprobs.shape)}")
    if cfg.decoupled and inputs.prox_logprobs is None:
        raise ValueError(
            "decoupled loss (algorithm.decoupled=True) needs prox_logprobs, the proximal "
            "policy's log-probs recomputed by the trainer, but got None; refusing to use a "
            "behaviour weight of 1. Recompute them, or set decoupled=False to anchor on the "
            "behaviour log-probs."
        )
    if cfg.kl_estimator == EXACT_KL:
        if inputs.kl is None:
            raise ValueError(
                "kl_estimator='exact' takes the KL the engine computed (LossInputs.kl), but got None; "
                "only engines that know their policy's distribution in closed form (the image workload) fill it"
            )
        if cfg.kl_importance_weight:
            raise ValueError("kl_importance_weight=True re-weights a sampled estimate; the exact KL is not one")
    elif cfg.kl_estimator is not None and cfg.kl_estimator not in KL_LOSS_ESTIMATORS:
        raise ValueError(
            f"kl_estimator={cfg.kl_estimator!r} cannot be a loss: its gradient is zero in expectation "
            f"(it belongs in the reward); a KL loss takes one of {sorted(KL_LOSS_ESTIMATORS)}"
        )
    if cfg.kl_estimator not in (None, EXACT_KL) and inputs.ref_logprobs is None:
        raise ValueError(
            f"KL penalty (kl_estimator={cfg.kl_estimator!r}) needs ref_logprobs from the "
            "reference model, but got None; compute them or set kl_estimator=None."
        )
    if cfg.kl_importance_weight and not cfg.decoupled:
        raise ValueError(
            "kl_importance_weight=True weights the KL term by the behaviour weight, which only "
            "the decoupled loss computes; set decoupled=True or kl_importance_weight=False."
        )


def _finite_inputs(inputs: LossInputs, cfg: LossSettings) -> torch.Tensor:
    """Bool per token: every detached log-prob the configured terms read is finite there."""
    finite = torch.isfinite(inputs.behaviour_logprobs)
    if cfg.decoupled:
        assert inputs.prox_logprobs is not None  # checked by _check_inputs
        finite &= torch.isfinite(inputs.prox_logprobs)
    if cfg.kl_estimator == EXACT_KL:
        assert inputs.kl is not None  # checked by _check_inputs
        finite &= torch.isfinite(inputs.kl.detach())
    elif cfg.kl_estimator is not None:
        assert inputs.ref_logprobs is not None  # checked by _check_inputs
        finite &= torch.isfinite(inputs.ref_logprobs)
    return finite


def compute_policy_loss(inputs: LossInputs, cfg: LossSettings) -> tuple[torch.Tensor, dict[str, float]]:
    """The scalar loss of one micro-batch and its metrics.

    ``loss = aggregate(w * policy_loss) + kl_coef * aggregate(kl(pi_theta, pi_ref))`` with
    ``w`` the corrected behaviour weight when decoupled (else 1 by configuration), over the
    scored tokens (real, finite inputs, ``|log pi_theta - log pi_anchor| <= 20``); with
    ``kl_importance_weight`` the KL term is ``w * pi_theta / pi_prox`` times the estimate, with
    the ratio's gradient (:func:`algorithms.kl.importance_weighted_kl`). With ``kl_estimator
    == EXACT_KL`` the KL term is the engine's exact per-action KL (``inputs.kl``) instead of an
    estimate from ``ref_logprobs`` (Flow-GRPO's closed form between Gaussian transitions).

    Metrics: ``loss``, ``pg_loss`` and ``kl_loss`` (with a KL estimator; the estimate before
    ``kl_coef``) aggregated as the loss is; token means over real tokens: ``clip_fraction`` (0
    for losses that do not clip), ``dual_clip_fraction`` (ppo with dual clip),
    ``nonfinite_fraction``, ``out_of_range_fraction`` (tokens never trained, see the module
    docstring), ``masked_fraction`` (tokens given weight 0 by the correction's band),
    ``kl_clamped_fraction`` (k3: tokens where verl's clamp left no KL gradient) and
    ``entropy_mean`` (with entropy); token means over scored tokens: ``ratio_mean`` (pi_theta /
    pi_anchor) and ``approx_kl_behaviour`` (k3 estimate of KL(pi_behav || pi_theta)); decoupled
    only, the behaviour weight's distribution from
    :func:`~algorithms.corrections.behaviour_weight_metrics`: ``behaviour_ratio_mean``,
    ``behaviour_ratio_max`` (combine micro-batches with max), ``importance_weight_mean`` (after
    the correction) and ``behaviour_weight_clamped_fraction``; where the engine marks the tokens
    its weights sampled (``inputs.fresh``), the training-inference mismatch on them:
    :func:`~algorithms.corrections.mismatch_metrics`.
    """
    _check_inputs(inputs, cfg)
    real = inputs.mask > 0
    usable = real & _finite_inputs(inputs, cfg)
    # Zero padding and non-finite inputs before any arithmetic: exp/log of garbage there would
    # otherwise leak NaN into the backward pass even through torch.where.
    logprobs = torch.where(usable, inputs.logprobs, 0.0)
    behaviour = torch.where(usable, inputs.behaviour_logprobs.detach(), 0.0)
    advantages = torch.where(usable, inputs.advantages.detach(), 0.0)

    metrics: dict[str, float] = {}
    weight: torch.Tensor | None = None
    if cfg.decoupled:
        assert inputs.prox_logprobs is not None  # checked by _check_inputs
        anchor = torch.where(usable, inputs.prox_logprobs.detach(), 0.0)
        corrected = behaviour_importance_weights(
            anchor,
            behaviour,
            usable,
            level=cfg.behaviour_weight_level,
            mode=cfg.behaviour_weight_mode,
            cap=cfg.behaviour_weight_cap,
            floor=cfg.behaviour_weight_floor,
        )
        weight = corrected.weight
        metrics.update(behaviour_weight_metrics(corrected, inputs.mask))
    else:
        anchor = behaviour
        metrics["masked_fraction"] = 0.0

    raw_log_ratio = logprobs - anchor
    out_of_range = usable & (raw_log_ratio.detach().abs() > MAX_LOG_RATIO)
    scored = usable & ~out_of_range
    log_ratio = torch.where(out_of_range, 0.0, raw_log_ratio)
    token = get_policy_loss(cfg.loss)(logprobs, log_ratio, advantages, cfg)
    per_token = token.loss if weight is None else token.loss * weight
    pg_loss = aggregate_loss(torch.where(scored, per_token, 0.0), real, cfg.aggregation)
    loss = pg_loss

    if cfg.kl_estimator == EXACT_KL:
        assert inputs.kl is not None  # checked by _check_inputs
        kl_loss = aggregate_loss(torch.where(scored, inputs.kl, 0.0), real, cfg.aggregation)
        loss = loss + cfg.kl_coef * kl_loss
        metrics["kl_loss"] = kl_loss.item()
    elif cfg.kl_estimator is not None:
        assert inputs.ref_logprobs is not None  # checked by _check_inputs
        ref = torch.where(usable, inputs.ref_logprobs.detach(), 0.0)
        kl = compute_kl(cfg.kl_estimator, logprobs, ref)
        if cfg.kl_importance_weight:
            assert weight is not None  # decoupled, checked by _check_inputs
            kl = importance_weighted_kl(kl, logprobs, weight * log_ratio.detach().exp())
        kl_loss = aggregate_loss(torch.where(scored, kl, 0.0), real, cfg.aggregation)
        loss = loss + cfg.kl_coef * kl_loss
        metrics["kl_loss"] = kl_loss.item()
        if cfg.kl_estimator == "k3":
            metrics["kl_clamped_fraction"] = _token_mean(scored & k3_clamped(logprobs, ref), real)

    metrics["loss"] = loss.item()
    metrics["pg_loss"] = pg_loss.item()
    metrics["clip_fraction"] = _token_mean(scored & token.clipped, real)
    if token.dual_clipped is not None:
        metrics["dual_clip_fraction"] = _token_mean(scored & token.dual_clipped, real)
    metrics["ratio_mean"] = _token_mean(log_ratio.exp(), scored)
    # Tokens were sampled from pi_behav, so k3 with pi_behav as "q" is an unbiased estimate.
    metrics["approx_kl_behaviour"] = _token_mean(kl_k3(behaviour, logprobs.detach()), scored)
    metrics["nonfinite_fraction"] = _token_mean(real & ~usable, real)
    metrics["out_of_range_fraction"] = _token_mean(out_of_range, real)
    if inputs.entropy is not None:
        metrics["entropy_mean"] = _token_mean(inputs.entropy, real)
    if inputs.fresh is not None:
        metrics.update(mismatch_metrics(behaviour, logprobs.detach(), (inputs.fresh > 0) & usable))
    return loss, metrics
