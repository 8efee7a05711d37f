"""A tiny Qwen2 built from config with a byte-level BPE tokenizer and a ChatML template: the
shape of a user's own chat model, trained on a few lines here, no downloads.

The template writes ``<bos>`` itself (as Llama's and Gemma's do) and the tokenizer's
post-processor adds one too when asked for special tokens: a prompt rendered by the template and
tokenized with them would start ``<bos><bos>``, the doubling the engines must avoid.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config
from transformers.utils import logging as hf_logging

SPECIAL = ["<pad>", "<bos>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LINES = [
    "What is 3 plus 4? The answer is 7.",
    "Tom has 12 apples and gives away 5. How many are left? 7",
    "Half of 1 is 1/2, which is 0.5. Put the answer in \\boxed{}.",
    "system user assistant You are a helpful assistant.",
    "0123456789 + - * / = . , ? !",
]


def save_chat_model(path: Path, *, chat_template: str | None = CHATML, seed: int = 0) -> Path:
    """Write a random tiny Qwen2 and its BPE tokenizer (with ``chat_template``, or none) to ``path``."""
    hf_logging.disable_progress_bar()
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        LINES, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    )
    bos = bpe.token_to_id("<bos>")
    bpe.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<bos>", eos_token="<|im_end|>", pad_token="<pad>", chat_template=chat_template
    )
    tokenizer.save_pretrained(path)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512, bos_token_id=bos,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path
