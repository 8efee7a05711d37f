"""The image workload's judge as a service: the task's rewards score rendered images in the pool or inline, and a judge
that crashes, hangs or is slow costs only its own samples.

The judges below are imported by dotted path in the reward worker processes, so this module stays light (no torch).
"""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest

from tandem.core.protocols import RewardResult
from tandem.core.records import FinishReason, PromptGroup, TaskItem, Trajectory
from tandem.core.task import RewardFunction
from tandem.engines.rewards import TaskReward
from tandem.tasks.digits.reward import ocr

THIS = "tests.unit.engines.diffusion.test_diffusion_reward"


def crashing_judge(response: np.ndarray, answer: str | None) -> float:
    """Kills its worker process on the digit 3, scores the others."""
    if answer == "3":
        os._exit(1)
    return ocr(response, answer)


def hanging_judge(response: np.ndarray, answer: str | None) -> float:
    """Never answers on the digit 3, scores the others."""
    if answer == "3":
        time.sleep(3600)
    return ocr(response, answer)


def image_trajectories(images: np.ndarray, digits: list[int], cost: float = 0.0) -> tuple[list[Trajectory], list[PromptGroup]]:
    from tandem.engines.diffusion.payload import ImagePayload

    trajectories, groups = [], []
    for i, (image, digit) in enumerate(zip(images, digits)):
        payload = ImagePayload(f"draw the digit {digit}", np.zeros((2, 1, 8, 8), np.float32), [1.0, 0.0], [True], 0.7, 1.5,
                               image[None].astype(np.float32))
        trajectories.append(Trajectory(i, 0, [0.0], [0], 0, FinishReason.LENGTH, payload))
        groups.append(PromptGroup(i, TaskItem(f"draw the digit {digit}", answer=str(digit), meta={"judge_cost_s": cost}), 1))
    return trajectories, groups


@pytest.fixture(scope="module")
def heldout() -> tuple[np.ndarray, np.ndarray]:
    from tandem.tasks.digits.data import load_split

    images, labels = load_split("heldout")
    return images[:8], labels[:8]


def render() -> object:
    from tandem.pipeline.builders import RENDERERS

    return RENDERERS["image"]


def score(reward: TaskReward, trajectories: list[Trajectory], groups: list[PromptGroup]) -> list[RewardResult]:
    try:
        return asyncio.run(reward.score(trajectories, groups))
    finally:
        reward.close()


@pytest.mark.parametrize("runner", ["pool", "inline"])
def test_the_digits_rewards_score_the_rendered_image_wherever_they_run(
    runner: str, heldout: tuple[np.ndarray, np.ndarray]
) -> None:
    from tandem.tasks.digits import make_task

    images, labels = heldout
    task = make_task(ink_weight=-0.5, judge=runner)  # type: ignore[arg-type]
    assert {f.runner for f in task.rewards()} == {runner}
    trajectories, groups = image_trajectories(images, labels.tolist())
    results = score(TaskReward(task.rewards(), render(), timeout_s=30), trajectories, groups)
    for result, image, label in zip(results, images, labels):
        assert result.ok and set(result.components) == {"ocr", "ink"}
        assert result.components["ocr"] == pytest.approx(ocr(image, str(label)))
        assert result.reward == pytest.approx(result.components["ocr"] - 0.5 * result.components["ink"])
    assert np.mean([r.components["ocr"] for r in results]) > 0.9  # real digits, recognised


@pytest.mark.slow  # each culprit costs a pool timeout and a new worker
@pytest.mark.parametrize("judge", ["crashing_judge", "hanging_judge"])
def test_a_judge_that_crashes_or_hangs_fails_only_its_samples(judge: str, heldout: tuple[np.ndarray, np.ndarray]) -> None:
    images, _ = heldout
    digits = [1, 3, 5, 3, 7, 0]
    trajectories, groups = image_trajectories(images[:6], digits)
    # A started worker judges an image in a millisecond: one second tells a hung or dead worker
    # from a judging one, and each culprit costs the test one (a dead worker's job never answers either).
    reward = TaskReward([RewardFunction("ocr", f"{THIS}:{judge}")], render(), timeout_s=1)
    results = score(reward, trajectories, groups)
    failed = [d for d, r in zip(digits, results) if not r.ok]
    assert failed == [3, 3]
    assert all(r.reward == 0.0 and ("timed out" in r.info or "ocr" in r.info) for r in results if not r.ok)
    assert all(r.ok and 0.0 <= r.reward <= 1.0 for d, r in zip(digits, results) if d != 3)
    assert reward.restarts >= 1  # the broken worker was replaced, the run went on


def test_a_slow_judge_costs_its_configured_seconds_per_image(heldout: tuple[np.ndarray, np.ndarray]) -> None:
    images, labels = heldout
    fast, slow = (image_trajectories(images[:4], labels[:4].tolist(), cost) for cost in (0.0, 0.25))
    function = [RewardFunction("ocr", "tandem.tasks.digits.reward:ocr", runner="inline")]
    started = time.perf_counter()
    quick = score(TaskReward(function, render()), *fast)
    middle = time.perf_counter()
    costly = score(TaskReward(function, render()), *slow)
    elapsed = time.perf_counter() - middle
    assert elapsed >= 4 * 0.25 and middle - started < 0.5
    assert [r.reward for r in costly] == [r.reward for r in quick]  # the cost changes the time, not the score
