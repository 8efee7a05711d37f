"""The character-level tokenizer of the arithmetic task, built with ``tokenizers``.

Owns the vocabulary and its ids: one token per character the task writes, plus the special
tokens. Ids are fixed (specials first) so a rebuilt tokenizer always matches the shipped
weights. Every encoded text starts with ``<bos>`` (added by the post-processor, so prompts and
training sequences agree); ``<eos>`` is never added, the model writes it to stop. Padding is
on the left because decoder-only batched generation needs the prompts right-aligned.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from tandem.tasks.char_tokenizer import char_tokenizer, char_vocab

EOS = "<eos>"
# Space is unused by the reference format but kept so hand-written prompts with spaces encode.
CHARACTERS = (*tuple("0123456789"), "+", "=", " ", "\n")
VOCAB: dict[str, int] = char_vocab(CHARACTERS, EOS)
# Long enough for any prompt plus the longest reference response; the model's RoPE table
# (max_position_embeddings) is sized from the same number.
MODEL_MAX_LENGTH = 256


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh tokenizer with the fixed vocabulary (``tasks.char_tokenizer``), wrapped for ``transformers``."""
    return char_tokenizer(CHARACTERS, eos=EOS, model_max_length=MODEL_MAX_LENGTH)
