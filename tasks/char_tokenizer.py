"""The character-level tokenizer the shipped small models share, built with ``tokenizers``.

One token per character a task writes, plus the special tokens, first: ``<pad>``, ``<bos>``, the
task's end-of-turn token (the tokenizer's ``eos_token``, the model's stop token), ``<unk>``, then
any the task adds (a chat template's markers). Ids are fixed by that order, so a rebuilt
tokenizer always matches the shipped weights. Every encoded text starts with ``<bos>`` (added by
the post-processor; a chat template writes its own and is tokenized without it); ``<eos>`` is
never added, the model writes it to stop. Padding is on the left for batched generation.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer, decoders, models, processors
from transformers import PreTrainedTokenizerFast

__all__ = ["BOS", "PAD", "UNK", "char_tokenizer", "char_vocab"]

PAD, BOS, UNK = "<pad>", "<bos>", "<unk>"


def char_vocab(characters: Sequence[str], eos: str, extra_special: Sequence[str] = ()) -> dict[str, int]:
    """Token -> id: the special tokens first (``<pad>``, ``<bos>``, ``eos``, ``<unk>``,
    ``extra_special``), then ``characters``."""
    return {token: i for i, token in enumerate((PAD, BOS, eos, UNK, *extra_special, *characters))}


def char_tokenizer(
    characters: Sequence[str], *, eos: str, model_max_length: int, extra_special: Sequence[str] = (),
    chat_template: str | None = None,
) -> PreTrainedTokenizerFast:
    """A fresh tokenizer over ``characters``, wrapped for ``transformers``."""
    vocab = char_vocab(characters, eos, extra_special)
    # BPE without merges splits text into single characters, and maps characters outside the
    # vocabulary to <unk> instead of dropping them silently.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.add_special_tokens([PAD, BOS, eos, UNK, *extra_special])
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    # Tokens are characters, so decoding is plain concatenation (the default joins with spaces).
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=eos, pad_token=PAD, unk_token=UNK, padding_side="left",
        model_max_length=model_max_length, chat_template=chat_template,
    )
