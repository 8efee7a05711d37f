"""A tiny random Qwen2 causal LM with a character tokenizer, saved to disk like a shipped model.

The real shipped model lives in ``tasks/``; these tests only need the same shape of artifact.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config
from transformers.utils import logging as hf_logging

VOCAB = ["<pad>", "<eos>", *"0123456789", *"+= abcde"]  # 20 tokens
EOS_ID = 1


def encode(text: str) -> list[int]:
    return [VOCAB.index(ch) for ch in text]


def decode(ids: list[int]) -> str:
    """What the tokenizer decodes with ``skip_special_tokens``: one character per ordinary token."""
    return "".join(VOCAB[i] for i in ids if i > EOS_ID)


def save_tiny_model(path: Path, *, seed: int, eos: bool, tied: bool = False, heads: int = 4) -> Path:
    """Write model + tokenizer to ``path``; ``eos`` decides whether generation stops on <eos>,
    ``tied`` whether the LM head shares the embedding matrix, ``heads`` the attention heads (of
    64 / heads dimensions each; vLLM's CPU attention needs 32 or more)."""
    hf_logging.disable_progress_bar()
    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>").save_pretrained(path)
    config = Qwen2Config(
        vocab_size=len(VOCAB),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        # Wide init: peaked next-token distributions, so log-prob comparisons are discriminative.
        initializer_range=0.2,
        eos_token_id=EOS_ID if eos else None,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path
