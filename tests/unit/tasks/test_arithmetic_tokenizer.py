"""The character tokenizer: fixed special ids, lossless round trip, and the shipped copy matches."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tandem.tasks.arithmetic import MODEL_DIR, format_response, generate_problems
from tandem.tasks.arithmetic.tokenizer import VOCAB, build_tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


def test_special_token_ids(tokenizer: PreTrainedTokenizerFast) -> None:
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.unk_token_id == 3
    assert len(tokenizer) == len(VOCAB)


def test_one_token_per_character_after_bos(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "4589+123=\n9+3+0=12"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert ids[1:] == [VOCAB[c] for c in text]
    assert tokenizer.eos_token_id not in ids


def test_prompts_and_responses_round_trip(tokenizer: PreTrainedTokenizerFast) -> None:
    for problem in generate_problems(50, seed=4):
        a, b = (int(x) for x in problem["prompt"].removesuffix("=\n").split("+"))
        for text in (problem["prompt"], format_response(a, b), problem["answer"], " 1 + 2 "):
            ids = tokenizer(text)["input_ids"]
            assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_unknown_characters_become_unk_not_dropped(tokenizer: PreTrainedTokenizerFast) -> None:
    assert tokenizer("1x2", add_special_tokens=False)["input_ids"] == [VOCAB["1"], tokenizer.unk_token_id, VOCAB["2"]]


def test_batches_pad_on_the_left_for_generation(tokenizer: PreTrainedTokenizerFast) -> None:
    batch = tokenizer(["1+2=\n", "123+45=\n"], padding=True)
    assert batch["input_ids"][0][:3] == [tokenizer.pad_token_id] * 3
    assert batch["attention_mask"][0][:4] == [0, 0, 0, 1]


def test_shipped_tokenizer_matches_a_fresh_build(tokenizer: PreTrainedTokenizerFast) -> None:
    shipped = AutoTokenizer.from_pretrained(MODEL_DIR)
    assert shipped.get_vocab() == tokenizer.get_vocab()
    text = "4589+123=\n9+3+0=12\n=4712"
    assert shipped(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert shipped.padding_side == "left"
