"""The calculator environment: tool calls, malformed turns, the final answer and the turn limit."""

from __future__ import annotations

import pytest

import tandem.tasks.calculator
from tandem.core.environment import Environment, EnvironmentRunner, StepResult
from tandem.tasks.arithmetic import format_response, generate_problems, verify
from tandem.tasks.arithmetic.problems import MAX_DIGITS
from tandem.tasks.calculator import MAX_TURN_CHARS, MAX_TURNS, TOOL_ERROR, CalculatorEnvironment, parse_turn


def operands(prompt: str) -> tuple[int, int]:
    a, b = prompt.removesuffix("=\n").split("+")
    return int(a), int(b)


def column_calls(a: int, b: int) -> list[str]:
    """The tool calls of the reference scratchpad: each column line up to its '='."""
    return [line[: line.index("=") + 1] for line in format_response(a, b).splitlines()[:-1]]


def test_implements_the_environment_protocol() -> None:
    assert isinstance(CalculatorEnvironment(), Environment)


def test_reset_gives_the_arithmetic_problem_of_the_seed() -> None:
    environment = CalculatorEnvironment()
    for seed in (0, 1, 42):
        assert environment.reset(seed) == generate_problems(1, seed)[0]["prompt"]
    assert environment.reset(42) == environment.reset(42)


@pytest.mark.parametrize(
    ("turn", "expected"),
    [
        ("9+3+0=", ("tool_call", 12)),
        ("5+1+1=", ("tool_call", 7)),
        ("9+3+0=12\n8+2+1=", ("tool_call", 11)),  # the model wrote a column itself, then called
        ("=4712", ("final_answer", None)),
        ("9+3+0=12\n=4712", ("final_answer", None)),
        ("45+12+0=", ("malformed", None)),  # not one column
        ("9+3=", ("malformed", None)),
        ("9+3+0=12", ("malformed", None)),  # a finished column line is neither a call nor an answer
        ("=4712\n", ("malformed", None)),  # the last line is empty
        ("", ("malformed", None)),
        ("= 4712", ("malformed", None)),
    ],
)
def test_the_last_line_of_a_turn_decides_what_it_is(turn: str, expected: tuple[str, int | None]) -> None:
    assert parse_turn(turn) == expected


def test_a_tool_call_is_answered_with_the_column_sum_in_scratchpad_form() -> None:
    environment = CalculatorEnvironment()
    environment.reset(0)
    result = environment.step("5+1+1=")
    assert result == StepResult("07\n", 0.0, False, False, {"kind": "tool_call", "tool_calls": 1})


def test_a_malformed_turn_gets_the_tool_error_costs_a_turn_and_the_episode_goes_on() -> None:
    environment = CalculatorEnvironment()
    environment.reset(0)
    result = environment.step("45+12+0=")
    assert (result.observation, result.reward, result.terminated, result.truncated) == (TOOL_ERROR, 0.0, False, False)
    assert result.info["kind"] == "malformed" and "three single digits" in result.info["error"]
    assert environment.turns == 1 and environment.tool_calls == 0


@pytest.mark.parametrize("seed", range(20))
def test_calling_the_tool_for_every_column_then_answering_is_rewarded(seed: int) -> None:
    environment = CalculatorEnvironment()
    a, b = operands(environment.reset(seed))
    for call in column_calls(a, b):
        assert not environment.step(call).terminated
    final = environment.step(f"={a + b}")
    assert (final.reward, final.terminated, final.truncated, final.observation) == (1.0, True, False, "")
    # With the tool's answers spliced in, the response is the arithmetic scratchpad exactly.
    assert environment.response == format_response(a, b)
    assert final.info["tool_calls"] == len(str(max(a, b)))


def test_a_wrong_final_answer_scores_the_verifiers_zero() -> None:
    environment = CalculatorEnvironment()
    a, b = operands(environment.reset(3))
    final = environment.step(f"={a + b + 1}")
    assert (final.reward, final.terminated) == (0.0, True)
    assert verify(environment.response, str(a + b)) == 0.0


def test_the_arithmetic_models_one_turn_solution_needs_no_tool() -> None:
    environment = CalculatorEnvironment()
    a, b = operands(environment.reset(5))
    final = environment.step(format_response(a, b))
    assert (final.reward, final.terminated, final.info["tool_calls"]) == (1.0, True, 0)
    assert len(format_response(a, b)) <= MAX_TURN_CHARS


def test_the_turn_limit_truncates_without_reward_and_ends_the_episode() -> None:
    environment = CalculatorEnvironment(max_turns=3)
    environment.reset(0)
    results = [environment.step("1+1+0=") for _ in range(3)]
    assert [r.truncated for r in results] == [False, False, True]
    assert all(r.reward == 0.0 and not r.terminated for r in results)
    with pytest.raises(RuntimeError, match="reset first"):
        environment.step("=2")


def test_the_default_turn_limit_leaves_room_for_every_column_and_the_answer() -> None:
    a = b = 10**MAX_DIGITS - 1  # the longest problem: MAX_DIGITS columns
    assert MAX_TURNS >= len(column_calls(a, b)) + 1


async def test_runs_under_the_environment_runner() -> None:
    runner = EnvironmentRunner(timeout_s=5.0)
    try:
        async with runner.open(CalculatorEnvironment) as session:
            a, b = operands(await session.reset(11))
            for call in column_calls(a, b):
                await session.step(call)
            final = await session.step(f"={a + b}")
    finally:
        runner.shutdown()
    assert final.reward == 1.0 and final.terminated


def test_public_api_is_listed_and_importable() -> None:
    for name in tandem.tasks.calculator.__all__:
        assert hasattr(tandem.tasks.calculator, name), name
