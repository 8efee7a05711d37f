"""LoRA adapters on causal LMs, with peft: which layers get one, what trains and syncs, the merged export.

What it owns: the per-architecture default target modules; :func:`lora_settings`, which turns
``engines.lora`` into peft's ``LoraConfig`` after checking every target against the model's
layers (on a skeleton on the meta device, before any engine loads weights); wrapping a model
(:func:`with_adapter`); the adapter's live tensors under peft's own names
(:func:`adapter_tensors`, :func:`load_adapter`); dropout in the gradient forward only
(:func:`adapter_dropout`); and the exports (:func:`save_adapter`, :func:`save_merged`). No LoRA
layer is written here: peft's are used.

peft is imported inside the functions: only runs that train an adapter pay for it (seconds).

Invariants:
- a freshly wrapped model computes exactly its base model (peft starts every B at zero,
  whatever A was drawn), so a rollout engine that has received no sync yet serves the trainer's
  version 0;
- :func:`adapter_tensors` names each adapter tensor as peft's ``adapter_model.safetensors``
  does (the adapter's name removed), in the same order on every model wrapped with the same
  settings: the trainer's sync, the rollout engine's target, the checkpoints and the export
  all use these names.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from tandem.core.config import ConfigError, LoraConfig

if TYPE_CHECKING:
    import peft

__all__ = [
    "CAUSAL_LM_TARGETS",
    "adapter_dropout",
    "adapter_tensors",
    "load_adapter",
    "lora_settings",
    "save_adapter",
    "save_merged",
    "with_adapter",
]

_LLAMA_LIKE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Attention and MLP projections by ``model_type``: every linear layer of a decoder block, as
# QLoRA found adapting all of them matches full fine-tuning where attention alone does not.
# Checked against each architecture's layers by tests/unit/engines/shared/test_lora.py.
CAUSAL_LM_TARGETS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo2"), _LLAMA_LIKE),
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    "gpt2": ("c_attn", "c_proj", "c_fc"),
    "gpt_neox": ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
}


def lora_settings(spec: LoraConfig, model_path: str | Path) -> peft.LoraConfig:
    """peft's ``LoraConfig`` for ``spec`` on the model at ``model_path``; :class:`ConfigError`
    naming ``engines.lora.target_modules`` when the architecture has no default or a name
    matches no layer peft can adapt (each name must match one, so a typo beside good names fails)."""
    try:
        from peft import LoraConfig as PeftLoraConfig
    except ImportError:
        raise ConfigError("engines.lora needs peft: pip install 'tandem[lora]' (make installs it)") from None
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    config = AutoConfig.from_pretrained(str(model_path))
    targets = spec.target_modules or CAUSAL_LM_TARGETS.get(config.model_type)
    if targets is None:
        raise ConfigError(
            f"engines.lora.target_modules: no default for model type {config.model_type!r} ({model_path}); name the "
            f"layers to adapt (defaults exist for {sorted(CAUSAL_LM_TARGETS)})"
        )
    settings = PeftLoraConfig(
        r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=list(targets), bias="none",
        task_type="CAUSAL_LM",
    )  # fmt: skip
    with torch.device("meta"):  # the layers' names and types, no weights
        skeleton = AutoModelForCausalLM.from_config(config)
    linear = (nn.Linear, Conv1D)  # GPT-2's projections are Conv1D
    layers = sorted({name.rsplit(".", 1)[-1] for name, m in skeleton.named_modules() if isinstance(m, linear)})
    try:
        adapted = with_adapter(skeleton, settings).targeted_module_names
    except ValueError as err:  # peft: nothing matched, or a match it cannot adapt
        raise ConfigError(f"engines.lora.target_modules={list(targets)}: {err} (linear layers: {layers})") from None
    unmatched = [t for t in targets if not any(name == t or name.endswith(f".{t}") for name in adapted)]
    if unmatched:
        raise ConfigError(
            f"engines.lora.target_modules: {unmatched} match no layer of {model_path} ({config.model_type}); "
            f"its linear layers are named {layers}"
        )
    return settings


def with_adapter(model: nn.Module, settings: peft.LoraConfig) -> peft.PeftModel:
    """``model`` wrapped with a fresh adapter (peft's ``get_peft_model``): the base frozen, the
    adapter's tensors requiring grad."""
    from peft import get_peft_model

    with warnings.catch_warnings():
        # peft asks the model a deprecated transformers question; the answer is right, the warning noise.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        return get_peft_model(model, settings)


def adapter_tensors(model: peft.PeftModel) -> dict[str, torch.Tensor]:
    """The adapter's live parameters (not copies: loading into their ``.data`` changes the
    model) under peft's saved names, e.g. ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, state_dict=model.state_dict(keep_vars=True), save_embedding_layers=False)


def load_adapter(model: peft.PeftModel, adapter: Mapping[str, torch.Tensor]) -> None:
    """Copy ``adapter`` (tensors under :func:`adapter_tensors`' names) into ``model``'s adapter;
    ``ValueError`` naming the difference unless it holds exactly this adapter's tensors."""
    live = adapter_tensors(model)
    if adapter.keys() != live.keys():
        raise ValueError(
            f"{len(adapter)} tensors given for an adapter of {len(live)} (e.g. {sorted(adapter.keys() ^ live.keys())[:2]}): "
            "saved with other engines.lora settings, or without an adapter"
        )
    with torch.no_grad():
        for name, tensor in live.items():
            tensor.copy_(adapter[name])


@contextmanager
def adapter_dropout(model: nn.Module) -> Iterator[None]:
    """Run the block with the adapters' dropout on, the rest of the model in ``eval()`` as always."""
    dropouts = [m for name, m in model.named_modules() if isinstance(m, nn.Dropout) and ".lora_dropout." in name]
    for m in dropouts:
        m.train()
    try:
        yield
    finally:
        for m in dropouts:
            m.eval()


def save_adapter(model: peft.PeftModel, adapter: Mapping[str, torch.Tensor], folder: Path) -> None:
    """Write ``adapter`` (a snapshot under :func:`adapter_tensors`' names) with ``model``'s
    settings in peft's format (``adapter_config.json``, ``adapter_model.safetensors``), loadable
    with ``PeftModel.from_pretrained`` on the base."""
    # save_embedding_layers=False: the base's embeddings never train here, and peft's "auto"
    # would load the base's config again to find out.
    model.save_pretrained(folder, state_dict=dict(adapter), save_embedding_layers=False)


def save_merged(
    model_path: str | Path, settings: peft.LoraConfig, adapter: Mapping[str, torch.Tensor], folder: Path, dtype: torch.dtype
) -> None:
    """Write the base at ``model_path`` with ``adapter`` merged in (each adapted weight
    ``W + (alpha / rank) B A``, by peft's ``merge_and_unload``) to ``folder``, loadable with plain
    ``from_pretrained``. Loads a copy of the base for it: the trainer's own keeps its adapter apart."""
    from transformers import AutoModelForCausalLM

    model = with_adapter(AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype), settings)
    load_adapter(model, adapter)
    model.merge_and_unload().save_pretrained(folder)
