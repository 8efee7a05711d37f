"""KL estimators (Schulman 2020) against hand-computed values.

With d = ref - logprobs per token: k1 = -d, k2 = d^2 / 2, k3 = e^d - 1 - d.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from algorithms.kl import KL_ESTIMATORS, compute_kl, get_kl_estimator, kl_k1, kl_k2, kl_k3

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
