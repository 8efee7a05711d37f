"""Per-token KL estimators between the current policy and a reference policy, and what their
gradients are when they are used as a loss.

Owns the three Monte-Carlo estimators of John Schulman's note "Approximating KL divergence"
(2020, http://joschu.net/blog/kl-approx.html) and the importance weighting that makes them
right off-policy (DeepSeek-AI 2025, "DeepSeek-V3.2", section "Unbiased KL Estimate").

Notation, per sampled token ``x``: ``q = pi_theta`` (log-probs ``logprobs``, the only input that
carries gradient), ``p = pi_ref`` (``ref_logprobs``), ``l = log q(x) - log p(x)``, ``s = grad log q(x)``
(the score; ``E_q[s] = 0``). The true gradients are ``grad KL(q || p) = E_q[l s]`` (reverse KL,
the penalty we mean) and ``grad KL(p || q) = -E_p[s]`` (forward KL).

============  ===================  ==========================  ===========================
estimator      value, E_q[k]        E_q[grad k] (tokens ~ q)    with importance weighting
============  ===================  ==========================  ===========================
k1 = l         KL(q||p), unbiased   0: regularises nothing      grad KL(q||p), high variance
k2 = l^2 / 2   ~KL, biased, >= 0    grad KL(q||p)               grad E_q[k2] (biased)
k3 = e^-l-1+l  KL(q||p), unbiased   grad KL(p||q): forward KL   grad KL(q||p)
============  ===================  ==========================  ===========================

So on-policy, **k1 belongs in the reward** (``r_t - beta * k1_t``, whose score-function gradient
through the advantage is the reverse KL's), never in the loss: as a loss its gradient is
``s``, zero in expectation. **k2** is the estimator whose gradient is the reverse KL's.
**k3** (GRPO's choice) estimates the reverse KL's *value* but its gradient is the *forward*
KL's, ``E_q[(1 - p/q) s] = -E_p[s]``; it is also unbounded: ``p/q = e^15`` gives about 3.3e6.
:data:`KL_LOSS_ESTIMATORS` names the estimators a config may put in the loss.

Off-policy the tokens come from ``mu = pi_behav``, not ``q``, and none of the middle column
holds. :func:`importance_weighted_kl` multiplies ``k`` by ``rho = q / mu`` whose *value* is given
(capped by the caller) and whose *gradient* is ``rho * s``; then
``E_mu[grad(rho k)] = E_q[s k + grad k] = grad E_q[k]``: the reverse KL's gradient for the
unbiased k1 and k3 at any staleness (and, on-policy where ``rho = 1``, k3's gradient becomes
``l s``, the reverse KL's, per token). Why not a stop-gradient weight: ``E_mu[sg(rho) grad k3] =
E_q[grad k3]`` keeps k3's forward-KL gradient; only k2 would be right, with the same per-token
gradient ``rho l s`` that the weighted k3 gives, but with k2's biased value.

Clamps, made explicit (verl's ``kl_penalty``, ``low_var_kl``): k3's log-ratio is clamped to
``+-`` :data:`MAX_LOG_RATIO` so ``exp`` stays finite, and its value to at most :data:`K3_MAX`
(10). Past the clamp the gradient is zero: for ``log p - log q > 2.61`` (the reference is
13.6 times likelier than the policy on that token) and for ``log q - log p > 11``. k1 and k2 are
not clamped (verl does not either). Callers count clamped tokens (:func:`k3_clamped`).

Invariants: every estimator is elementwise (same shape in, same shape out), differentiable
w.r.t. ``logprobs`` and exactly 0 where the two log-probs are equal. Masking and aggregation
belong to the caller (:mod:`algorithms.losses`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "K3_MAX",
    "KL_ESTIMATORS",
    "KL_LOSS_ESTIMATORS",
    "MAX_LOG_RATIO",
    "KLEstimator",
    "compute_kl",
    "get_kl_estimator",
    "importance_weighted_kl",
    "k3_clamped",
    "kl_k1",
    "kl_k2",
    "kl_k3",
]

KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# exp(20) ~ 4.9e8: beyond it the estimate is meaningless anyway, and the clamp keeps exp()
# finite so one wild token cannot turn the whole loss (and its gradient) into inf/NaN.
MAX_LOG_RATIO = 20.0
# verl clamps its low-variance KL (k3) to [-10, 10]; k3 >= 0, so only the upper bound acts.
K3_MAX = 10.0


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = log q - log p (Schulman 2020). Unbiased value; as a loss its gradient is the score
    ``grad log q``, zero in expectation on-policy: use it in the reward, not the loss."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = (log p - log q)^2 / 2 (Schulman 2020). Biased value, but its on-policy expected
    gradient ``E_q[(log q - log p) grad log q]`` is exactly the reverse KL's."""
    return 0.5 * (ref_logprobs - logprobs).square()


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = exp(log p - log q) - 1 - (log p - log q) (Schulman 2020; DeepSeekMath's GRPO KL),
    clamped as verl's ``low_var_kl``: log-ratio to +-MAX_LOG_RATIO, value to at most K3_MAX.

    Unbiased, low-variance value of KL(q || p); its on-policy expected gradient is the forward
    KL's, ``E_q[(1 - p/q) grad log q] = grad KL(p || q)``, unless importance weighted."""
    log_ratio = (ref_logprobs - logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return (torch.expm1(log_ratio) - log_ratio).clamp(max=K3_MAX)


def k3_clamped(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Bool per token: k3 hit a clamp there, so the token's k3 gradient is zero."""
    log_ratio = (ref_logprobs - logprobs).detach()
    return (log_ratio.abs() > MAX_LOG_RATIO) | (torch.expm1(log_ratio) - log_ratio >= K3_MAX)


def importance_weighted_kl(kl: torch.Tensor, logprobs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``rho * kl`` with ``rho = pi_theta / pi_behav`` (DeepSeek-V3.2's unbiased KL estimate).

    ``weight`` is rho's *value*, already capped or masked by the caller (it is detached here);
    the factor ``exp(log q - sg(log q))`` (1 in value) gives rho its gradient ``rho * grad log q``.
    Expected gradient over tokens from pi_behav: ``grad E_q[kl]``, the reverse KL's for k1 and k3
    wherever the weight is not capped (see the module docstring)."""
    return weight.detach() * torch.exp(logprobs - logprobs.detach()) * kl


KL_ESTIMATORS: dict[str, KLEstimator] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}
# The estimators a KL *loss* may use: k1's gradient is zero in expectation (it belongs in the
# reward). k2 gives the reverse KL's gradient on-policy; k3 the reverse KL's when importance
# weighted, the forward KL's otherwise (documented above; a config may still choose it).
KL_LOSS_ESTIMATORS: frozenset[str] = frozenset({"k2", "k3"})


def get_kl_estimator(name: str) -> KLEstimator:
    """The estimator registered as ``name``; a ValueError lists the allowed names otherwise."""
    try:
        return KL_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown KL estimator {name!r}; allowed: {sorted(KL_ESTIMATORS)}") from None


def compute_kl(name: str, logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(q || p) estimate with the estimator registered as ``name``."""
    return get_kl_estimator(name)(logprobs, ref_logprobs)
