"""The environment runner: a misbehaving environment fails only its own episode, with the reason.

The toy environments live at module level so the process-isolation tests can pickle them into a
spawned child by reference.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from typing import Any

import pytest

from tandem.core.environment import EnvironmentRunner, EpisodeFailure, StepResult


class CountdownEnvironment:
    """A well-behaved environment: the episode terminates with reward 1 when the action is
    "stop", and is truncated at ``max_turns`` otherwise."""

    max_turns = 3

    def __init__(self) -> None:
        self.turn = 0

    def reset(self, seed: int) -> str:
        self.turn = 0
        return f"seed {seed}\n"

    def step(self, action_text: str) -> StepResult:
        self.turn += 1
        terminated = action_text == "stop"
        return StepResult(
            observation=f"turn {self.turn}\n",
            reward=1.0 if terminated else 0.0,
            terminated=terminated,
            truncated=not terminated and self.turn >= self.max_turns,
            info={"turn": self.turn},
        )


class RaisingEnvironment(CountdownEnvironment):
    def step(self, action_text: str) -> StepResult:
        raise ValueError(f"cannot parse {action_text!r}")


class SlowEnvironment(CountdownEnvironment):
    """Each step sleeps for a while, longer than the runner's timeout, then answers."""

    def step(self, action_text: str) -> StepResult:
        time.sleep(1.0)
        return super().step(action_text)


class HangingEnvironment(CountdownEnvironment):
    def step(self, action_text: str) -> StepResult:
        time.sleep(3600)
        return super().step(action_text)


class TupleEnvironment(CountdownEnvironment):
    """Returns gymnasium's tuple instead of a StepResult."""

    def step(self, action_text: str) -> Any:
        return ("obs", 0.0, False, False, {})


class NanRewardEnvironment(CountdownEnvironment):
    def step(self, action_text: str) -> StepResult:
        return StepResult("obs", math.nan, False, False, {})


class BytesObservationEnvironment(CountdownEnvironment):
    def step(self, action_text: str) -> Any:
        return StepResult(b"obs", 0.0, False, False, {})  # type: ignore[arg-type]


class NeverEndingEnvironment(CountdownEnvironment):
    """Declares max_turns but never reports truncated."""

    def step(self, action_text: str) -> StepResult:
        return StepResult("obs", 0.0, False, False, {})


class IntObservationOnResetEnvironment(CountdownEnvironment):
    def reset(self, seed: int) -> Any:
        return seed


class UnbuildableEnvironment(CountdownEnvironment):
    def __init__(self) -> None:
        raise FileNotFoundError("map.txt")


class NoTurnLimitEnvironment(CountdownEnvironment):
    max_turns = 0


class CrashingEnvironment(CountdownEnvironment):
    def step(self, action_text: str) -> StepResult:
        os._exit(3)


class UnpicklableInfoEnvironment(CountdownEnvironment):
    def step(self, action_text: str) -> StepResult:
        return StepResult("obs", 0.0, True, False, {"callback": lambda: None})


async def play(runner: EnvironmentRunner, factory: Any, actions: list[str], seed: int = 7) -> tuple[str, Any]:
    """A minimal episode loop, as the environment manager will run one: ("done", total reward and
    observations) or ("failed", the EpisodeFailure)."""
    try:
        async with runner.open(factory) as session:
            observations = [await session.reset(seed)]
            total = 0.0
            for action in actions:
                result = await session.step(action)
                observations.append(result.observation)
                total += result.reward
                if result.terminated or result.truncated:
                    break
            return "done", (total, observations)
    except EpisodeFailure as failure:
        return "failed", failure


@pytest.fixture
def runner() -> Any:
    runner = EnvironmentRunner(timeout_s=0.3, isolation="thread")
    yield runner
    runner.shutdown()


async def test_a_well_behaved_environment_runs_an_episode(runner: EnvironmentRunner) -> None:
    outcome, (total, observations) = await play(runner, CountdownEnvironment, ["go", "stop"])
    assert outcome == "done"
    assert total == 1.0
    assert observations == ["seed 7\n", "turn 1\n", "turn 2\n"]


async def test_each_misbehaving_environment_fails_only_its_own_episode(runner: EnvironmentRunner) -> None:
    factories = [CountdownEnvironment, RaisingEnvironment, SlowEnvironment, TupleEnvironment, CountdownEnvironment]
    started = time.perf_counter()
    outcomes = await asyncio.gather(*(play(runner, f, ["go", "stop"]) for f in factories))
    elapsed = time.perf_counter() - started

    assert [o for o, _ in outcomes] == ["done", "failed", "failed", "failed", "done"]
    assert outcomes[0][1][0] == outcomes[4][1][0] == 1.0
    raised, slow, garbage = (outcomes[i][1] for i in (1, 2, 3))
    assert (raised.kind, raised.call) == ("raised", "step")
    assert "ValueError: cannot parse 'go'" in raised.reason
    assert (slow.kind, slow.call) == ("timeout", "step")
    assert "0.3 s" in slow.reason
    assert (garbage.kind, garbage.call) == ("malformed", "step")
    assert "tuple, not StepResult" in garbage.reason
    # The hung step was given up on at its timeout, not waited for (it sleeps 1 s).
    assert elapsed < 0.9


@pytest.mark.parametrize(
    ("factory", "call", "detail"),
    [
        (NanRewardEnvironment, "step", "reward is nan, not a finite number"),
        (BytesObservationEnvironment, "step", "observation is bytes, not str"),
        (NeverEndingEnvironment, "step", "went past its max_turns (3) without ending"),
        (IntObservationOnResetEnvironment, "reset", "observation is int, not str"),
        (NoTurnLimitEnvironment, "open", "max_turns is 0, not a positive int"),
    ],
)
async def test_output_that_breaks_the_protocol_is_a_malformed_failure(
    runner: EnvironmentRunner, factory: Any, call: str, detail: str
) -> None:
    outcome, failure = await play(runner, factory, ["go", "go", "go", "go"])
    assert outcome == "failed"
    assert (failure.kind, failure.call) == ("malformed", call)
    assert detail in failure.reason


async def test_an_environment_that_cannot_be_built_fails_at_open(runner: EnvironmentRunner) -> None:
    outcome, failure = await play(runner, UnbuildableEnvironment, ["go"])
    assert outcome == "failed"
    assert (failure.kind, failure.call) == ("raised", "open")
    assert "FileNotFoundError: map.txt" in failure.reason


async def test_a_failed_session_re_raises_its_failure_without_calling_the_environment(
    runner: EnvironmentRunner,
) -> None:
    async with runner.open(RaisingEnvironment) as session:
        await session.reset(0)
        with pytest.raises(EpisodeFailure) as first:
            await session.step("go")
        with pytest.raises(EpisodeFailure) as second:
            await session.reset(1)
        assert second.value is first.value
        assert session.failure is first.value


async def test_stepping_outside_an_episode_is_a_caller_error(runner: EnvironmentRunner) -> None:
    async with runner.open(CountdownEnvironment) as session:
        with pytest.raises(RuntimeError, match="reset first"):
            await session.step("go")
        await session.reset(0)
        assert (await session.step("stop")).terminated
        with pytest.raises(RuntimeError, match="reset first"):
            await session.step("go")
        assert await session.reset(1) == "seed 1\n"  # a new episode on the same environment
        assert session.turns == 0


async def test_turns_are_counted_and_the_declared_limit_truncates(runner: EnvironmentRunner) -> None:
    async with runner.open(CountdownEnvironment) as session:
        assert session.max_turns == 3
        await session.reset(0)
        results = [await session.step("go") for _ in range(3)]
        assert [r.truncated for r in results] == [False, False, True]
        assert session.turns == 3


async def test_integer_rewards_are_returned_as_floats(runner: EnvironmentRunner) -> None:
    class IntRewardEnvironment(CountdownEnvironment):
        def step(self, action_text: str) -> StepResult:
            return StepResult("obs", 1, True, False, {})  # type: ignore[arg-type]

    async with runner.open(IntRewardEnvironment) as session:
        await session.reset(0)
        result = await session.step("go")
    assert type(result.reward) is float and result.reward == 1.0


async def test_a_timed_out_thread_is_counted_as_stuck_until_its_call_returns() -> None:
    runner = EnvironmentRunner(timeout_s=0.1, isolation="thread")
    try:
        outcome, failure = await play(runner, SlowEnvironment, ["go"])
        assert (outcome, failure.kind) == ("failed", "timeout")
        assert runner.stuck_calls == 1
        await asyncio.sleep(1.2)  # the sleeping step (1 s) returns and frees its thread
        assert runner.stuck_calls == 0
    finally:
        runner.shutdown()


async def test_a_cancelled_call_makes_the_session_unusable(runner: EnvironmentRunner) -> None:
    async with runner.open(SlowEnvironment) as session:
        await session.reset(0)
        task = asyncio.create_task(session.step("go"))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(RuntimeError, match="cancelled"):
            await session.reset(1)


def test_rejects_a_non_positive_timeout() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        EnvironmentRunner(timeout_s=0)


# Process isolation: each session spawns a child process (about a second here), hence slow.


@pytest.mark.slow
async def test_in_a_process_a_hang_kills_the_child_and_frees_the_thread() -> None:
    # The timeout covers each child's start too (about a second on a loaded 2-core machine), so
    # that the hang is the only call that reaches it.
    runner = EnvironmentRunner(timeout_s=2.5, isolation="process")
    try:
        outcomes = await asyncio.gather(
            play(runner, HangingEnvironment, ["go"]), play(runner, CountdownEnvironment, ["go", "stop"])
        )
        (hung_outcome, failure), (outcome, (total, _)) = outcomes
        assert (hung_outcome, failure.kind, failure.call) == ("failed", "timeout", "step")
        assert (outcome, total) == ("done", 1.0)
        await asyncio.sleep(0.5)
        assert runner.stuck_calls == 0  # unlike a thread, the killed child released its caller
    finally:
        runner.shutdown()


@pytest.mark.slow
async def test_in_a_process_a_crash_raise_and_unpicklable_answer_each_fail_their_episode() -> None:
    runner = EnvironmentRunner(timeout_s=10.0, isolation="process")
    try:
        crashed, raised, unpicklable = await asyncio.gather(
            play(runner, CrashingEnvironment, ["go"]),
            play(runner, RaisingEnvironment, ["go"]),
            play(runner, UnpicklableInfoEnvironment, ["go"]),
        )
    finally:
        runner.shutdown()
    assert (crashed[0], crashed[1].kind) == ("failed", "crashed")
    assert "exited (code 3)" in crashed[1].reason
    assert (raised[0], raised[1].kind) == ("failed", "raised")
    assert "ValueError: cannot parse 'go'" in raised[1].reason
    assert (unpicklable[0], unpicklable[1].kind) == ("failed", "malformed")
    assert "cannot be sent back" in unpicklable[1].reason
