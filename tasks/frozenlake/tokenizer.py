"""The character-level tokenizer of the FrozenLake task, built with ``tokenizers``.

Owns the vocabulary and its ids: one token per character the grid and the actions use, plus the
special tokens. Ids are fixed (specials first) so a rebuilt tokenizer always matches the shipped
weights. ``<eot>`` ends every model turn; it is the tokenizer's ``eos_token`` and the model's
generation stop token, so ``generate`` returns after one turn. Every encoded text starts with
``<bos>`` (added by the post-processor; encode later pieces of an episode with
``add_special_tokens=False``). Padding is on the left for batched generation.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from tandem.tasks.char_tokenizer import BOS, char_tokenizer, char_vocab

__all__ = ["BOS", "CHARACTERS", "EOT", "MODEL_MAX_LENGTH", "VOCAB", "build_tokenizer"]

EOT = "<eot>"
# The grid's tiles, the agent and the lake's edge, the line separator, then the four actions.
CHARACTERS = (".", "H", "G", "@", "#", "\n", "L", "D", "R", "U")
VOCAB: dict[str, int] = char_vocab(CHARACTERS, EOT)
# A whole default episode is at most 1 + 10 * (25 + 2) = 271 tokens; the margin leaves room for longer
# turn limits (slippery lakes) without changing the model. Sizes the model's RoPE table too.
MODEL_MAX_LENGTH = 512


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh tokenizer with the fixed vocabulary (``tasks.char_tokenizer``), wrapped for ``transformers``."""
    return char_tokenizer(CHARACTERS, eos=EOT, model_max_length=MODEL_MAX_LENGTH)
