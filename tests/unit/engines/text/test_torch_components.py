"""Building the torch bundle: data files tokenized as they load, bad input named (rows, a tokenizer
that is not the model's, a response budget that fills the context), thread budgets that never
oversubscribe."""

from __future__ import annotations

import json
import shutil
from itertools import islice
from pathlib import Path

import pytest

from tandem.core.config import ConfigError, TandemConfig, validate_config
from tandem.engines.shared.chat import PromptEncoder
from tandem.engines.shared.tokenizer import load_tokenizer
from tandem.engines.text.build import prompt_budget, thread_budgets, tokenized, tokenized_held_out
from tandem.pipeline.builders import build_components
from tandem.tasks.arithmetic import MODEL_DIR
from tandem.tasks.dataset import FileItems
from tandem.tasks.registry import load_task


def file_prompts(path: Path, tokenizer: object) -> object:
    return tokenized(FileItems(path), PromptEncoder(tokenizer, path))


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
    assert [p.prompt for p in islice(source(7, 3), 5)] == [p.prompt for p in first[3:8]]  # a position resumes in place


def test_parquet_prompts_load(tmp_path: Path) -> None:
    import datasets

    path = tmp_path / "p.parquet"
    datasets.Dataset.from_list([{"prompt": "1+1=\n", "answer": "2"}]).to_parquet(str(path))
    assert next(iter(file_prompts(path, CharTokenizer())(0))).answer == "2"


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"prompt": "1+1=\n", "answer": "2"}, {"prompt": "", "answer": "3"}], "row 1 has no non-empty 'prompt'"),
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
    cfg = validate_config({"task": {"name": "arithmetic"}, "engines": {"type": "torch", "train_world_size": ranks},
                           "staleness": {"max_staleness": k},
                           "flow": {"stages": ["dataloader", "generate", "rollout", "logp", "reward", "train"]}})
    assert thread_budgets(cfg, cores=cores) == expected


def test_a_data_file_that_is_not_json_lines_is_named(tmp_path: Path) -> None:
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "1+1=\\n", "answer": "2"}\n{"prompt": "2+2=\\n", "ans\n')
    with pytest.raises(ConfigError, match=f"task.data_path: cannot read {path} \\(line 2 is not valid JSON"):
        file_prompts(path, CharTokenizer())


def torch_config(model_path: Path, **rollout: object) -> TandemConfig:
    return validate_config({
        "task": {"name": "arithmetic"},
        "engines": {"type": "torch", "model_path": str(model_path)},
        "flow": {"stages": ["dataloader", "generate", "rollout", "logp", "reward", "train"]},
        "rollout": rollout,
    })


def test_the_prompt_budget_is_the_models_context_minus_max_new_tokens() -> None:
    tokenizer = load_tokenizer(MODEL_DIR)
    context = json.loads((MODEL_DIR / "config.json").read_text())["max_position_embeddings"]
    assert prompt_budget(torch_config(MODEL_DIR, max_new_tokens=83), tokenizer) == context - 83
    with pytest.raises(ConfigError, match=f"rollout.max_new_tokens={context} leaves no room for a prompt"):
        prompt_budget(torch_config(MODEL_DIR, max_new_tokens=context), tokenizer)


def test_a_tokenizer_that_does_not_belong_to_the_model_is_named(tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(MODEL_DIR, model)
    config = json.loads((model / "config.json").read_text())
    config["vocab_size"] = 10  # a model whose embedding is smaller than the tokenizer's vocabulary
    (model / "config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(model)
    with pytest.raises(ConfigError, match=rf"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is 10"):
        build_components(torch_config(model))


def test_the_held_out_set_is_the_problems_pretraining_reported_on_tokenized() -> None:
    from tandem.tasks.arithmetic import generate_problems
    from tandem.tasks.arithmetic.pretrain import REPORT_SEED

    tokenizer = load_tokenizer(str(MODEL_DIR))
    held_out = tokenized_held_out(load_task("arithmetic"), PromptEncoder(tokenizer, MODEL_DIR))
    prompts = held_out(5)
    assert prompts == held_out(5)
    expected = generate_problems(5, REPORT_SEED)
    assert [(p.prompt, p.answer) for p in prompts] == [(e["prompt"], e["answer"]) for e in expected]
    assert prompts[0].prompt_ids == list(tokenizer(expected[0]["prompt"])["input_ids"])
