"""On-policy distillation's per-token advantage against the reverse KL computed by hand on a toy vocabulary."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tandem.algorithms.distill import distillation_advantages, reverse_kl_per_token

# A three-token vocabulary and three positions: each row is a next-token distribution.
STUDENT = [[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.25, 0.25, 0.5]]
TEACHER = [[0.7, 0.2, 0.1], [0.2, 0.2, 0.6], [0.1, 0.8, 0.1]]
SAMPLED = [0, 2, 1]  # the tokens the student drew


def logprobs(table: list[list[float]]) -> list[float]:
    return [math.log(row[token]) for row, token in zip(table, SAMPLED)]


def test_the_advantage_is_the_negative_reverse_kl_of_each_sampled_token() -> None:
    # log(p_student / p_teacher) at the sampled tokens: log(0.5/0.7), log(0.3/0.6), log(0.25/0.8).
    by_hand = [math.log(0.5 / 0.7), math.log(0.3 / 0.6), math.log(0.25 / 0.8)]
    assert reverse_kl_per_token(logprobs(STUDENT), logprobs(TEACHER)) == pytest.approx(by_hand, abs=1e-12)
    advantages = distillation_advantages(logprobs(STUDENT), logprobs(TEACHER))
    # Tokens the teacher likes more than the student does are pushed up, the others down.
    assert advantages == pytest.approx([math.log(1.4), math.log(2.0), math.log(3.2)], abs=1e-12)
    assert advantages.dtype == np.float64


def test_its_mean_over_samples_estimates_the_exact_reverse_kl() -> None:
    # The per-token estimate is unbiased for KL(student || teacher) when tokens are the student's.
    rng = np.random.default_rng(0)
    student, teacher = np.array(STUDENT[1]), np.array(TEACHER[1])
    tokens = rng.choice(3, size=200_000, p=student)
    estimate = reverse_kl_per_token(np.log(student[tokens]), np.log(teacher[tokens])).mean()
    exact = float((student * np.log(student / teacher)).sum())
    assert estimate == pytest.approx(exact, abs=5e-3)


def test_the_task_advantage_is_added_with_its_weight() -> None:
    pure = distillation_advantages(logprobs(STUDENT), logprobs(TEACHER))
    mixed = distillation_advantages(logprobs(STUDENT), logprobs(TEACHER), task_advantage=-0.8, reward_weight=0.5)
    assert mixed == pytest.approx(pure - 0.4, abs=1e-12)
    # A weight of 0 ignores the task advantage, whatever it is.
    assert distillation_advantages([-1.0], [-2.0], task_advantage=3.0) == pytest.approx([-1.0])


def test_a_teacher_equal_to_the_student_gives_no_signal() -> None:
    assert distillation_advantages(logprobs(STUDENT), logprobs(STUDENT)).tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("student", "teacher", "task_advantage"),
    [
        ([-1.0, -2.0], [-1.0], 0.0),  # one log-prob per token, on both sides
        ([-1.0], [-math.inf], 0.0),  # a token the teacher rules out: an infinite advantage
        ([math.nan], [-1.0], 0.0),
        ([-1.0], [-1.0], math.nan),
    ],
)
def test_bad_inputs_are_refused(student: list[float], teacher: list[float], task_advantage: float) -> None:
    with pytest.raises(ValueError):
        distillation_advantages(student, teacher, task_advantage=task_advantage)


def test_inputs_are_not_modified() -> None:
    student, teacher = np.array([-1.0, -0.5]), np.array([-0.2, -3.0])
    distillation_advantages(student, teacher, task_advantage=1.0, reward_weight=2.0)
    assert student.tolist() == [-1.0, -0.5] and teacher.tolist() == [-0.2, -3.0]
