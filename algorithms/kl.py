"""Per-token KL estimators between the current policy and a reference policy.

Owns the three Monte-Carlo estimators of John Schulman's note "Approximating KL divergence"
(2020, http://joschu.net/blog/kl-approx.html). With tokens sampled from the policy ``q`` whose
log-probs are ``logprobs`` and ``p`` the reference (``ref_logprobs``), write
``log r = log p(x) - log q(x)``; then KL(q || p) is estimated per token by

- ``k1 = -log r``               unbiased, high variance, can be negative;
- ``k2 = (log r)^2 / 2``        biased, low variance, never negative;
- ``k3 = (r - 1) - log r``      unbiased, low variance, never negative (GRPO's choice).

Invariants: every estimator is elementwise (same shape in, same shape out), differentiable
w.r.t. ``logprobs``, and exactly 0 where the two log-probs are equal. Masking and
aggregation belong to the caller (:mod:`algorithms.losses`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# exp(20) ~ 4.9e8: beyond it the estimate is meaningless anyway, and the clamp keeps exp()
# finite so one wild token cannot turn the whole loss (and its gradient) into inf/NaN.
_MAX_LOG_RATIO = 20.0


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = log q - log p: the plain log-ratio (Schulman 2020)."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = (log p - log q)^2 / 2 (Schulman 2020)."""
    return 0.5 * (ref_logprobs - logprobs).square()


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = exp(log p - log q) - 1 - (log p - log q) (Schulman 2020; DeepSeekMath's GRPO KL)."""
    log_ratio = (ref_logprobs - logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.expm1(log_ratio) - log_ratio


KL_ESTIMATORS: dict[str, KLEstimator] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def get_kl_estimator(name: str) -> KLEstimator:
    """The estimator registered as ``name``; a ValueError lists the allowed names otherwise."""
    try:
        return KL_ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown KL estimator {name!r}; allowed: {sorted(KL_ESTIMATORS)}"
        ) from None


def compute_kl(name: str, logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(q || p) estimate with the estimator registered as ``name``."""
    return get_kl_estimator(name)(logprobs, ref_logprobs)
