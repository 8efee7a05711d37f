"""The shipped calculator model: the arithmetic model's shape and tokenizer, and it calls the tool."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from tandem.tasks.arithmetic import MODEL_DIR as ARITHMETIC_MODEL_DIR
from tandem.tasks.arithmetic import generate_problems
from tandem.tasks.calculator import HELD_OUT_SEEDS, MODEL_DIR, CalculatorEnvironment
from tandem.tasks.calculator.play import play
from tandem.tasks.calculator.pretrain import encode_episode, expert_episode


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def metrics() -> dict[str, Any]:
    return json.loads((MODEL_DIR / "pretrain_metrics.json").read_text())


def test_it_is_the_arithmetic_models_shape_with_its_tokenizer(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    arithmetic = json.loads((ARITHMETIC_MODEL_DIR / "config.json").read_text())
    assert {k: v for k, v in model.config.to_dict().items() if k in arithmetic and k != "transformers_version"} == {
        k: v for k, v in arithmetic.items() if k in model.config.to_dict() and k != "transformers_version"
    }
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(ARITHMETIC_MODEL_DIR).get_vocab()
    assert (MODEL_DIR / "model.safetensors").stat().st_size < 8_000_000


def test_the_expert_transcripts_are_what_the_environment_answers() -> None:
    rng = random.Random(0)
    for seed in range(100):
        problem = generate_problems(1, seed)[0]
        a, b = map(int, problem["prompt"].removesuffix("=\n").split("+"))
        episode = expert_episode(a, b, 0.5, rng)
        environment = CalculatorEnvironment()
        environment.reset(seed)
        for i, turn in enumerate(episode.turns):
            result = environment.step(turn)
            assert result.observation == (episode.tool_answers[i] if i < len(episode.tool_answers) else "")
        assert result.terminated and result.reward == 1.0


def test_only_the_experts_turns_and_their_eos_carry_loss() -> None:
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    episode = expert_episode(4589, 123, 1.0, random.Random(0))  # every column a tool call
    ids, mask = encode_episode(tokenizer, episode)
    trained = tokenizer.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert trained == "9+3+0=<eos>8+2+1=<eos>5+1+1=<eos>4+0+0=<eos>=4712<eos>"
    assert tokenizer.decode([i for i, m in zip(ids, mask) if not m]) == "<bos>4589+123=\n12\n11\n07\n04\n"


def test_held_out_accuracy_replays_the_report_and_it_calls_the_tool(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, metrics: dict[str, Any]
) -> None:
    seeds = list(HELD_OUT_SEEDS[: metrics["report_problems"]])
    report = play(model, tokenizer, seeds, sampling_seed=metrics["report_sampling_seed"])
    recorded = metrics["sampled_temperature_1"]
    assert abs(report.accuracy - recorded["accuracy"]) <= 0.1
    assert 0.2 <= report.accuracy <= 0.7  # better than the arithmetic model's, with room for RL
    assert report.accuracy > metrics["arithmetic_model_sampled"]["accuracy"]
    assert report.tool_calls_per_episode >= 1.0 and metrics["arithmetic_model_sampled"]["tool_calls_per_episode"] == 0.0
