"""The shipped FrozenLake model: loads the ordinary way, is small, and succeeds only part of the time."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from tandem.tasks.frozenlake import HELD_OUT_SEEDS, MODEL_DIR, FrozenLakeEnvironment
from tandem.tasks.frozenlake.play import play, summarize
from tandem.tasks.frozenlake.tokenizer import EOT, build_tokenizer
from tandem.tasks.frozenlake.transcript import TURN_TOKENS


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


def test_ships_small_safetensors_weights_and_a_one_turn_generation_config() -> None:
    assert (MODEL_DIR / "model.safetensors").stat().st_size < 8_000_000
    generation = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert generation["max_new_tokens"] == TURN_TOKENS


def test_has_about_a_million_parameters(model: PreTrainedModel) -> None:
    assert 1_000_000 <= model.num_parameters() <= 2_000_000


def test_special_ids_agree_between_model_and_tokenizer(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    assert model.config.vocab_size == len(tokenizer)
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids(EOT) == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id


def test_shipped_tokenizer_matches_a_fresh_build(tokenizer: PreTrainedTokenizerBase) -> None:
    fresh = build_tokenizer()
    assert tokenizer.get_vocab() == fresh.get_vocab()
    text = "@.H.\n...H\nH...\n..HG\n#..#\nR<eot>.@H.\n"
    assert tokenizer(text)["input_ids"] == fresh(text)["input_ids"]
    assert tokenizer.padding_side == "left"


def test_recorded_success_is_partial_and_beats_playing_blind(metrics: dict[str, Any]) -> None:
    low, high = metrics["success_band"]
    assert 0.2 <= low < high <= 0.5
    assert low <= metrics["sampled_temperature_1"]["success"] <= high
    assert metrics["sampled_temperature_1"]["success"] > metrics["right_or_down_at_random"] + 0.05
    assert metrics["greedy"]["success"] > metrics["right_or_down_at_random"] + 0.05


def test_it_reads_the_lake_a_hole_below_makes_down_less_likely(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    # First turns on held-out maps: the probability of moving down, split by what lies below.
    down = tokenizer.convert_tokens_to_ids("D")
    by_tile: dict[str, list[float]] = {"H": [], ".": []}
    environment = FrozenLakeEnvironment()
    for seed in HELD_OUT_SEEDS[:100]:
        observation = environment.reset(seed)
        with torch.no_grad():
            logits = model(**tokenizer(observation, return_tensors="pt")).logits[0, -1]
        by_tile[environment.lake_map[1][0].replace("F", ".")].append(torch.softmax(logits, -1)[down].item())
    assert by_tile["H"] and by_tile["."]
    assert sum(by_tile["H"]) / len(by_tile["H"]) < 0.5 * sum(by_tile["."]) / len(by_tile["."])


def test_held_out_success_at_temperature_1_replays_within_the_recorded_band(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, metrics: dict[str, Any]
) -> None:
    # The pretraining report's sampled run, replayed turn by turn with plain generate: 200 maps, so
    # that one flipped sample (another CPU's numerics) moves the rate by little.
    seeds = list(HELD_OUT_SEEDS[: metrics["report_maps"]])
    report = summarize(play(model, tokenizer, seeds, sampling_seed=metrics["report_sampling_seed"]))
    low, high = metrics["success_band"]
    assert low <= report.success <= high
    assert abs(report.success - metrics["sampled_temperature_1"]["success"]) <= 0.1
    assert report.malformed_actions_per_episode < 0.2  # it writes the action format
    assert report.max_tokens <= model.config.max_position_embeddings
