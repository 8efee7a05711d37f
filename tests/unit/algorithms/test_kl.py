"""KL estimators (Schulman 2020) against hand-computed values, and the gradients they give as a
loss against the true KL gradients on a small categorical distribution.

With d = ref - logprobs per token: k1 = -d, k2 = d^2 / 2, k3 = e^d - 1 - d (clamped at 10).
Expected gradients are exact: a sum over the support weighted by the sampling probabilities
(held constant, as sampling is), not a Monte-Carlo estimate.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.algorithms.kl import (
    K3_MAX,
    KL_ESTIMATORS,
    KL_LOSS_ESTIMATORS,
    compute_kl,
    get_kl_estimator,
    importance_weighted_kl,
    k3_clamped,
    kl_k1,
    kl_k2,
    kl_k3,
)

# logprobs [-0.5, -1.0] against ref [-1.0, -0.5]: d = [-0.5, +0.5].
LOGPROBS = [-0.5, -1.0]
REF = [-1.0, -0.5]


def _value_and_grad(estimator, logprobs=LOGPROBS, ref=REF):
    lp = torch.tensor(logprobs, requires_grad=True)
    value = estimator(lp, torch.tensor(ref))
    value.sum().backward()
    return value.detach(), lp.grad


@pytest.mark.parametrize(
    ("estimator", "expected_value", "expected_grad"),
    [
        # k1 = logprobs - ref; d k1 / d logprobs = 1.
        (kl_k1, [0.5, -0.5], [1.0, 1.0]),
        # k2 = 0.5 * 0.25 = 0.125 on both; grad = logprobs - ref.
        (kl_k2, [0.125, 0.125], [0.5, -0.5]),
        # k3: e^-0.5 - 1 + 0.5 = 0.1065307, e^0.5 - 1 - 0.5 = 0.1487213; grad = 1 - e^d.
        (kl_k3, [0.10653066, 0.14872127], [0.39346934, -0.64872127]),
    ],
)
def test_estimators_match_hand_values(estimator, expected_value, expected_grad) -> None:
    value, grad = _value_and_grad(estimator)
    torch.testing.assert_close(value, torch.tensor(expected_value))
    torch.testing.assert_close(grad, torch.tensor(expected_grad))


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
def test_equal_policies_have_zero_kl(name: str) -> None:
    lp = torch.tensor([[-0.3, -2.0], [-5.0, 0.0]])
    assert torch.equal(compute_kl(name, lp, lp.clone()), torch.zeros(2, 2))


def test_k3_stays_finite_for_a_huge_gap() -> None:
    value = kl_k3(torch.tensor([-1000.0]), torch.tensor([0.0]))
    assert torch.isfinite(value).all()


def test_registry_and_unknown_name() -> None:
    assert KL_ESTIMATORS == {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}
    with pytest.raises(ValueError, match=r"'k4'.*\['k1', 'k2', 'k3'\]"):
        get_kl_estimator("k4")


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(-10, 0), st.floats(-10, 0)), min_size=1, max_size=8
    )
)
def test_k2_and_k3_are_never_negative(pairs: list[tuple[float, float]]) -> None:
    lp = torch.tensor([p for p, _ in pairs], dtype=torch.float64)
    ref = torch.tensor([q for _, q in pairs], dtype=torch.float64)
    assert (kl_k2(lp, ref) >= 0).all()
    assert (kl_k3(lp, ref) >= 0).all()


# ------------------------------------------------------------------ the clamp (verl's low_var_kl)


@pytest.mark.parametrize(
    ("logprob", "ref", "expected_value", "expected_grad", "clamped"),
    [
        # d = 2: e^2 - 3 = 4.3890561 under the clamp; grad 1 - e^2.
        (-2.0, 0.0, 4.3890561, -6.3890561, False),
        # d = 3: e^3 - 4 = 16.09 is clamped to 10, and the clamp leaves no gradient.
        (-3.0, 0.0, 10.0, 0.0, True),
        # d = 15 (the finding): unclamped e^15 - 16 ~ 3.27e6; clamped to 10.
        (-15.0, 0.0, 10.0, 0.0, True),
        # d = -11.5 (the policy e^11.5 times likelier than the reference): -1 + 11.5 > 10.
        (-0.5, -12.0, 10.0, 0.0, True),
        # d = -10: e^-10 - 1 + 10 = 9.0000454 stays; grad 1 - e^-10.
        (-0.5, -10.5, 9.0000454, 0.9999546, False),
    ],
)
def test_k3_is_clamped_at_ten_as_verl_does(
    logprob: float, ref: float, expected_value: float, expected_grad: float, clamped: bool
) -> None:
    value, grad = _value_and_grad(kl_k3, [logprob], [ref])
    assert value.item() == pytest.approx(expected_value, rel=1e-6)
    assert grad.item() == pytest.approx(expected_grad, rel=1e-6, abs=1e-9)
    assert k3_clamped(torch.tensor([logprob]), torch.tensor([ref])).item() is clamped
    assert K3_MAX == 10.0


def test_k1_is_not_a_loss_estimator() -> None:
    assert KL_LOSS_ESTIMATORS == {"k2", "k3"}
    assert set(KL_LOSS_ESTIMATORS) < set(KL_ESTIMATORS)


# ------------------------------------------- expected gradients on a categorical distribution

# q = softmax(THETA) is the policy (gradient w.r.t. THETA), p = pi_ref, mu = pi_behav. Their
# log-ratios stay far inside the clamps, so the estimators are the plain formulas here.
THETA = [0.3, -0.2, 1.0, 0.1, -0.5]
REF_LOGITS = [0.0, 0.4, 0.2, -0.3, 0.5]
BEHAV_LOGITS = [-0.4, 0.1, 0.6, 0.3, 0.0]


def _log_softmax(logits: list[float]) -> torch.Tensor:
    return torch.log_softmax(torch.tensor(logits, dtype=torch.float64), dim=0)


def _grad(objective) -> torch.Tensor:
    theta = torch.tensor(THETA, dtype=torch.float64, requires_grad=True)
    objective(torch.log_softmax(theta, dim=0)).backward()
    assert theta.grad is not None
    return theta.grad


def reverse_kl_grad() -> torch.Tensor:
    """grad KL(q || p) = grad sum_x q(x) (log q(x) - log p(x))."""
    log_p = _log_softmax(REF_LOGITS)
    return _grad(lambda log_q: (log_q.exp() * (log_q - log_p)).sum())


def forward_kl_grad() -> torch.Tensor:
    """grad KL(p || q) = grad sum_x p(x) (log p(x) - log q(x))."""
    log_p = _log_softmax(REF_LOGITS)
    return _grad(lambda log_q: (log_p.exp() * (log_p - log_q)).sum())


def expected_loss_grad(name: str, sampling: str, *, weighted: bool = False) -> torch.Tensor:
    """E_{x ~ sampling}[grad loss(x)], exactly: sum_x P(x) grad loss(x) with P held constant.

    ``sampling`` is "q" (on-policy) or "mu" (off-policy); ``weighted`` multiplies each token's
    estimate by rho = q / mu as :func:`importance_weighted_kl` does (value given, ratio's gradient)."""
    log_p = _log_softmax(REF_LOGITS)
    log_mu = _log_softmax(BEHAV_LOGITS)

    def objective(log_q: torch.Tensor) -> torch.Tensor:
        log_sampling = (log_q if sampling == "q" else log_mu).detach()
        per_token = compute_kl(name, log_q, log_p)
        if weighted:
            per_token = importance_weighted_kl(per_token, log_q, (log_q.detach() - log_sampling).exp())
        return (log_sampling.exp() * per_token).sum()

    return _grad(objective)


def test_the_reverse_and_forward_kl_gradients_differ_here() -> None:
    # Otherwise the tests below could not tell the two apart.
    assert (reverse_kl_grad() - forward_kl_grad()).abs().max() > 0.05


def test_k1_as_a_loss_has_zero_expected_gradient_on_policy() -> None:
    torch.testing.assert_close(expected_loss_grad("k1", "q"), torch.zeros(5, dtype=torch.float64))


def test_k2_gives_the_reverse_kl_gradient_on_policy() -> None:
    torch.testing.assert_close(expected_loss_grad("k2", "q"), reverse_kl_grad())


def test_k3_gives_the_forward_kl_gradient_on_policy() -> None:
    torch.testing.assert_close(expected_loss_grad("k3", "q"), forward_kl_grad())


def test_off_policy_tokens_bias_the_unweighted_k2_gradient() -> None:
    assert (expected_loss_grad("k2", "mu") - reverse_kl_grad()).abs().max() > 0.01


@pytest.mark.parametrize("sampling", ["q", "mu"])
@pytest.mark.parametrize("name", ["k1", "k3"])
def test_importance_weighting_gives_the_reverse_kl_gradient(name: str, sampling: str) -> None:
    # DeepSeek-V3.2: E_mu[grad(rho k)] = grad E_q[k] = grad KL(q || p) for the unbiased estimators,
    # off-policy and on-policy alike (on-policy rho = 1 in value, but its gradient fixes k3's).
    torch.testing.assert_close(expected_loss_grad(name, sampling, weighted=True), reverse_kl_grad())


def test_importance_weighted_k2_differentiates_its_own_biased_expectation() -> None:
    log_p = _log_softmax(REF_LOGITS)
    expected = _grad(lambda log_q: (log_q.exp() * kl_k2(log_q, log_p)).sum())
    torch.testing.assert_close(expected_loss_grad("k2", "mu", weighted=True), expected)


@pytest.mark.parametrize("name", ["k1", "k3"])
def test_importance_weighting_makes_the_value_unbiased_off_policy(name: str) -> None:
    log_q = _log_softmax(THETA)
    log_p = _log_softmax(REF_LOGITS)
    log_mu = _log_softmax(BEHAV_LOGITS)
    weighted = importance_weighted_kl(compute_kl(name, log_q, log_p), log_q, (log_q - log_mu).exp())
    true_kl = (log_q.exp() * (log_q - log_p)).sum()
    assert (log_mu.exp() * weighted).sum().item() == pytest.approx(true_kl.item(), rel=1e-12)


def test_importance_weighted_k3_gradient_per_token_is_rho_times_the_log_ratio() -> None:
    # d/d log q of rho * k3 = rho (k3 + 1 - p/q) = rho (log q - log p): k2's gradient, weighted.
    # log q = [-0.5, -1.0], log p = [-1.0, -0.5], rho = [2, 0.5].
    lp = torch.tensor([-0.5, -1.0], requires_grad=True)
    weighted = importance_weighted_kl(kl_k3(lp, torch.tensor([-1.0, -0.5])), lp, torch.tensor([2.0, 0.5]))
    weighted.sum().backward()
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, torch.tensor([2.0 * 0.5, 0.5 * -0.5]))
    torch.testing.assert_close(weighted.detach(), torch.tensor([2.0 * 0.10653066, 0.5 * 0.14872127]))
