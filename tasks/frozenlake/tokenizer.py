"""The character-level tokenizer of the FrozenLake task, built with ``tokenizers``.

Owns the vocabulary and its ids: one token per character the grid and the actions use, plus the
special tokens. Ids are fixed (specials first) so a rebuilt tokenizer always matches the shipped
weights. ``<eot>`` ends every model turn; it is the tokenizer's ``eos_token`` and the model's
generation stop token, so ``generate`` returns after one turn. Every encoded text starts with
``<bos>`` (added by the post-processor; encode later pieces of an episode with
``add_special_tokens=False``). Padding is on the left for batched generation.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, processors
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOT, UNK = "<pad>", "<bos>", "<eot>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOT, UNK)
# The grid's tiles, the agent and the lake's edge, the line separator, then the four actions.
CHARACTERS = (".", "H", "G", "@", "#", "\n", "L", "D", "R", "U")
VOCAB: dict[str, int] = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
# A whole default episode is at most 1 + 10 * (25 + 2) = 271 tokens; the margin leaves room for longer
# turn limits (slippery lakes) without changing the model. Sizes the model's RoPE table too.
MODEL_MAX_LENGTH = 512


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
        eos_token=EOT,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        model_max_length=MODEL_MAX_LENGTH,
    )
