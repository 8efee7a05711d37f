"""The JSONL problem files: round trip, and errors that name the offending line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.tasks.arithmetic import generate_problems, load_jsonl, write_jsonl


def test_round_trip(tmp_path: Path) -> None:
    problems = generate_problems(30, seed=3)
    path = tmp_path / "problems.jsonl"
    write_jsonl(problems, path)
    assert load_jsonl(path) == problems


def test_blank_lines_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "problems.jsonl"
    path.write_text('{"prompt": "1+2=\\n", "answer": "3"}\n\n{"prompt": "2+2=\\n", "answer": "4"}\n')
    assert [p["answer"] for p in load_jsonl(path)] == ["3", "4"]


@pytest.mark.parametrize(
    "bad_row",
    [
        "{not json",
        '["1+2=\\n", "3"]',
        '{"prompt": "1+2=\\n"}',
        '{"prompt": "1+2=\\n", "answer": 3}',
        '{"prompt": null, "answer": "3"}',
    ],
)
def test_malformed_row_raises_naming_its_line(tmp_path: Path, bad_row: str) -> None:
    path = tmp_path / "problems.jsonl"
    path.write_text('{"prompt": "1+2=\\n", "answer": "3"}\n\n' + bad_row + "\n")
    with pytest.raises(ValueError, match=r"line 3\b"):
        load_jsonl(path)
