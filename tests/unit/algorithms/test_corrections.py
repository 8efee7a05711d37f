"""Mismatch corrections against hand-computed values: the specification of algorithms.corrections.

Log-probs are built from the ratios rho = pi_target / pi_behav they should realise. Two rows:

    row 0:  rho = [2, 100 (environment token, mask 0), 1.5, 0.25]
    row 1:  rho = [4, 1, pad, pad]

so row 0's real tokens multiply to 2 * 1.5 * 0.25 = 0.75 (geometric mean 0.75^(1/3)) and row 1's
to 4 (geometric mean 2). The environment token's 100 and the padding must never count.
"""

from __future__ import annotations

import math

import pytest
import torch

from tandem.algorithms.corrections import (
    CORRECTION_LEVELS,
    CORRECTION_MODES,
    behaviour_importance_weights,
    behaviour_weight_metrics,
    mismatch_metrics,
)
from tandem.algorithms.metrics import accumulate_metrics, combine_optimizer_steps, merge_metric_sums

RATIOS = [[2.0, 100.0, 1.5, 0.25], [4.0, 1.0, 50.0, 50.0]]
MASK = torch.tensor([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
BEHAVIOUR = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-2.0, -1.0, -1.0, -1.0]])
GEO0 = 0.75 ** (1 / 3)


def target(ratios: list[list[float]] = RATIOS) -> torch.Tensor:
    return BEHAVIOUR + torch.log(torch.tensor(ratios))


def weights(**kwargs: object) -> list[list[float]]:
    options = {"cap": 3.0} | kwargs
    return behaviour_importance_weights(target(), BEHAVIOUR, MASK, **options).weight.tolist()  # type: ignore[arg-type]


def assert_close(actual: list[list[float]], expected: list[list[float]]) -> None:
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        # AReaL's decoupled weight: tokens above the cap get 0, the rest keep rho.
        ({"level": "token", "mode": "mask"}, [[2.0, 0.0, 1.5, 0.25], [0.0, 1.0, 0.0, 0.0]]),
        # Truncated IS per token: min(rho, cap).
        ({"level": "token", "mode": "clamp"}, [[2.0, 0.0, 1.5, 0.25], [3.0, 1.0, 0.0, 0.0]]),
        # IcePop: a two-sided band [0.5, 3]; 0.25 and 4 leave it.
        ({"level": "token", "mode": "mask", "floor": 0.5}, [[2.0, 0.0, 1.5, 0.0], [0.0, 1.0, 0.0, 0.0]]),
        # Truncation into [0.5, 3]: slime's "clip" mode.
        ({"level": "token", "mode": "clamp", "floor": 0.5}, [[2.0, 0.0, 1.5, 0.5], [3.0, 1.0, 0.0, 0.0]]),
        # Sequence product: row 0 = 0.75 for every real token, row 1 = 4 > cap, masked whole.
        ({"level": "sequence", "mode": "mask"}, [[0.75, 0.0, 0.75, 0.75], [0.0, 0.0, 0.0, 0.0]]),
        ({"level": "sequence", "mode": "clamp"}, [[0.75, 0.0, 0.75, 0.75], [3.0, 3.0, 0.0, 0.0]]),
        # Geometric mean: row 0 = 0.75^(1/3) ~ 0.9086, row 1 = 2, both inside [0.5, 3].
        ({"level": "geometric", "mode": "mask", "floor": 0.5}, [[GEO0, 0.0, GEO0, GEO0], [2.0, 2.0, 0.0, 0.0]]),
        # A tight geometric band (verl suggests 1.0001-1.001 on real models) masks both rows.
        ({"level": "geometric", "mode": "mask", "cap": 1.5, "floor": 0.95}, [[0.0] * 4, [0.0] * 4]),
    ],
)
def test_weights_by_level_mode_and_band(options: dict[str, object], expected: list[list[float]]) -> None:
    assert_close(weights(**options), expected)


def test_what_each_token_was_flagged_with() -> None:
    masked = behaviour_importance_weights(target(), BEHAVIOUR, MASK, cap=3.0, floor=0.5)
    assert masked.masked.tolist() == [[False, False, False, True], [True, False, False, False]]
    assert not masked.clamped.any()
    assert masked.valid.tolist() == (MASK > 0).tolist()
    # The raw ratio before the band, 0 where nothing counts.
    assert_close(masked.ratio.tolist(), [[2.0, 0.0, 1.5, 0.25], [4.0, 1.0, 0.0, 0.0]])

    clamped = behaviour_importance_weights(target(), BEHAVIOUR, MASK, level="sequence", mode="clamp", cap=3.0)
    assert clamped.clamped.tolist() == [[False, False, False, False], [True, True, False, False]]
    assert not clamped.masked.any()


def test_metrics_of_the_ratio_distribution() -> None:
    # Token mask, band [0.5, 3]: ratios over the 5 real tokens 2, 1.5, 0.25, 4, 1 (mean 1.75, max 4);
    # weights 2, 1.5, 0, 0, 1 (mean 0.9); 2 of 5 masked.
    result = behaviour_importance_weights(target(), BEHAVIOUR, MASK, cap=3.0, floor=0.5)
    assert behaviour_weight_metrics(result, MASK) == pytest.approx(
        {
            "behaviour_ratio_mean": 1.75,
            "behaviour_ratio_max": 4.0,
            "importance_weight_mean": 0.9,
            "behaviour_weight_clamped_fraction": 0.0,
            "masked_fraction": 0.4,
        }
    )
    # Sequence truncation: ratios 0.75 x3, 4 x2 (mean 2.05); weights 0.75 x3, 3 x2 (mean 1.65).
    result = behaviour_importance_weights(target(), BEHAVIOUR, MASK, level="sequence", mode="clamp", cap=3.0)
    metrics = behaviour_weight_metrics(result, MASK)
    assert metrics["behaviour_ratio_mean"] == pytest.approx(2.05)
    assert metrics["importance_weight_mean"] == pytest.approx(1.65)
    assert metrics["behaviour_weight_clamped_fraction"] == pytest.approx(0.4)


def test_a_non_finite_log_ratio_is_masked_and_left_out_of_the_sequence() -> None:
    # -inf - (-inf) is NaN, and NaN > cap is False: a plain "w > cap" mask would keep it.
    tgt, behav = target(), BEHAVIOUR.clone()
    tgt[0, 2] = behav[0, 2] = float("-inf")
    for level in CORRECTION_LEVELS:
        for mode in CORRECTION_MODES:
            result = behaviour_importance_weights(tgt, behav, MASK, level=level, mode=mode, cap=3.0)
            assert torch.isfinite(result.weight).all()
            assert result.weight[0, 2] == 0.0 and not result.valid[0, 2]
    # Row 0's product is over the finite tokens only: 2 * 0.25 = 0.5.
    result = behaviour_importance_weights(tgt, behav, MASK, level="sequence", mode="mask", cap=3.0)
    assert_close(result.weight.tolist(), [[0.5, 0.0, 0.0, 0.5], [0.0, 0.0, 0.0, 0.0]])


def test_padding_and_environment_tokens_never_count_even_when_they_hold_garbage() -> None:
    clean = behaviour_importance_weights(target(), BEHAVIOUR, MASK, level="sequence", mode="clamp", cap=3.0)
    tgt, behav = target(), BEHAVIOUR.clone()
    tgt[0, 1], behav[1, 2], tgt[1, 3] = float("nan"), float("-inf"), float("inf")
    dirty = behaviour_importance_weights(tgt, behav, MASK, level="sequence", mode="clamp", cap=3.0)
    for field in ("weight", "ratio", "valid", "clamped", "masked"):
        assert torch.equal(getattr(dirty, field), getattr(clean, field)), field


def test_band_decisions_use_the_unclamped_log_ratio() -> None:
    # A sequence log-ratio of 30 is exponentiated at the safety bound e^20 ~ 4.9e8, below a cap
    # of 1e10, yet e^30 ~ 1.1e13 is above it: the sequence is masked all the same.
    behav = torch.zeros(1, 3)
    tgt = torch.tensor([[10.0, 10.0, 10.0]])
    result = behaviour_importance_weights(tgt, behav, torch.ones(1, 3), level="sequence", cap=1e10)
    assert result.masked.all() and (result.weight == 0).all()
    assert result.ratio[0, 0].item() == pytest.approx(math.exp(20.0), rel=1e-6)


def test_the_weight_is_data() -> None:
    tgt = target().requires_grad_()
    result = behaviour_importance_weights(tgt, BEHAVIOUR, MASK, level="geometric", mode="clamp", cap=3.0)
    assert not result.weight.requires_grad and not result.ratio.requires_grad


@pytest.mark.parametrize(
    "bad",
    [
        {"level": "episode"},
        {"mode": "drop"},
        {"cap": 0.0},
        {"floor": 0.0},
        {"floor": 4.0},  # above the cap of 3
    ],
)
def test_invalid_settings_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        weights(**bad)


def test_a_micro_batch_without_real_tokens_gives_zero_metrics() -> None:
    result = behaviour_importance_weights(target(), BEHAVIOUR, torch.zeros(2, 4), cap=3.0)
    assert (result.weight == 0).all()
    assert behaviour_weight_metrics(result, torch.zeros(2, 4)) == {
        "behaviour_ratio_mean": 0.0,
        "behaviour_ratio_max": 0.0,
        "importance_weight_mean": 0.0,
        "behaviour_weight_clamped_fraction": 0.0,
        "masked_fraction": 0.0,
    }


def test_the_mismatch_is_measured_on_fresh_tokens_only() -> None:
    behaviour = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, 0.0]])
    train = torch.tensor([[-1.2, -2.0, -0.5 - math.log(6.0)], [-0.1, -1.0, 0.0]])
    fresh = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])  # row 1: a stale token and padding
    metrics = mismatch_metrics(behaviour, train, fresh)
    gaps = [0.2, 0.0, math.log(6.0), 0.0]  # behaviour - train on the fresh tokens
    assert metrics["rollout_gap_count"] == 4.0
    assert metrics["rollout_gap_mean"] == pytest.approx(sum(gaps) / 4)
    assert metrics["rollout_gap_abs_max"] == pytest.approx(math.log(6.0))
    # ratio pi_train / pi_rollout: e^-0.2 = 0.82, 1, 1/6 = 0.17 (outside [0.5, 5]), 1
    assert metrics["rollout_gap_icepop_fraction"] == pytest.approx(0.25)
    nothing = mismatch_metrics(behaviour, train, torch.zeros_like(fresh))
    assert nothing == {"rollout_gap_mean": 0.0, "rollout_gap_abs_max": 0.0, "rollout_gap_icepop_fraction": 0.0,
                       "rollout_gap_count": 0.0}


def test_micro_batch_metrics_combine_by_kind() -> None:
    sums: dict[str, float] = {}
    accumulate_metrics(sums, {"loss": 2.0, "behaviour_ratio_max": 1.5, "rollout_gap_count": 3.0}, 0.25)
    accumulate_metrics(sums, {"loss": 4.0, "behaviour_ratio_max": 1.2, "rollout_gap_count": 5.0}, 0.75)
    assert sums == {"loss": pytest.approx(3.5), "behaviour_ratio_max": 1.5, "rollout_gap_count": 8.0}
    merged = merge_metric_sums([{"loss": 1.0, "ratio_max": 2.0}, {"loss": 0.5, "ratio_max": 3.0}])
    assert merged == {"loss": 1.5, "ratio_max": 3.0}  # ranks' sums were weighted already


def test_optimizer_steps_metrics_combine_by_kind_each_over_the_steps_that_report_it() -> None:
    steps = [
        {"loss": 2.0, "ratio_max": 1.5, "rollout_gap_count": 3.0, "rollout_gap_mean": 0.25},  # the first: fresh tokens
        {"loss": 4.0, "ratio_max": 1.2},
    ]
    assert combine_optimizer_steps(steps) == {"loss": 3.0, "ratio_max": 1.5, "rollout_gap_count": 3.0, "rollout_gap_mean": 0.25}
    assert combine_optimizer_steps(steps[:1]) == steps[0]  # one optimizer step: its metrics, unchanged
