"""The shipped model: loads the ordinary way, is small, generates on CPU, has its metrics; and the
shipped teacher: the same recipe trained longer, much stronger, with the same tokenizer."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

import tandem.tasks.arithmetic
from tandem.tasks.arithmetic import MAX_RESPONSE_TOKENS, MODEL_DIR, TEACHER_DIR, format_prompt, verify


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(MODEL_DIR)


def test_ships_safetensors_weights_and_generation_config() -> None:
    assert (MODEL_DIR / "model.safetensors").is_file()
    generation = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert generation["max_new_tokens"] >= MAX_RESPONSE_TOKENS


def test_has_one_to_five_million_parameters(model: PreTrainedModel) -> None:
    assert 1_000_000 <= model.num_parameters() <= 5_000_000


def test_special_ids_agree_between_model_and_tokenizer(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    assert model.config.vocab_size == len(tokenizer)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id


def test_generates_on_cpu(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    inputs = tokenizer([format_prompt(3, 4), format_prompt(4589, 123)], return_tensors="pt", padding=True)
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    new_tokens = output[:, inputs["input_ids"].shape[1] :]
    assert new_tokens.shape == (2, 4)
    assert int(new_tokens.max()) < len(tokenizer)


def test_solves_most_one_digit_sums_greedily(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    # Proves the weights were trained with this tokenizer and format, not just that they load.
    pairs = [(3, 4), (5, 2), (1, 8), (6, 7), (9, 9), (0, 5), (2, 2), (4, 5)]
    inputs = tokenizer([format_prompt(a, b) for a, b in pairs], return_tensors="pt", padding=True)
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    texts = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert sum(verify(text, str(a + b)) for text, (a, b) in zip(texts, pairs)) >= len(pairs) / 2


def test_recorded_accuracy_is_partial() -> None:
    # The shipped weights are stopped early on purpose: RL must have room to improve them.
    metrics = json.loads((MODEL_DIR / "pretrain_metrics.json").read_text())
    assert 0.15 <= metrics["sampled_temperature_1"]["accuracy"] <= 0.6


def test_the_teacher_is_the_same_recipe_trained_to_a_much_higher_accuracy() -> None:
    student, teacher = (json.loads((d / "pretrain_metrics.json").read_text()) for d in (MODEL_DIR, TEACHER_DIR))
    assert teacher["parameters"] == student["parameters"]  # ~1M: small enough to ship beside the student
    assert teacher["sampled_temperature_1"]["accuracy"] >= student["sampled_temperature_1"]["accuracy"] + 0.3
    # Distillation compares log-probs of one token id under both models: one tokenizer.
    assert (TEACHER_DIR / "tokenizer.json").read_bytes() == (MODEL_DIR / "tokenizer.json").read_bytes()
    # Its README names the command that reproduces it, with the arguments its metrics record.
    readme = (TEACHER_DIR / "README.md").read_text()
    assert f"--target-accuracy {teacher['args']['target_accuracy']}" in readme and "--out tasks/arithmetic/teacher" in readme


def test_public_api_is_listed_and_importable() -> None:
    for name in tandem.tasks.arithmetic.__all__:
        assert hasattr(tandem.tasks.arithmetic, name), name
    assert {"MODEL_DIR", "generate_problems", "verify", "load_jsonl", "write_jsonl", "format_prompt"} <= set(
        tandem.tasks.arithmetic.__all__
    )
