"""The verifier: 1.0 only for a well-formed, correct final line; never an exception."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tandem.tasks.arithmetic import extract_answer, verify

SCRATCHPAD = "9+3+0=12\n8+2+1=11\n5+1+1=07\n4+0+0=04\n"


def test_correct_final_answer_scores_one() -> None:
    assert verify(SCRATCHPAD + "=4712", "4712") == 1.0


def test_scratchpad_is_not_graded_only_the_final_line() -> None:
    assert verify("=4712", "4712") == 1.0
    assert verify("1+1+1=99\n=4712", "4712") == 1.0


def test_surrounding_whitespace_and_blank_lines_are_tolerated() -> None:
    assert verify(SCRATCHPAD + "  =4712  \n\n", "4712") == 1.0


def test_wrong_answer_scores_zero() -> None:
    assert verify(SCRATCHPAD + "=4711", "4712") == 0.0
    assert verify(SCRATCHPAD + "=47120", "4712") == 0.0


@pytest.mark.parametrize(
    "response",
    [
        "",  # empty
        "\n \n",  # only whitespace
        SCRATCHPAD,  # stopped before the answer line
        SCRATCHPAD + "=",  # answer line without digits
        SCRATCHPAD + "=47 12",  # digits split by a space
        SCRATCHPAD + "=04712",  # non-canonical leading zero
        SCRATCHPAD + "4712",  # missing the "=" marker
        SCRATCHPAD + "=4712\n9+9+0=18",  # kept writing after the answer
        "<unk>=4712",  # junk on the answer line
    ],
)
def test_malformed_responses_score_zero(response: str) -> None:
    assert verify(response, "4712") == 0.0


def test_extract_answer() -> None:
    assert extract_answer(SCRATCHPAD + "=4712") == "4712"
    assert extract_answer("=0") == "0"
    assert extract_answer(SCRATCHPAD) is None


@given(st.text())
def test_any_text_scores_zero_or_one_without_raising(response: str) -> None:
    assert verify(response, "4712") in (0.0, 1.0)
