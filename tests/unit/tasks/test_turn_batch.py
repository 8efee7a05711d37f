"""A turn batch generates each episode's turns as plain ``generate`` on its unpadded transcript would."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tandem.tasks.turn_batch import TurnBatch

PAD = 0


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         max_position_embeddings=128, pad_token_id=PAD, bos_token_id=None, eos_token_id=None)  # no stop token
    return LlamaForCausalLM(config).eval()


def generate_alone(model: LlamaForCausalLM, transcript: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens of plain ``generate`` on the transcript alone, re-encoded from scratch."""
    with torch.no_grad():
        output = model.generate(
            input_ids=torch.tensor([transcript]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=PAD
        )
    return output[0, len(transcript):].tolist()


def test_each_turn_is_what_the_rows_own_transcript_generates_despite_padding_and_dropped_rows(model: LlamaForCausalLM) -> None:
    # Prompts and pieces of different lengths put padding on the left and inside rows; turns cut
    # at different lengths leave masked generated tokens in the batch; a row leaves after a turn.
    transcripts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
    pieces = {0: [[20, 21], [22]], 1: [[23, 24, 25, 26], [27, 28]], 2: [[29]]}
    batch = TurnBatch(model, transcripts, PAD)
    live = [0, 1, 2]
    for turn_number in range(3):
        generated = batch.generate(max_new_tokens=3, do_sample=False)
        assert generated == [generate_alone(model, transcripts[i], 3) for i in live]
        if turn_number == 2:
            break
        kept = [row for row, i in enumerate(live) if turn_number < len(pieces[i])]
        lengths = [1 + live[row] + turn_number for row in kept]  # turns of 1, 2 and 3 tokens
        for row, length in zip(kept, lengths, strict=True):
            transcripts[live[row]] += generated[row][:length] + pieces[live[row]][turn_number]
        batch.advance(kept, lengths, [pieces[live[row]][turn_number] for row in kept])
        live = [live[row] for row in kept]
        assert len(batch) == len(live)
    assert live == [0, 1]


def test_advance_needs_a_generate_first_and_one_turn_and_piece_per_kept_row(model: LlamaForCausalLM) -> None:
    batch = TurnBatch(model, [[1, 2], [3]], PAD)
    with pytest.raises(RuntimeError, match="follows a generate"):
        batch.advance([0], [1], [[4]])
    batch.generate(max_new_tokens=2, do_sample=False)
    with pytest.raises(ValueError, match="one turn length and one piece each"):
        batch.advance([0, 1], [1], [[4], [5]])
    with pytest.raises(ValueError, match="within 1..2"):
        batch.advance([0], [3], [[4]])
    with pytest.raises(ValueError, match="non-empty prompt"):
        TurnBatch(model, [[1], []], PAD)
