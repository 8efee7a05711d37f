"""The problem generator: deterministic per seed, correct reference solutions, a long tail."""

from __future__ import annotations

import statistics

import pytest

from tandem.tasks.arithmetic import format_prompt, format_response, generate_problems, verify
from tandem.tasks.arithmetic.problems import MAX_RESPONSE_CHARS


def test_same_seed_same_problems_and_different_seed_different_problems() -> None:
    assert generate_problems(50, seed=7) == generate_problems(50, seed=7)
    assert generate_problems(50, seed=7) != generate_problems(50, seed=8)


def test_rows_are_prompt_and_answer_strings() -> None:
    for problem in generate_problems(20, seed=0):
        assert set(problem) == {"prompt", "answer"}
        left, right = problem["prompt"].removesuffix("=\n").split("+")
        assert problem["answer"] == str(int(left) + int(right))


def test_reference_response_is_the_column_scratchpad_then_the_answer() -> None:
    assert format_prompt(4589, 123) == "4589+123=\n"
    assert format_response(4589, 123) == "9+3+0=12\n8+2+1=11\n5+1+1=07\n4+0+0=04\n=4712"
    # A carry out of the last column becomes the answer's leading digit.
    assert format_response(9, 1) == "9+1+0=10\n=10"
    assert format_response(0, 0) == "0+0+0=00\n=0"


def test_negative_operands_are_rejected() -> None:
    with pytest.raises(ValueError):
        format_prompt(-1, 2)


def test_reference_responses_verify() -> None:
    for problem in generate_problems(200, seed=1):
        a, b = (int(x) for x in problem["prompt"].removesuffix("=\n").split("+"))
        assert verify(format_response(a, b), problem["answer"]) == 1.0


def test_response_lengths_have_a_long_tail() -> None:
    lengths = []
    for problem in generate_problems(1000, seed=2):
        a, b = (int(x) for x in problem["prompt"].removesuffix("=\n").split("+"))
        lengths.append(len(format_response(a, b)))
    assert max(lengths) <= MAX_RESPONSE_CHARS
    # Many short answers, a few long ones: the longest is >= 5x the shortest, the slowest
    # tenth is >= 4x longer than the fastest tenth, and the mean sits above the median.
    deciles = statistics.quantiles(lengths, n=10)
    assert max(lengths) >= 5 * min(lengths)
    assert deciles[-1] >= 4 * deciles[0]
    assert statistics.fmean(lengths) > statistics.median(lengths)
