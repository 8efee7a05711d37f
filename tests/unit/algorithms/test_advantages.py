"""Advantage estimators against hand-computed values, plus their invariants as properties."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    grpo_advantages,
    reinforce_advantages,
    rloo_advantages,
)


def _lists(advantages: list[np.ndarray]) -> list[list[float]]:
    return [a.tolist() for a in advantages]


def test_grpo_normalises_by_the_unbiased_std() -> None:
    # mean 0.5, deviations +-0.5, unbiased std sqrt(1/3) = 0.5773503;
    # 0.5 / (0.5773503 + 1e-6) = 0.8660239.
    (adv,) = grpo_advantages([[1.0, 0.0, 0.0, 1.0]])
    assert adv.tolist() == pytest.approx([0.8660239, -0.8660239, -0.8660239, 0.8660239], abs=1e-6)


def test_grpo_without_std_is_mean_centred() -> None:
    # mean 2: deviations [1, -1, 0], left unscaled (Dr. GRPO).
    (adv,) = grpo_advantages([[3.0, 1.0, 2.0]], normalize_std=False)
    assert adv.tolist() == [1.0, -1.0, 0.0]


def test_grpo_std_of_one_leaves_deviations_up_to_eps() -> None:
    # deviations [1, -1, 0], unbiased std sqrt(2 / 2) = 1: 1 / (1 + 1e-6) = 0.999999.
    (adv,) = grpo_advantages([[3.0, 1.0, 2.0]])
    assert adv.tolist() == pytest.approx([0.999999, -0.999999, 0.0], abs=1e-7)


@pytest.mark.parametrize("normalize_std", [True, False])
def test_grpo_group_of_equal_rewards_gets_exact_zeros(normalize_std: bool) -> None:
    # 0.1 is not exact in float32; the mean could differ from it by an ulp, which divided by
    # eps would invent an advantage. Equal rewards must give exact zeros instead.
    equal, single = grpo_advantages(
        [np.full(3, 0.1, dtype=np.float32), [0.7]], normalize_std=normalize_std
    )
    assert equal.tolist() == [0.0, 0.0, 0.0]
    assert single.tolist() == [0.0]


def test_grpo_groups_are_independent() -> None:
    a, b = grpo_advantages([[1.0, 0.0], [5.0, 5.0, 5.0]], normalize_std=False)
    assert a.tolist() == [0.5, -0.5]
    assert b.tolist() == [0.0, 0.0, 0.0]


def test_rloo_uses_the_mean_of_the_other_samples() -> None:
    # [1, 0, 0, 1]: a 1 sees baseline (0 + 0 + 1) / 3 -> 2/3; a 0 sees 2/3 -> -2/3.
    # [3, 1, 2]: 3 - 1.5 = 1.5, 1 - 2.5 = -1.5, 2 - 2 = 0.
    first, second = rloo_advantages([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0]])
    assert first.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    assert second.tolist() == pytest.approx([1.5, -1.5, 0.0])


def test_rloo_equal_rewards_give_zeros_and_one_sample_is_refused() -> None:
    (adv,) = rloo_advantages([[0.3, 0.3]])
    assert adv.tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="at least 2"):
        rloo_advantages([[1.0]])


def test_reinforce_baseline_is_the_batch_mean() -> None:
    # batch mean over all four samples: (1 + 0 + 1 + 1) / 4 = 0.75.
    a, b = reinforce_advantages([[1.0, 0.0], [1.0, 1.0]])
    assert a.tolist() == [0.25, -0.75]
    assert b.tolist() == [0.25, 0.25]
    assert reinforce_advantages([]) == []


def test_dispatch_forwards_options_and_rejects_unknown_names() -> None:
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "rloo", "reinforce"}
    grpo = compute_advantages("grpo", [[3, 1, 2]], normalize_std=False)
    assert _lists(grpo) == [[1.0, -1.0, 0.0]]
    assert _lists(compute_advantages("rloo", [[3, 1, 2]])) == [[1.5, -1.5, 0.0]]
    with pytest.raises(ValueError, match=r"'gae'.*\['grpo', 'reinforce', 'rloo'\]"):
        compute_advantages("gae", [[1.0, 0.0]])
    with pytest.raises(TypeError):
        compute_advantages("rloo", [[1.0, 0.0]], normalize_std=False)


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce"])
def test_bad_rewards_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="finite"):
        compute_advantages(name, [[1.0, float("nan")]])
    with pytest.raises(ValueError, match="non-empty 1-D"):
        compute_advantages(name, [[]])


def test_inputs_are_not_modified() -> None:
    rewards = np.array([1.0, 0.0, 1.0])
    grpo_advantages([rewards])
    rloo_advantages([rewards])
    assert rewards.tolist() == [1.0, 0.0, 1.0]


_groups = st.lists(
    st.lists(st.floats(-10, 10, allow_nan=False), min_size=2, max_size=8), min_size=1, max_size=4
)


@settings(max_examples=60, deadline=None)
@given(_groups, st.booleans())
def test_grpo_advantages_sum_to_zero_per_group(
    groups: list[list[float]], normalize_std: bool
) -> None:
    for adv in grpo_advantages(groups, normalize_std=normalize_std):
        assert np.isfinite(adv).all()
        assert abs(adv.sum().item()) < 1e-3


@settings(max_examples=60, deadline=None)
@given(_groups)
def test_rloo_sums_to_zero_per_group_and_reinforce_over_the_batch(
    groups: list[list[float]],
) -> None:
    for adv in rloo_advantages(groups):
        assert abs(adv.sum().item()) < 1e-3
    assert abs(np.concatenate(reinforce_advantages(groups)).sum()) < 1e-3
