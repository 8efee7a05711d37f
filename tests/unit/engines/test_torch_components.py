"""Building the torch bundle: data files, bad input named, thread budgets that never oversubscribe."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import pytest

from engines.torch_components import file_prompts, thread_budgets
from pipeline.config import ConfigError, validate_config


class CharTokenizer:
    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}


def test_jsonl_prompts_are_tokenized_and_reshuffled_each_epoch(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=\n", "answer": str(i + 1)}) + "\n" for i in range(5)))
    source = file_prompts(path, CharTokenizer())
    first = list(islice(source(7), 10))
    assert sorted(p.prompt for p in first[:5]) == sorted(p.prompt for p in first[5:])  # two full epochs
    assert first[0].prompt_ids == [ord(c) for c in first[0].prompt]
    assert [p.prompt for p in islice(source(7), 5)] == [p.prompt for p in first[:5]]  # deterministic per seed


def test_parquet_prompts_load(tmp_path: Path) -> None:
    import datasets

    path = tmp_path / "p.parquet"
    datasets.Dataset.from_list([{"prompt": "1+1=\n", "answer": "2"}]).to_parquet(str(path))
    assert next(iter(file_prompts(path, CharTokenizer())(0))).answer == "2"


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"prompt": "1+1=\n", "answer": "2"}, {"prompt": "", "answer": "3"}], "row 1 has no non-empty string 'prompt'"),
        ([{"prompt": "1+1=\n", "answer": 2}], "row 0: 'answer' must be a string"),
    ],
)
def test_a_bad_row_is_named_before_the_run_starts(tmp_path: Path, rows: list[dict], message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError, match=message):
        file_prompts(path, CharTokenizer())


def test_a_missing_data_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="task.data_path: no such file"):
        file_prompts(tmp_path / "nope.jsonl", CharTokenizer())


@pytest.mark.parametrize(
    ("k", "cores", "ranks", "expected"),
    [(0, 2, 1, (2, 2)), (1, 2, 1, (1, 1)), (2, 8, 1, (4, 4)), (1, 1, 1, (1, 1)), (1, 8, 2, (4, 2)), (0, 2, 2, (2, 1))],
)
def test_thread_budgets_split_the_cores_only_when_phases_overlap(
    k: int, cores: int, ranks: int, expected: tuple[int, int]
) -> None:
    cfg = validate_config({"engines": {"type": "torch", "train_world_size": ranks}, "staleness": {"max_staleness": k},
                           "flow": {"stages": ["dataloader", "generate", "rollout", "logp", "reward", "train"]}})
    assert thread_budgets(cfg, cores=cores) == expected
