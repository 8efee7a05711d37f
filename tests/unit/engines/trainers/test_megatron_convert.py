"""HF Llama/Qwen2 ↔ megatron weight conversion, as pure functions: bit-exact round trips, megatron's fused layouts, refusals.

The round trips through a real ``GPTModel`` (tensor parallel 1 in process, 2 in spawned
processes) and the log-prob and gradient parity live in ``test_megatron_model.py``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is an optional extra: pip install tandem[megatron]")

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen2Config

from tandem.engines.trainers.megatron.convert import WeightLayout, hf_to_megatron, megatron_to_hf, transformer_config
from tandem.param_sync import unique_weights
from tandem.tasks.arithmetic import MODEL_DIR

SHIPPED_MODEL = MODEL_DIR  # the shipped arithmetic model


def tiny_config(name: str) -> PretrainedConfig:
    """The tiny random models the megatron tests use (hidden 64, 2 layers); wide init, so log-probs are peaked."""
    common = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "initializer_range": 0.2}
    if name == "llama_tied":  # multi-head attention, head_dim not hidden/heads, tied embeddings
        return LlamaConfig(
            vocab_size=32,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=32,
            tie_word_embeddings=True,
            max_position_embeddings=128,
            **common,
        )
    if name == "qwen2":  # grouped-query attention (2 groups of 2), q/k/v biases, untied head
        return Qwen2Config(
            vocab_size=20,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            max_position_embeddings=128,
            **common,
        )
    if name == "llama3_rope":  # Llama 3's RoPE scaling; head_dim 16 puts low frequencies in the scaled band
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        return LlamaConfig(
            vocab_size=24,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            max_position_embeddings=16384,
            rope_parameters=rope,
            **common,
        )
    raise ValueError(name)


def hf_model(name: str, seed: int = 0) -> torch.nn.Module:
    """``tiny_config(name)`` with random weights, or the shipped arithmetic model for ``"shipped"``."""
    if name == "shipped":
        return AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL).eval()
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(name)).eval()


def layout_of(model: torch.nn.Module) -> WeightLayout:
    return WeightLayout.from_hf_config(model.config, transformer_engine=False)


@pytest.mark.parametrize("transformer_engine", [False, True], ids=["local_spec", "te_spec"])
@pytest.mark.parametrize("tensor_parallel", [1, 2])
@pytest.mark.parametrize("name", ["llama_tied", "qwen2", "shipped"])
def test_round_trip_is_bit_exact(name: str, tensor_parallel: int, transformer_engine: bool) -> None:
    model = hf_model(name)
    expected = unique_weights(model)  # the names param sync sends: a tied head once, as the embedding
    layout = WeightLayout.from_hf_config(model.config, transformer_engine=transformer_engine)
    shards = [hf_to_megatron(model.state_dict(), layout, rank=r, size=tensor_parallel) for r in range(tensor_parallel)]
    back = megatron_to_hf(shards, layout)
    assert back.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(back[key], tensor), key


def test_tied_embeddings_have_no_output_layer_and_untied_ones_do() -> None:
    tied = hf_to_megatron(hf_model("llama_tied").state_dict(), layout_of(hf_model("llama_tied")), rank=0, size=1)
    untied = hf_to_megatron(hf_model("qwen2").state_dict(), layout_of(hf_model("qwen2")), rank=0, size=1)
    assert "output_layer.weight" not in tied
    assert "output_layer.weight" in untied


def test_fused_qkv_puts_each_groups_queries_before_its_key_and_value() -> None:
    """Qwen2 tiny: 4 query heads in 2 groups, head_dim 16. Rows are tagged by origin (q 1000+, k 2000+, v 3000+)."""
    model = hf_model("qwen2")
    state = dict(model.state_dict())
    attn = "model.layers.0.self_attn."
    for p, tag in (("q", 1000), ("k", 2000), ("v", 3000)):
        for kind in ("weight", "bias"):
            rows = state[f"{attn}{p}_proj.{kind}"].shape[0]
            shape = state[f"{attn}{p}_proj.{kind}"].shape
            state[f"{attn}{p}_proj.{kind}"] = (
                (tag + torch.arange(rows, dtype=torch.float32)).reshape(-1, *[1] * (len(shape) - 1)).expand(shape)
            )
    d = 16
    group0 = [*range(1000, 1000 + 2 * d), *range(2000, 2000 + d), *range(3000, 3000 + d)]
    group1 = [*range(1000 + 2 * d, 1000 + 4 * d), *range(2000 + d, 2000 + 2 * d), *range(3000 + d, 3000 + 2 * d)]
    layout = layout_of(model)
    whole = hf_to_megatron(state, layout, rank=0, size=1)
    assert whole["decoder.layers.0.self_attention.linear_qkv.weight"][:, 0].tolist() == group0 + group1
    assert whole["decoder.layers.0.self_attention.linear_qkv.bias"].tolist() == group0 + group1
    for rank, group in enumerate((group0, group1)):  # tensor parallel 2: one group per rank
        shard = hf_to_megatron(state, layout, rank=rank, size=2)
        assert shard["decoder.layers.0.self_attention.linear_qkv.weight"][:, 0].tolist() == group


def test_fc1_stacks_each_ranks_gate_slice_on_its_up_slice() -> None:
    model = hf_model("qwen2")
    state = model.state_dict()
    gate, up = state["model.layers.1.mlp.gate_proj.weight"], state["model.layers.1.mlp.up_proj.weight"]
    half = gate.shape[0] // 2
    for rank in range(2):
        fc1 = hf_to_megatron(state, layout_of(model), rank=rank, size=2)["decoder.layers.1.mlp.linear_fc1.weight"]
        rows = slice(rank * half, (rank + 1) * half)
        assert torch.equal(fc1, torch.cat([gate[rows], up[rows]]))


def test_row_parallel_linears_split_columns_and_vocab_splits_rows() -> None:
    model = hf_model("qwen2")
    state = model.state_dict()
    shard = hf_to_megatron(state, layout_of(model), rank=1, size=2)
    assert torch.equal(
        shard["decoder.layers.0.self_attention.linear_proj.weight"], state["model.layers.0.self_attn.o_proj.weight"][:, 32:]
    )
    assert torch.equal(shard["decoder.layers.0.mlp.linear_fc2.weight"], state["model.layers.0.mlp.down_proj.weight"][:, 64:])
    assert torch.equal(shard["embedding.word_embeddings.weight"], state["model.embed_tokens.weight"][10:])
    assert torch.equal(shard["output_layer.weight"], state["lm_head.weight"][10:])
    assert torch.equal(shard["decoder.final_layernorm.weight"], state["model.norm.weight"])


def test_te_spec_names_the_norms_inside_the_linears() -> None:
    model = hf_model("qwen2")
    te = WeightLayout.from_hf_config(model.config, transformer_engine=True)
    names = hf_to_megatron(model.state_dict(), te, rank=0, size=1).keys()
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names
    assert not any("input_layernorm" in n or "pre_mlp_layernorm" in n for n in names)


def test_an_unmapped_hf_weight_is_refused_not_dropped() -> None:
    model = hf_model("qwen2")
    state = {**model.state_dict(), "model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}
    with pytest.raises(ValueError, match=r"unmapped \['model.layers.0.self_attn.o_proj.bias'\]"):
        hf_to_megatron(state, layout_of(model), rank=0, size=1)


@pytest.mark.parametrize(
    ("name", "change", "tensor_parallel", "message"),
    [
        ("llama_tied", {"attention_bias": True}, 1, "attention_bias"),
        ("llama_tied", {"mlp_bias": True}, 1, "mlp_bias"),
        ("llama_tied", {"hidden_act": "gelu"}, 1, "hidden_act"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1, "layer_types": None}, 1, "sliding"),
        ("llama_tied", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, 1, "rope_type"),
        (
            "llama3_rope",
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 1e4,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 4096,
                }
            },
            1,
            "original_max_position_embeddings",
        ),
        ("qwen2", {"vocab_size": 21}, 2, "vocab_size 21"),
    ],
)
def test_configs_the_mapping_cannot_represent_are_refused(name: str, change: dict, tensor_parallel: int, message: str) -> None:
    config = type(tiny_config(name))(**{**tiny_config(name).to_dict(), **change})
    with pytest.raises(ValueError, match=message):
        transformer_config(config, tensor_parallel_size=tensor_parallel, dtype=torch.float32, device=torch.device("cpu"))


def test_transformer_config_mirrors_the_hf_config() -> None:
    config = transformer_config(
        tiny_config("llama_tied"), tensor_parallel_size=2, dtype=torch.float32, device=torch.device("cpu")
    )
    assert (config.num_layers, config.hidden_size, config.ffn_hidden_size) == (2, 64, 128)
    assert (config.num_attention_heads, config.num_query_groups, config.kv_channels) == (4, 4, 32)
    assert config.normalization == "RMSNorm" and config.gated_linear_unit and not config.add_qkv_bias
    assert config.hidden_dropout == config.attention_dropout == 0.0
    assert transformer_config(
        tiny_config("qwen2"), tensor_parallel_size=1, dtype=torch.float32, device=torch.device("cpu")
    ).add_qkv_bias
