"""Chat prompts reach a user's own chat model through its template: the ids the rollout engine
samples from and the trainer trains on are ``apply_chat_template``'s, one <bos> and no more; a
model without a template is refused by name; chat JSONL and verl parquet files train."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from chat_lm import CHATML

from tandem.core.config import ConfigError, TandemConfig, validate_config
from tandem.core.records import TaskItem
from tandem.engines.shared.chat import PromptEncoder
from tandem.engines.shared.tokenizer import load_tokenizer
from tandem.pipeline import AsyncTrainingFlow
from tandem.pipeline.builders import build_components
from tests.integration.test_torch_flow import Recording, weights

QUESTIONS = [f"What is {a} plus {b}?" for a, b in [(3, 4), (1, 2), (5, 5), (2, 7)]]


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def test_a_chat_prompt_is_the_templates_ids_with_one_bos(chat_model_dir: Path) -> None:
    tokenizer = load_tokenizer(chat_model_dir)
    messages = chat(QUESTIONS[0])
    ids = PromptEncoder(tokenizer, chat_model_dir)(TaskItem(prompt=QUESTIONS[0], messages=tuple(messages)))
    assert ids == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids[0] == tokenizer.bos_token_id and ids[1] != tokenizer.bos_token_id  # the template's <bos> only
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


def test_a_string_prompt_is_tokenized_as_is_with_the_tokenizers_special_tokens(chat_model_dir: Path) -> None:
    tokenizer = load_tokenizer(chat_model_dir)
    ids = PromptEncoder(tokenizer, chat_model_dir)(TaskItem(prompt="What is 3 plus 4?"))
    assert ids == tokenizer("What is 3 plus 4?")["input_ids"] and ids[0] == tokenizer.bos_token_id


def test_the_system_prompt_goes_first_unless_the_chat_has_one(chat_model_dir: Path) -> None:
    tokenizer = load_tokenizer(chat_model_dir)
    encode = PromptEncoder(tokenizer, chat_model_dir, system_prompt="Be brief.")
    own = ({"role": "system", "content": "Show your work."}, *chat(QUESTIONS[0]))
    assert "<|im_start|>system\nBe brief.<|im_end|>" in tokenizer.decode(encode.chat(chat(QUESTIONS[0])))
    assert "Be brief." not in tokenizer.decode(encode.chat(own))


def test_a_template_override_is_a_string_or_a_file_and_becomes_the_tokenizers(plain_model_dir: Path, tmp_path: Path) -> None:
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    for override in (CHATML, str(template)):
        tokenizer = load_tokenizer(plain_model_dir)
        ids = PromptEncoder(tokenizer, plain_model_dir, chat_template=override).chat(chat(QUESTIONS[0]))
        assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n") and tokenizer.chat_template == CHATML
    with pytest.raises(ConfigError, match="engines.chat_template: 'nope.jinja' is neither a Jinja template nor a file"):
        PromptEncoder(load_tokenizer(plain_model_dir), plain_model_dir, chat_template="nope.jinja")


def chat_config(model: Path, data: Path, **task: object) -> TandemConfig:
    return validate_config({
        "run": {"max_steps": 2, "seed": 0},
        "task": {"name": "arithmetic", "data_path": str(data), "system_prompt": "Be brief.", **task,
                 "rewards": [{"fn": "tests.unit.engines.rewards_for_tests:shortness", "runner": "inline"}]},
        "engines": {"type": "torch", "model_path": str(model), "lr": 1e-3},
        "train": {"prompts_per_step": 2},
        "rollout": {"samples_per_prompt": 2, "max_new_tokens": 8},
        "flow": {"stages": ["dataloader", "generate", "rollout", "reward", "train"], "micro_batch_size": 4},
        "algorithm": {"proximal": "current"},
        "observability": {"write_run_dir": False, "trace": False},
    })


def test_chat_rows_for_a_model_without_a_template_are_refused_naming_the_model(plain_model_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"prompt": chat(QUESTIONS[0]), "answer": "7"}) + "\n")
    with pytest.raises(ConfigError, match=f"engines.model_path {plain_model_dir}: the model's tokenizer has no chat template"):
        build_components(chat_config(plain_model_dir, data))


def test_the_exported_checkpoint_carries_the_template_override(plain_model_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"prompt": chat(QUESTIONS[0]), "answer": "7"}) + "\n")
    config = chat_config(plain_model_dir, data)
    config = config.model_copy(update={"engines": config.engines.model_copy(update={"chat_template": CHATML})})
    components = build_components(config)
    try:
        asyncio.run(components.save_checkpoint(tmp_path / "export"))
    finally:
        components.close()
    assert load_tokenizer(tmp_path / "export").chat_template == CHATML  # the run's template, not the model folder's (none)


def write_chat_jsonl(path: Path) -> Path:
    path.write_text("".join(json.dumps({"prompt": chat(q), "answer": "7", "level": 1}) + "\n" for q in QUESTIONS))
    return path


def write_verl_parquet(path: Path) -> Path:
    import datasets

    rows = [{"data_source": "mine", "prompt": chat(q), "ability": "math", "reward_model": {"style": "rule", "ground_truth": "7"},
             "extra_info": {"index": i}} for i, q in enumerate(QUESTIONS)]
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


@pytest.mark.slow
@pytest.mark.parametrize(("write", "name"), [(write_chat_jsonl, "chat.jsonl"), (write_verl_parquet, "verl.parquet")])
def test_a_chat_data_file_trains_on_the_templates_prompt_ids(chat_model_dir: Path, tmp_path: Path, write, name: str) -> None:
    data = write(tmp_path / name)
    cfg = chat_config(chat_model_dir, data)
    components = build_components(cfg)
    recorder = Recording(components.trainer)
    before = weights(components.trainer)
    try:
        result = asyncio.run(AsyncTrainingFlow(cfg, components).run())
        after = weights(components.trainer)
    finally:
        components.close()
    assert result.total_steps == 2
    tokenizer = load_tokenizer(chat_model_dir)
    expected = {
        q: tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."}, *chat(q)], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
        for q in QUESTIONS
    }
    trained = [t for batch in recorder.batches for t in batch]
    assert len(trained) == 2 * 2 * 2
    for t in trained:
        question = next(q for q in QUESTIONS if tokenizer.decode(t.payload.prompt_ids).find(q) >= 0)
        assert t.payload.prompt_ids == expected[question]
    assert max((after[k] - before[k]).abs().max().item() for k in before) > 0


async def test_an_episode_with_a_chat_model_is_the_conversation_its_template_renders(chat_model_dir: Path) -> None:
    import functools

    from agentic_for_tests import ScriptedEnvironment, first_observation

    from tandem.core.environment import EnvironmentRunner
    from tandem.core.protocols import RolloutRequest, SamplingParams
    from tandem.core.records import PromptGroup
    from tandem.engines.agentic import EnvironmentManager, WorkflowContext
    from tandem.engines.text.rollout import HFRolloutEngine

    tokenizer = load_tokenizer(chat_model_dir)
    group = PromptGroup(0, TaskItem(first_observation(7), meta={"seed": 7}), 1)
    runner = EnvironmentRunner(timeout_s=5.0)
    try:
        async with HFRolloutEngine(str(chat_model_dir), max_batch_size=4) as engine:
            workflow = EnvironmentManager(WorkflowContext(
                engine=engine, tokenizer=tokenizer, sampling=SamplingParams(max_new_tokens=3), context_tokens=400,
                max_episodes=1, environments=runner, environment=functools.partial(ScriptedEnvironment, turns=3),
                prompts=PromptEncoder(tokenizer, chat_model_dir),
            ))
            [episode] = [t async for t in workflow.rollout([RolloutRequest(group, 0, seed=5)])]
    finally:
        runner.shutdown()
    payload = episode.payload
    conversation: list[dict[str, str]] = []
    for observation, action in zip([first_observation(7), "b1=", "b2="], payload.actions, strict=True):
        conversation += [{"role": "user", "content": observation}, {"role": "assistant", "content": action}]
    before_last_turn = tokenizer.apply_chat_template(conversation[:-1], add_generation_prompt=True, tokenize=False)
    transcript = tokenizer.decode(payload.prompt_ids + payload.response_ids, skip_special_tokens=False)
    assert transcript.startswith(before_last_turn)
    assert transcript[len(before_last_turn) :].removesuffix("<|im_end|>") == payload.actions[-1]
    assert payload.prompt_ids == PromptEncoder(tokenizer, chat_model_dir).chat([conversation[0]])
