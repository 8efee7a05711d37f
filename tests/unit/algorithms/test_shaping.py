"""DAPO's soft over-long punishment and dynamic-sampling predicate against hand-computed values."""

from __future__ import annotations

import pytest

from tandem.algorithms.shaping import has_reward_variance, soft_overlong_penalty


@pytest.mark.parametrize(
    ("length", "expected"),
    [
        (0, 0.0),
        (10, 0.0),
        (16, 0.0),  # max - cache: the last length without punishment
        (17, -0.25),  # (16 - 17) / 4
        (18, -0.5),
        (20, -1.0),  # max: the ramp's end
        (21, -1.0),  # beyond max
    ],
)
def test_soft_overlong_penalty_ramp(length: int, expected: float) -> None:
    assert soft_overlong_penalty(length, max_length=20, cache_length=4) == pytest.approx(expected)


def test_dapos_own_setting() -> None:
    # 20480 tokens with a 4096 cache: punishment starts after 16384 and reaches -1 at 20480.
    assert soft_overlong_penalty(16384, max_length=20480, cache_length=4096) == 0.0
    assert soft_overlong_penalty(18432, max_length=20480, cache_length=4096) == pytest.approx(-0.5)


@pytest.mark.parametrize(
    "bad", [{"length": -1}, {"cache_length": 0}, {"cache_length": 21}]
)
def test_invalid_lengths_are_refused(bad: dict[str, int]) -> None:
    kwargs = {"length": 5, "max_length": 20, "cache_length": 4} | bad
    with pytest.raises(ValueError):
        soft_overlong_penalty(kwargs.pop("length"), **kwargs)


@pytest.mark.parametrize(
    ("rewards", "expected"),
    [
        ([1.0, 1.0, 1.0], False),  # all correct: zero group-baselined advantage
        ([0.0, 0.0], False),  # all wrong
        ([0.5], False),  # a group of one has no variance
        ([0.0, 1.0, 1.0], True),
        ([0.1, 0.1000001], True),  # equality is exact
    ],
)
def test_groups_without_reward_variance_are_dropped(rewards: list[float], expected: bool) -> None:
    assert has_reward_variance(rewards) is expected


@pytest.mark.parametrize("bad", [[], [1.0, float("nan")], [float("inf")]])
def test_empty_or_non_finite_groups_are_refused(bad: list[float]) -> None:
    with pytest.raises(ValueError):
        has_reward_variance(bad)
