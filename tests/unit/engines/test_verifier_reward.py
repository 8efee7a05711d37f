"""Rewards in a worker process: a raising, NaN, hanging or crashing verifier fails one sample only."""

from __future__ import annotations

import asyncio
import time

import pytest

from engines.verifier_reward import VerifierReward
from core.records import FinishReason, Sample
from tests.unit.engines.verifiers_for_tests import exact


def sample(text: str) -> Sample:
    return Sample(0, 0, [1], [2], [-1.0], [0], 0, FinishReason.STOP, response_text=text)


@pytest.fixture
def reward() -> VerifierReward:
    r = VerifierReward(exact, timeout_s=3.0)
    yield r
    r.close()


def test_scores_each_sample_and_records_why_one_failed(reward: VerifierReward) -> None:
    results = asyncio.run(reward.score([sample("7"), sample("8"), sample("boom"), sample("nan")], ["7", "7", "7", "7"]))
    assert [(r.reward, r.ok) for r in results] == [(1.0, True), (0.0, True), (0.0, False), (0.0, False)]
    assert "ValueError: cannot parse" in results[2].info
    assert "not a finite number" in results[3].info


@pytest.mark.parametrize("bad", ["hang", "crash"])
def test_a_hanging_or_crashing_verifier_fails_only_its_sample_and_the_loop_stays_free(reward: VerifierReward, bad: str) -> None:
    async def scenario() -> tuple[list, int]:
        ticks = 0

        async def heartbeat() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        beat = asyncio.ensure_future(heartbeat())
        results = await reward.score([sample("7"), sample(bad), sample("9")], ["7", "7", "9"])
        beat.cancel()
        return results, ticks

    started = time.monotonic()
    results, ticks = asyncio.run(scenario())
    assert [(r.reward, r.ok) for r in results] == [(1.0, True), (0.0, False), (1.0, True)]
    assert "timed out after 3.0s" in results[1].info
    assert reward.restarts >= 1
    assert ticks > 20  # the event loop kept running while the verifier hung
    assert time.monotonic() - started < 30
