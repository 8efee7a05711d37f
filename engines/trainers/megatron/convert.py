"""Hugging Face Llama/Qwen2 causal LMs as megatron-core ``GPTModel``s: the config, the model, the weights both ways.

What it owns: how a transformers ``LlamaConfig``/``Qwen2Config`` becomes a ``TransformerConfig`` and
a ``GPTModel`` (megatron's local layer spec; the Transformer Engine spec on CUDA when
``transformer_engine`` is importable), and how weights move between the two naming schemes, one
tensor-parallel shard at a time (HF → megatron) or gathered whole (megatron → HF).

The mapping, per decoder layer (HF ``model.layers.i.`` → megatron ``decoder.layers.i.``):

- ``q_proj``, ``k_proj``, ``v_proj`` (weights, and biases for Qwen2) → ``self_attention.linear_qkv``,
  fused group by group: for each of the ``G`` key/value groups, its ``H/G`` query heads, then its
  key head, then its value head (the layout ``Attention.get_query_key_value_tensors`` splits);
  tensor-parallel rank ``r`` of ``T`` holds the ``r``-th contiguous ``1/T`` of those rows;
- ``o_proj`` → ``self_attention.linear_proj`` (row parallel: rank ``r`` holds the ``r``-th slice of columns);
- ``gate_proj``, ``up_proj`` → ``mlp.linear_fc1`` (``activation(first half) * second half``): each
  rank holds its slice of ``gate`` stacked on its slice of ``up``;
- ``down_proj`` → ``mlp.linear_fc2`` (row parallel);
- ``input_layernorm`` → ``input_layernorm`` (``self_attention.linear_qkv.layer_norm_weight`` in the
  Transformer Engine spec, which fuses the norm into the next linear), ``post_attention_layernorm``
  → ``pre_mlp_layernorm`` (``mlp.linear_fc1.layer_norm_weight``); norms are replicated;

and ``model.embed_tokens`` → ``embedding.word_embeddings``, ``lm_head`` → ``output_layer`` (both split
by vocabulary rows), ``model.norm`` → ``decoder.final_layernorm``. With tied embeddings the output
layer is the embedding (megatron's ``share_embeddings_and_output_weights``) and the HF side has
only ``model.embed_tokens.weight``, as ``param_sync.unique_weights`` names it.

Invariants:
- conversion moves and slices tensors, never computes on them: HF → megatron → HF is bit-exact;
- every HF weight is used or refused: an unmapped name raises instead of being dropped;
- a configuration this mapping cannot represent exactly (other activations, biases on other
  linears, sliding-window attention, other RoPE variants, a vocabulary not divisible by the
  tensor-parallel size) raises ``ValueError`` naming the field;
- pipeline parallel 1: one stage holds every layer, the embedding and the output layer.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig
from transformers import PretrainedConfig

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "WeightLayout",
    "build_gpt_model",
    "gather_hf_tensors",
    "hf_to_megatron",
    "load_hf_weights",
    "megatron_to_hf",
    "transformer_config",
]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
# float64 (CPU): for tests that compare training steps exactly, as ``TorchTrainEngine``'s do.
_DTYPES = (torch.float32, torch.bfloat16, torch.float64)
# megatron's RoPE scaling (``RotaryEmbedding._apply_scaling``) is Llama 3's with these fixed.
_MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# How a megatron tensor relates to its HF tensor(s) under tensor parallelism.
_Kind = Literal["replicated", "rows", "columns", "qkv", "gate_up"]


@dataclass(frozen=True, slots=True)
class WeightLayout:
    """What the weight mapping needs to know about a model (see the module docstring)."""

    num_layers: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    qkv_bias: bool
    tied_embeddings: bool
    transformer_engine: bool  # TE spec: the layer norms live inside linear_qkv and linear_fc1

    @classmethod
    def from_hf_config(cls, config: PretrainedConfig, *, transformer_engine: bool) -> WeightLayout:
        return cls(
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_query_groups=config.num_key_value_heads,
            head_dim=_head_dim(config),
            qkv_bias=config.model_type == "qwen2",  # Qwen2's q/k/v always have biases, Llama's never (checked)
            tied_embeddings=bool(config.tie_word_embeddings),
            transformer_engine=transformer_engine,
        )


@dataclass(frozen=True, slots=True)
class _Rule:
    megatron: str
    hf: tuple[str, ...]
    kind: _Kind


def _rules(layout: WeightLayout) -> list[_Rule]:
    """Every megatron tensor of the model with the HF tensors it is made of, in HF state-dict order."""
    rules = [_Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "rows")]
    for i in range(layout.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        attn = f"{h}self_attn."
        input_norm = "self_attention.linear_qkv.layer_norm_weight" if layout.transformer_engine else "input_layernorm.weight"
        mlp_norm = "mlp.linear_fc1.layer_norm_weight" if layout.transformer_engine else "pre_mlp_layernorm.weight"
        rules += [
            _Rule(m + input_norm, (h + "input_layernorm.weight",), "replicated"),
            _Rule(m + "self_attention.linear_qkv.weight", tuple(f"{attn}{p}_proj.weight" for p in "qkv"), "qkv"),
        ]
        if layout.qkv_bias:
            rules.append(_Rule(m + "self_attention.linear_qkv.bias", tuple(f"{attn}{p}_proj.bias" for p in "qkv"), "qkv"))
        rules += [
            _Rule(m + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), "columns"),
            _Rule(m + mlp_norm, (h + "post_attention_layernorm.weight",), "replicated"),
            _Rule(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), "gate_up"),
            _Rule(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "columns"),
        ]
    rules.append(_Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
    if not layout.tied_embeddings:
        rules.append(_Rule("output_layer.weight", ("lm_head.weight",), "rows"))
    return rules


# ---------------------------------------------------------------- the config and the model


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _check_supported(config: PretrainedConfig, tensor_parallel_size: int) -> None:
    """Refuse, naming the field, what ``GPTModel`` with this mapping would not compute exactly."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {config.model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})")
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (SwiGLU, 'silu', only)")
    for field in ("attention_bias", "mlp_bias"):  # Llama: biases on every attention/MLP linear
        if getattr(config, field, False):
            raise ValueError(f"{field}=True is not supported")
    if config.model_type == "qwen2" and any(t != "full_attention" for t in config.layer_types):
        raise ValueError("sliding-window attention (use_sliding_window / layer_types) is not supported")
    rope = config.rope_parameters
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("rope_parameters.partial_rotary_factor other than 1 is not supported")
    if rope["rope_type"] == "llama3":
        differing = {k: rope.get(k) for k, v in _MEGATRON_LLAMA3_ROPE.items() if rope.get(k) != v}
        if differing:
            raise ValueError(f"rope_parameters {differing} differ from megatron's fixed llama3 scaling {_MEGATRON_LLAMA3_ROPE}")
    elif rope["rope_type"] != "default":
        raise ValueError(f"rope_parameters.rope_type {rope['rope_type']!r} is not supported (default, llama3)")
    if config.vocab_size % tensor_parallel_size:
        raise ValueError(f"vocab_size {config.vocab_size} is not divisible by the tensor-parallel size {tensor_parallel_size}")


def transformer_config(
    config: PretrainedConfig, *, tensor_parallel_size: int, dtype: torch.dtype, device: torch.device
) -> TransformerConfig:
    """The ``TransformerConfig`` of a Llama/Qwen2 HF config: RMSNorm, SwiGLU, GQA, no dropout.

    Dropout is 0 because the trainer recomputes log-probs that must equal the rollout's. Weights
    are not initialised (``perform_initialization=False``): they are loaded from the HF model.
    """
    _check_supported(config, tensor_parallel_size)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype} is not supported (float32, bfloat16, float64)")
    return TransformerConfig(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_key_value_heads,
        kv_channels=_head_dim(config),
        normalization="RMSNorm",
        layernorm_epsilon=config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=config.model_type == "qwen2",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tensor_parallel_size,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=device.type == "cpu",
        perform_initialization=False,
    )


def _transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def build_gpt_model(config: PretrainedConfig, *, dtype: torch.dtype, device: torch.device) -> tuple[GPTModel, WeightLayout]:
    """This rank's ``GPTModel`` for an HF config (weights uninitialised: see :func:`load_hf_weights`).

    Needs megatron's parallel state (``engines.trainers.megatron.parallel.model_parallel``): the model is
    this process's tensor-parallel shard. The Transformer Engine spec is used on CUDA when TE is
    importable (TE has no CPU kernels); otherwise megatron's local spec.
    """
    tensor_parallel_size = parallel_state.get_tensor_model_parallel_world_size()
    use_te = device.type == "cuda" and _transformer_engine_available()
    spec = get_gpt_layer_with_transformer_engine_spec() if use_te else get_gpt_layer_local_spec(normalization="RMSNorm")
    rope = config.rope_parameters
    model = GPTModel(
        transformer_config(config, tensor_parallel_size=tensor_parallel_size, dtype=dtype, device=device),
        spec,
        vocab_size=config.vocab_size,
        max_sequence_length=config.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=rope["rope_theta"],
        rope_scaling=rope["rope_type"] == "llama3",
        rope_scaling_factor=rope.get("factor", 8.0),
        share_embeddings_and_output_weights=bool(config.tie_word_embeddings),
    )
    layout = WeightLayout.from_hf_config(config, transformer_engine=use_te)
    _mark_tensor_parallel(model, layout)
    for param in model.parameters():
        # megatron's local-spec norms (torch's RMSNorm) are built float32 whatever ``params_dtype``;
        # HF keeps them in the model's dtype, and param sync needs every weight in the rollout's.
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
    return model, layout


def _mark_tensor_parallel(model: GPTModel, layout: WeightLayout) -> None:
    """Give every parameter megatron's tensor-parallel attributes where its layers left them unset.

    Megatron's linear and embedding layers set them only while initialising weights, which
    ``perform_initialization=False`` skips; without them megatron (and our gradient norm) would
    take every weight for a copy replicated over the tensor-parallel ranks and count it once.
    """
    params = dict(model.named_parameters())
    for rule in _rules(layout):
        param = params[rule.megatron]
        if not hasattr(param, "tensor_model_parallel"):
            param.tensor_model_parallel = rule.kind != "replicated"  # type: ignore[attr-defined]
            param.partition_dim = 1 if rule.kind == "columns" else 0  # type: ignore[attr-defined]
            param.partition_stride = 1  # type: ignore[attr-defined]


# ---------------------------------------------------------------- tensors: one rule at a time


def _slice(tensor: torch.Tensor, rank: int, size: int, dim: int) -> torch.Tensor:
    if tensor.shape[dim] % size:
        raise ValueError(f"dimension {dim} of shape {tuple(tensor.shape)} does not split into {size} shards")
    step = tensor.shape[dim] // size
    return tensor.narrow(dim, rank * step, step)


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: WeightLayout) -> torch.Tensor:
    """[q; k; v] rows regrouped as megatron's linear_qkv: per group, its query heads, its key, its value."""
    groups = layout.num_query_groups
    per_group = [t.reshape(groups, -1, *t.shape[1:]) for t in (q, k, v)]
    return torch.cat(per_group, dim=1).reshape(-1, *q.shape[1:])


def _split_qkv(fused: torch.Tensor, layout: WeightLayout) -> list[torch.Tensor]:
    groups, d = layout.num_query_groups, layout.head_dim
    per_group = fused.reshape(groups, -1, *fused.shape[1:])
    sizes = [layout.num_heads // groups * d, d, d]
    return [t.reshape(-1, *fused.shape[1:]) for t in per_group.split(sizes, dim=1)]


def _shard(rule: _Rule, hf: list[torch.Tensor], rank: int, size: int, layout: WeightLayout) -> torch.Tensor:
    """Rank ``rank``'s megatron tensor, from the full HF tensors of ``rule``."""
    if rule.kind == "replicated":
        return hf[0].clone()
    if rule.kind == "rows":
        return _slice(hf[0], rank, size, 0).clone()
    if rule.kind == "columns":
        return _slice(hf[0], rank, size, 1).clone()
    if rule.kind == "qkv":
        return _slice(_fuse_qkv(*hf, layout), rank, size, 0).clone()
    gate, up = hf
    return torch.cat([_slice(gate, rank, size, 0), _slice(up, rank, size, 0)])


def _merge(rule: _Rule, shards: Sequence[torch.Tensor], layout: WeightLayout) -> list[torch.Tensor]:
    """The full HF tensors of ``rule`` from every rank's megatron tensor (only the first if replicated)."""
    if rule.kind == "replicated":
        return [shards[0]]
    if rule.kind == "rows":
        return [torch.cat(list(shards))]
    if rule.kind == "columns":
        return [torch.cat(list(shards), dim=1)]
    if rule.kind == "qkv":
        return _split_qkv(torch.cat(list(shards)), layout)
    halves = [s.chunk(2) for s in shards]
    return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]


# ---------------------------------------------------------------- whole models


def hf_to_megatron(
    hf_state: Mapping[str, torch.Tensor], layout: WeightLayout, *, rank: int, size: int
) -> dict[str, torch.Tensor]:
    """Tensor-parallel rank ``rank`` of ``size``'s megatron state from a full HF state dict."""
    ignored = {"lm_head.weight"} if layout.tied_embeddings else set()  # HF may list the tied head too
    rules = _rules(layout)
    used = {name for rule in rules for name in rule.hf}
    missing = sorted(used - hf_state.keys())
    unmapped = sorted(hf_state.keys() - used - ignored)
    if missing or unmapped:
        raise ValueError(f"HF weights do not match the layout: missing {missing}, unmapped {unmapped}")
    return {rule.megatron: _shard(rule, [hf_state[n] for n in rule.hf], rank, size, layout) for rule in rules}


def megatron_to_hf(shards: Sequence[Mapping[str, torch.Tensor]], layout: WeightLayout) -> dict[str, torch.Tensor]:
    """Full HF-named tensors from every tensor-parallel rank's megatron state, ``shards[r]`` rank ``r``'s."""
    out: dict[str, torch.Tensor] = {}
    for rule in _rules(layout):
        out.update(zip(rule.hf, _merge(rule, [s[rule.megatron] for s in shards], layout), strict=True))
    return out


def load_hf_weights(model: GPTModel, hf_state: Mapping[str, torch.Tensor], layout: WeightLayout) -> None:
    """Copy this rank's shard of a full HF state dict into ``model`` (every parameter, or raise)."""
    state = hf_to_megatron(
        hf_state,
        layout,
        rank=parallel_state.get_tensor_model_parallel_rank(),
        size=parallel_state.get_tensor_model_parallel_world_size(),
    )
    result = model.load_state_dict(state, strict=False)
    # Transformer Engine modules keep an ``_extra_state`` (FP8 metadata) that HF weights lack.
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise ValueError(f"megatron model does not match the layout: missing {missing}, unexpected {result.unexpected_keys}")


def gather_hf_tensors(local: Mapping[str, torch.Tensor], layout: WeightLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF-named tensors, one rule at a time, all-gathered over this rank's tensor-parallel group.

    ``local`` maps megatron names to this rank's tensors: parameters, or their gradients. A
    replicated tensor (a norm) comes back as ``local``'s own tensor, detached, not a copy. A
    collective: every rank of the group must iterate to the end, in the same order.
    """
    group = parallel_state.get_tensor_model_parallel_group()
    size = dist.get_world_size(group)
    for rule in _rules(layout):
        tensor = local[rule.megatron].detach()
        if rule.kind == "replicated" or size == 1:
            pieces = [tensor]
        else:
            pieces = [torch.empty_like(tensor) for _ in range(size)]
            dist.all_gather(pieces, tensor.contiguous(), group=group)
        yield from zip(rule.hf, _merge(rule, pieces, layout), strict=True)
