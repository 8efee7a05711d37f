"""A train step's mini-batch plan: whole groups, every trajectory once per epoch, seeded by the run
and the step, and one mini-batch of one epoch is the step as it was."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tandem.algorithms.mini_batches import plan_mini_batches


@st.composite
def steps(draw: st.DrawFn) -> tuple[list[int], int, int]:
    """A step's group of each trajectory (groups of 1 to 4, prompt ids not in order), M and E."""
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=12))
    ids = draw(st.permutations(range(100, 100 + len(sizes))))
    groups = [prompt for prompt, size in zip(ids, sizes, strict=True) for _ in range(size)]
    return groups, draw(st.integers(1, len(sizes))), draw(st.integers(1, 3))


@given(steps(), st.integers(-5, 5), st.integers(0, 1000))
def test_each_epoch_trains_every_trajectory_once_in_mini_batches_of_whole_groups(
    step: tuple[list[int], int, int], seed: int, index: int
) -> None:
    groups, mini_batches, epochs = step
    plan = plan_mini_batches(groups, mini_batches, epochs, seed=seed, step=index)
    assert len(plan) == mini_batches * epochs
    for epoch in range(epochs):
        passes = plan[epoch * mini_batches : (epoch + 1) * mini_batches]
        assert sorted(i for part in passes for i in part) == list(range(len(groups)))
        counts = []
        for part in passes:
            assert part == sorted(part)  # the step's own order inside a mini-batch
            members = {groups[i] for i in part}
            assert part == [i for i, g in enumerate(groups) if g in members]  # whole groups only
            counts.append(len(members))
        assert max(counts) - min(counts) <= 1
    assert plan == plan_mini_batches(groups, mini_batches, epochs, seed=seed, step=index)  # a resume plans alike


def test_one_mini_batch_of_one_epoch_is_the_whole_step_in_order() -> None:
    assert plan_mini_batches([7, 7, 3, 3, 9], 1, 1, seed=0, step=4) == [[0, 1, 2, 3, 4]]


def test_the_shuffle_depends_on_the_seed_the_step_and_the_epoch() -> None:
    groups = [g for g in range(16) for _ in range(2)]

    def plan(seed: int, step: int) -> list[list[int]]:
        return plan_mini_batches(groups, 4, 2, seed=seed, step=step)

    assert plan(0, 3) != plan(0, 4) and plan(0, 3) != plan(1, 3)
    first, second = plan(0, 3)[:4], plan(0, 3)[4:]
    assert first != second  # each epoch reshuffled


def test_more_mini_batches_than_groups_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"train\.mini_batches=3 exceeds the step's 2 groups"):
        plan_mini_batches([1, 1, 2, 2], 3, 1, seed=0, step=0)
