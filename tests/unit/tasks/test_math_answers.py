"""The shipped math rewards: the final answer (last box, else last number) is checked for
mathematical equivalence with the ground truth; a pathological answer fails its sample at the
pool's timeout and leaves the pool scoring the others."""

from __future__ import annotations

import asyncio
import time

import pytest

from tandem.core.records import FinishReason, PromptGroup, TaskItem, token_trajectory
from tandem.core.task import RewardFunction
from tandem.engines.rewards import TaskReward
from tandem.tasks.math_answers import boxed, final_answer, math

pytest.importorskip("math_verify", reason="math-verify is the math extra")


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        (r"Half of one is \boxed{\frac{1}{2}}", "0.5"),
        (r"\boxed{0.75}", "3/4"),
        (r"\boxed{\dfrac{5}{4}}", "1.25"),
        ("He had 12 and 7/2 are left", "3.5"),
        ("The answer is -4.", "-4"),
        ("0.50", r"\frac{1}{2}"),
    ],
)
def test_an_equivalent_final_answer_is_right(response: str, answer: str) -> None:
    assert math(response, answer) == 1.0


@pytest.mark.parametrize(
    ("response", "answer"),
    [(r"\boxed{2}", "3"), (r"\boxed{3} or maybe 2", "2"), ("7200", "72"), ("no number here", "1")],
)
def test_a_different_or_missing_final_answer_is_wrong(response: str, answer: str) -> None:
    assert math(response, answer) == 0.0


def test_the_final_answer_is_the_last_box_else_the_last_number() -> None:
    assert final_answer(r"\boxed{1} then \boxed{\frac{2}{3}} and 7") == r"\frac{2}{3}"
    assert final_answer("12 apples, 3 eaten, 9 left") == "9"
    assert final_answer("none") is None


def test_an_item_without_a_ground_truth_fails_rather_than_scoring() -> None:
    with pytest.raises(ValueError, match="needs the item's answer"):
        math(r"\boxed{1}", None)


@pytest.mark.parametrize(("response", "value"), [(r"so \boxed{7}", 1.0), (r"\boxed{ }", 0.0), ("7", 0.0), (r"\boxed{7", 0.0)])
def test_the_format_reward_asks_for_a_box(response: str, value: float) -> None:
    assert boxed(response, "7") == value


def sample(response: str):
    return token_trajectory(0, 0, [1], [2], [-1.0], [0], FinishReason.STOP, text=response)


@pytest.mark.slow
def test_a_pathological_answer_times_out_as_a_failed_sample_and_the_pool_goes_on() -> None:
    reward = TaskReward([RewardFunction("math", "tandem.tasks.math_answers:math")], lambda t: t.payload.text, timeout_s=3.0)
    responses = [r"\boxed{\frac{1}{2}}", r"\boxed{9^{9^{9^{9}}}}", r"\boxed{2}"]
    try:
        asyncio.run(reward.score([sample("0")], [PromptGroup(0, TaskItem("p", answer="0"), 1)]))  # the pool is up
        started = time.monotonic()
        results = asyncio.run(reward.score([sample(r) for r in responses], [PromptGroup(0, TaskItem("p", answer="0.5"), 1)] * 3))
        elapsed = time.monotonic() - started
        again = asyncio.run(reward.score([sample(r"\boxed{3}")], [PromptGroup(0, TaskItem("p", answer="3"), 1)]))
    finally:
        reward.close()
    assert [(r.reward, r.ok) for r in results] == [(1.0, True), (0.0, False), (0.0, True)]
    assert "timed out after 3.0s" in results[1].info
    assert elapsed < 30  # the whole batch, then each sample alone under the timeout, plus a fresh worker
    assert (again[0].reward, again[0].ok) == (1.0, True)  # the replaced pool keeps scoring
