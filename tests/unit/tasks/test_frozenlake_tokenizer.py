"""The FrozenLake tokenizer and transcript: fixed ids, lossless round trips, piecewise = whole."""

from __future__ import annotations

import random

import pytest
from transformers import PreTrainedTokenizerFast

from tandem.tasks.frozenlake.environment import FrozenLakeEnvironment
from tandem.tasks.frozenlake.pretrain import noisy_expert_episode
from tandem.tasks.frozenlake.tokenizer import BOS, EOT, VOCAB, build_tokenizer
from tandem.tasks.frozenlake.transcript import encode_episode, transcript_text


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


def episodes(n: int) -> list[tuple[list[str], list[str]]]:
    rng = random.Random(1)
    played = [noisy_expert_episode(seed, 0.5, rng) for seed in range(n)]
    return [(episode.observations, episode.actions) for episode in played]


def test_special_token_ids(tokenizer: PreTrainedTokenizerFast) -> None:
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.eos_token == EOT  # the end of a model turn is the generation stop token
    assert tokenizer.unk_token_id == 3
    assert len(tokenizer) == len(VOCAB) == 14


def test_one_token_per_character_after_bos(tokenizer: PreTrainedTokenizerFast) -> None:
    observation = FrozenLakeEnvironment().reset(0)
    ids = tokenizer(observation)["input_ids"]
    assert ids == [tokenizer.bos_token_id] + [VOCAB[c] for c in observation]
    assert len(ids) == 1 + 25  # four rows and the neighbour line, five characters each


def test_transcripts_round_trip(tokenizer: PreTrainedTokenizerFast) -> None:
    for observations, actions in episodes(30):
        text = transcript_text(observations, actions)
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == BOS + text
        assert tokenizer.decode(ids, skip_special_tokens=True) == text.replace(EOT, "")


def test_encoding_piece_by_piece_equals_encoding_the_whole_transcript(tokenizer: PreTrainedTokenizerFast) -> None:
    # The environment manager appends each turn's tokens and each observation's tokens in turn;
    # pretraining must have seen exactly that sequence.
    for observations, actions in episodes(30):
        encoded = encode_episode(tokenizer, observations, actions)
        assert encoded.input_ids == tokenizer(transcript_text(observations, actions))["input_ids"]


def test_the_loss_mask_covers_each_action_and_its_eot_and_nothing_else(tokenizer: PreTrainedTokenizerFast) -> None:
    observations, actions = episodes(1)[0]
    encoded = encode_episode(tokenizer, observations, actions)
    trained = [token for token, mask in zip(encoded.input_ids, encoded.loss_mask) if mask]
    expected = [token for action in actions for token in (VOCAB[action], tokenizer.eos_token_id)]
    assert trained == expected
    assert encoded.loss_mask[: 1 + 25] == [0] * 26  # <bos> and the first observation are the prompt
    assert len(encoded.input_ids) == 1 + 27 * len(actions)


def test_untrained_turns_stay_in_the_transcript_but_carry_no_loss(tokenizer: PreTrainedTokenizerFast) -> None:
    observations, actions = next(e for e in episodes(10) if len(e[1]) >= 3)
    trained = [turn != 1 for turn in range(len(actions))]
    everything = encode_episode(tokenizer, observations, actions)
    encoded = encode_episode(tokenizer, observations, actions, trained)
    assert encoded.input_ids == everything.input_ids
    second_turn = 1 + 27 + 25  # <bos>, turn 0 (25 observation + 2 turn tokens), turn 1's observation
    assert everything.loss_mask[second_turn : second_turn + 2] == [1, 1]
    assert encoded.loss_mask[second_turn : second_turn + 2] == [0, 0]
    assert sum(everything.loss_mask) - sum(encoded.loss_mask) == 2


def test_mismatched_observations_and_actions_are_rejected(tokenizer: PreTrainedTokenizerFast) -> None:
    with pytest.raises(ValueError, match="one observation per action"):
        encode_episode(tokenizer, ["....\n"], [])


def test_unknown_characters_become_unk_not_dropped(tokenizer: PreTrainedTokenizerFast) -> None:
    assert tokenizer("LxR", add_special_tokens=False)["input_ids"] == [VOCAB["L"], tokenizer.unk_token_id, VOCAB["R"]]


def test_batches_pad_on_the_left_for_generation(tokenizer: PreTrainedTokenizerFast) -> None:
    batch = tokenizer(["L", "LRU"], padding=True)
    assert batch["input_ids"][0][:2] == [tokenizer.pad_token_id] * 2
    assert batch["attention_mask"][0] == [0, 0, 1, 1]
