"""The models the GPU check measures, built from config with random weights (no download).

Text: Qwen2.5-0.5B's shape (24 layers of width 896, 14 query and 2 key-value heads, MLP 4864,
a tied 151,936-token embedding: 494M parameters), saved with the shipped arithmetic tokenizer so
the default job can train it, and with no end-of-sequence id so that every sample runs to its
token budget (equal work in every engine and schedule; the tokenizer skips ids it does not have
when decoding, so the task's reward reads what few characters come out). ``tiny``: the same
architecture at width 64, two layers, a 512-token vocabulary, for the CPU smoke mode.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from gpu.common import Scale

__all__ = ["ARITHMETIC_MODEL", "qwen_shaped", "text_parameters"]

ARITHMETIC_MODEL = Path(__file__).resolve().parents[2] / "tasks" / "arithmetic" / "model"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _config(tiny: bool) -> Qwen2Config:
    if tiny:
        shape = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024}  # fmt: skip
    else:  # Qwen2.5-0.5B's config.json
        shape = {"vocab_size": 151_936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                 "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32_768}  # fmt: skip
    return Qwen2Config(
        **shape, tie_word_embeddings=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip


def qwen_shaped(scale: Scale) -> Path:
    """The text model's folder under ``scale.workdir`` (built once, then reused): random weights in
    ``scale.dtype``, initialised on ``scale.device`` (seconds on a GPU, where a CPU init of 494M
    parameters takes tens of seconds)."""
    folder = scale.workdir / ("qwen_tiny" if scale.tiny else "qwen2.5-0.5b-shaped")
    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(0)
    with torch.device(scale.device):
        model = AutoModelForCausalLM.from_config(_config(scale.tiny), dtype=scale.dtype)
    model.save_pretrained(folder)
    del model
    for name in _TOKENIZER_FILES:
        shutil.copy(ARITHMETIC_MODEL / name, folder / name)
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if path.is_file():
            data = json.loads(path.read_text())
            data["eos_token_id"] = None  # not removed: a default could bring one back
            path.write_text(json.dumps(data, indent=2))
    return folder


def text_parameters(folder: Path) -> int:
    """Parameters of the model in ``folder``, the N of model FLOPs (6·N per trained token): the
    tied embedding counts once, as the output projection's matmul (its lookup is no matmul)."""
    from transformers import AutoConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    return sum(p.numel() for p in model.parameters())
