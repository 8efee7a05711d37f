"""The data files users have: TRL's conversational rows, verl's RL parquet rows, plain
``{"prompt", "answer"}`` rows; each becomes task items, and a malformed row names file, row and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.core.config import ConfigError
from tandem.tasks.dataset import FileItems

QUESTION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1/2 as a decimal?"}]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def test_a_trl_conversational_row_keeps_its_messages_and_other_columns_reach_meta(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": QUESTION, "answer": "0.5", "source": "mine"}])
    [item] = FileItems(path).rows
    assert item.messages == tuple(QUESTION)
    assert item.prompt == "What is 1/2 as a decimal?"  # the readable form: the last message
    assert item.answer == "0.5" and item.meta == {"source": "mine"}


def test_a_string_prompt_is_used_as_is(tmp_path: Path) -> None:
    [item] = FileItems(write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "1+1=", "answer": "2"}])).rows
    assert (item.prompt, item.answer, item.messages, item.meta) == ("1+1=", "2", None, None)


def test_a_verl_parquet_row_is_detected_and_its_ground_truth_is_the_answer(tmp_path: Path) -> None:
    row = {
        "data_source": "openai/gsm8k", "prompt": QUESTION, "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "0.5"}, "extra_info": {"split": "train", "index": 3},
    }
    [item] = FileItems(write_parquet(tmp_path / "verl.parquet", [row])).rows
    assert item.messages == tuple(QUESTION) and item.answer == "0.5"
    assert item.meta == {k: v for k, v in row.items() if k != "prompt"}


def test_a_numeric_ground_truth_becomes_a_string_answer(tmp_path: Path) -> None:
    row = {"prompt": QUESTION, "reward_model": {"ground_truth": 72}}
    [item] = FileItems(write_jsonl(tmp_path / "verl.jsonl", [row])).rows
    assert item.answer == "72"


def test_a_named_format_is_not_second_guessed(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    with pytest.raises(ConfigError, match=r"row 0: 'reward_model.ground_truth' must be a string or a number, got None"):
        FileItems(path, data_format="verl")


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"prompt": QUESTION}, {"prompt": [{"role": "user"}]}], r"row 1: 'prompt'\[0\] has no string 'content'"),
        ([{"prompt": []}], "row 0: 'prompt' must be a non-empty list of chat messages"),
        ([{"prompt": ["hello"]}], r"row 0: 'prompt'\[0\] must be a \{'role', 'content'\} object"),
        ([{"prompt": QUESTION, "reward_model": {"style": "rule"}}], "row 0: 'reward_model.ground_truth' must be"),
    ],
)
def test_a_malformed_row_names_file_row_and_field(tmp_path: Path, rows: list[dict], message: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ConfigError, match=f"task.data_path {path}: {message}"):
        FileItems(path)
