"""The character-level tokenizer of the arithmetic task, built with ``tokenizers``.

Owns the vocabulary and its ids: one token per character the task writes, plus the special
tokens. Ids are fixed (specials first) so a rebuilt tokenizer always matches the shipped
weights. Every encoded text starts with ``<bos>`` (added by the post-processor, so prompts and
training sequences agree); ``<eos>`` is never added, the model writes it to stop. Padding is
on the left because decoder-only batched generation needs the prompts right-aligned.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, processors
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
# Space is unused by the reference format but kept so hand-written prompts with spaces encode.
CHARACTERS = (*tuple("0123456789"), "+", "=", " ", "\n")
VOCAB: dict[str, int] = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
# Long enough for any prompt plus the longest reference response; the model's RoPE table
# (max_position_embeddings) is sized from the same number.
MODEL_MAX_LENGTH = 256


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh tokenizer with the fixed vocabulary, wrapped for ``transformers``."""
    # BPE without merges splits text into single characters, and maps characters outside the
    # vocabulary to <unk> instead of dropping them silently.
    core = Tokenizer(models.BPE(vocab=VOCAB, merges=[], unk_token=UNK))
    core.add_special_tokens(list(SPECIAL_TOKENS))
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, VOCAB[BOS])]
    )
    # Tokens are characters, so decoding is plain concatenation (the default joins with spaces).
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        model_max_length=MODEL_MAX_LENGTH,
    )
