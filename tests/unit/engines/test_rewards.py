"""A task's reward: weighted reward functions by dotted path, inline or in worker processes.
A raising, NaN, hanging or crashing function fails one sample only; the loop never stalls."""

from __future__ import annotations

import asyncio
import time

import pytest

from tandem.core.records import FinishReason, PromptGroup, TaskItem, Trajectory, token_trajectory
from tandem.core.task import RewardFunction
from tandem.engines.rewards import TaskReward

FN = "tests.unit.engines.rewards_for_tests"


def text(trajectory: Trajectory) -> str:
    return trajectory.payload.text


def sample(response: str) -> Trajectory:
    return token_trajectory(0, 0, [1], [2], [-1.0], [0], FinishReason.STOP, text=response)


def group(answer: str, prompt: str = "p", meta: dict | None = None) -> PromptGroup:
    return PromptGroup(0, TaskItem(prompt, answer=answer, meta=meta), 1)


@pytest.fixture
def reward() -> TaskReward:
    # A started worker scores a sample in milliseconds: one second tells a hang from a score with
    # room to spare on a loaded machine, and a hang costs the test two of them (the batch, then the sample).
    r = TaskReward([RewardFunction("exact", f"{FN}:exact")], text, timeout_s=1.0)
    yield r
    r.close()


def test_scores_each_sample_and_records_why_one_failed(reward: TaskReward) -> None:
    samples = [sample("7"), sample("8"), sample("boom"), sample("nan")]
    results = asyncio.run(reward.score(samples, [group("7")] * 4))
    assert [(r.reward, r.ok) for r in results] == [(1.0, True), (0.0, True), (0.0, False), (0.0, False)]
    assert "raised ValueError: cannot parse" in results[2].info
    assert "not a finite number" in results[3].info


@pytest.mark.parametrize("bad", ["hang", "crash"])
def test_a_hanging_or_crashing_function_fails_only_its_sample_and_the_loop_stays_free(reward: TaskReward, bad: str) -> None:
    async def scenario() -> tuple[list, int]:
        ticks = 0

        async def heartbeat() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        beat = asyncio.ensure_future(heartbeat())
        results = await reward.score([sample("7"), sample(bad), sample("9")], [group("7"), group("7"), group("9")])
        beat.cancel()
        return results, ticks

    started = time.monotonic()
    results, ticks = asyncio.run(scenario())
    assert [(r.reward, r.ok) for r in results] == [(1.0, True), (0.0, False), (1.0, True)]
    assert "timed out after 1.0s" in results[1].info
    assert reward.restarts >= 1
    assert ticks > 20  # the event loop kept running while the function hung (twice 1 s: 40 ticks)
    assert time.monotonic() - started < 30


def test_a_score_still_running_when_its_run_ends_is_dropped_and_the_pool_serves_on(reward: TaskReward) -> None:
    assert asyncio.run(reward.score([sample("7")], [group("7")]))[0].reward == 1.0  # the pool is up

    async def run_that_ends_while_scoring() -> None:
        scoring = asyncio.ensure_future(reward.score([sample("slow")], [group("7")]))
        await asyncio.sleep(0.2)
        assert not scoring.done()  # submitted and running: asyncio.run cancels it and closes the loop

    asyncio.run(run_that_ends_while_scoring())
    time.sleep(1.5)  # the job finishes after its loop has closed
    assert asyncio.run(reward.score([sample("9")], [group("9")]))[0].reward == 1.0
    reward.close()  # and nothing is left that the pool cannot account for


def test_two_rewards_are_summed_by_weight_and_each_is_kept() -> None:
    functions = [
        RewardFunction("correct", f"{FN}:exact", weight=1.0),
        RewardFunction("short", f"{FN}:shortness", weight=0.5, runner="inline"),
    ]
    reward = TaskReward(functions, text, timeout_s=10.0)
    try:
        right, wrong = asyncio.run(reward.score([sample("7"), sample("123")], [group("7"), group("7")]))
    finally:
        reward.close()
    assert right.components == {"correct": 1.0, "short": 0.5}
    assert right.reward == pytest.approx(1.0 + 0.5 * 0.5)
    assert wrong.components == {"correct": 0.0, "short": 0.25}
    assert wrong.reward == pytest.approx(0.5 * 0.25)


def test_one_failing_function_fails_the_sample_naming_it() -> None:
    functions = [RewardFunction("correct", f"{FN}:exact"), RewardFunction("short", f"{FN}:shortness", runner="inline")]
    reward = TaskReward(functions, text, timeout_s=10.0)
    try:
        [result] = asyncio.run(reward.score([sample("boom")], [group("7")]))
    finally:
        reward.close()
    assert not result.ok and result.reward == 0.0 and result.info.startswith("correct raised ValueError")


@pytest.mark.parametrize("runner", ["inline", "pool"])
def test_async_functions_and_functions_that_read_their_context(runner: str) -> None:
    functions = [
        RewardFunction("async", f"{FN}:async_exact", runner=runner),
        RewardFunction("echo", f"{FN}:prompt_echo", runner=runner),
    ]
    reward = TaskReward(functions, text, timeout_s=10.0)
    try:
        [a, b] = asyncio.run(reward.score([sample("7"), sample("say")], [group("7"), group("x", "say", {"bonus": 2.0})]))
    finally:
        reward.close()
    assert a.components == {"async": 1.0, "echo": 0.0}
    assert b.components == {"async": 0.0, "echo": 3.0}


def test_a_function_that_cannot_be_imported_is_named_before_anything_runs() -> None:
    with pytest.raises(ValueError, match=r"task.rewards: cannot import 'tests.unit.engines.rewards_for_tests:nope'"):
        TaskReward([RewardFunction("x", f"{FN}:nope")], text)
