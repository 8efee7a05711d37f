"""LoRA with peft: default targets per architecture (causal LMs and diffusers transformers), targets
checked before any weights load, the merged export, and the base as the adapter-disabled model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import SD3Transformer2DModel
from transformers import AutoConfig, AutoModelForCausalLM

from tandem.core.config import ConfigError, LoraConfig
from tandem.engines.shared.lora import (
    CAUSAL_LM_TARGETS,
    DIFFUSERS_TARGETS,
    adapter_tensors,
    load_adapter,
    lora_settings,
    save_adapter,
    save_merged,
    transformer_lora_settings,
    with_adapter,
)
from tandem.engines.shared.probe import probe_logprobs, probe_sequence
from tandem.tasks.digits import MODEL_DIR as DIGITS_DIR

pytest.importorskip("peft", reason="LoRA needs the lora extra (peft)")


@pytest.mark.parametrize("model_type", sorted(CAUSAL_LM_TARGETS))
def test_each_architectures_default_targets_are_its_attention_and_mlp_layers(model_type: str, tmp_path: Path) -> None:
    AutoConfig.for_model(model_type, num_hidden_layers=1).save_pretrained(tmp_path)
    settings = lora_settings(LoraConfig(), tmp_path)  # raises unless every default name matches a layer
    assert set(settings.target_modules) == set(CAUSAL_LM_TARGETS[model_type])


def test_a_target_that_matches_no_layer_is_named_even_beside_good_ones(model_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"engines.lora.target_modules: \['q_prj'\] match no layer .*'q_proj'"):
        lora_settings(LoraConfig(target_modules=["q_proj", "q_prj"]), model_dir)
    with pytest.raises(ConfigError, match=r"engines.lora.target_modules=\['nope'\]: .*not found"):
        lora_settings(LoraConfig(target_modules=["nope"]), model_dir)


def test_an_architecture_without_defaults_needs_its_targets_named(tmp_path: Path) -> None:
    AutoConfig.for_model("bloom", n_layer=1).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="engines.lora.target_modules: no default for model type 'bloom'"):
        lora_settings(LoraConfig(), tmp_path)
    assert lora_settings(LoraConfig(target_modules=["query_key_value"]), tmp_path).r == 8


def test_the_sd3_transformers_default_targets_are_the_attention_projections_it_has(tmp_path: Path) -> None:
    shipped = DIGITS_DIR / "transformer"
    settings = transformer_lora_settings(LoraConfig(), SD3Transformer2DModel, shipped)
    assert set(settings.target_modules) == set(DIFFUSERS_TARGETS["SD3Transformer2DModel"])
    config = SD3Transformer2DModel.load_config(shipped)
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_layers": 1}))
    one_block = transformer_lora_settings(LoraConfig(), SD3Transformer2DModel, tmp_path)
    # A single block is the last one, whose prompt stream ends there: it has no to_add_out.
    assert set(one_block.target_modules) == set(DIFFUSERS_TARGETS["SD3Transformer2DModel"]) - {"to_add_out"}


def test_a_transformer_target_that_matches_no_layer_is_named_and_other_classes_need_theirs() -> None:
    shipped = DIGITS_DIR / "transformer"
    with pytest.raises(ConfigError, match=r"engines.lora.target_modules: \['to_qq'\] match no layer .*'to_q'"):
        transformer_lora_settings(LoraConfig(target_modules=["to_q", "to_qq"]), SD3Transformer2DModel, shipped)

    class MyTransformer(SD3Transformer2DModel):
        pass

    with pytest.raises(ConfigError, match="engines.lora.target_modules: no default for the transformer MyTransformer"):
        transformer_lora_settings(LoraConfig(), MyTransformer, shipped)
    assert transformer_lora_settings(LoraConfig(target_modules=["to_q"]), MyTransformer, shipped).target_modules == {"to_q"}


def adapted(model_dir: Path, seed: int = 1, **lora: object) -> torch.nn.Module:
    """The model with an adapter whose B is random too (peft starts it at zero: a no-op)."""
    model = with_adapter(AutoModelForCausalLM.from_pretrained(model_dir), lora_settings(LoraConfig(**lora), model_dir))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in adapter_tensors(model).values():
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.1)
    return model


def test_a_fresh_adapter_computes_the_base_and_a_disabled_one_too(model_dir: Path) -> None:
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    tokens = probe_sequence(base.config.vocab_size)
    settings = lora_settings(LoraConfig(), model_dir)
    fresh = with_adapter(AutoModelForCausalLM.from_pretrained(model_dir), settings)
    assert probe_logprobs(fresh, tokens) == probe_logprobs(base, tokens)  # B = 0
    trained = adapted(model_dir)
    assert probe_logprobs(trained, tokens) != probe_logprobs(base, tokens)
    with trained.disable_adapter():
        assert probe_logprobs(trained, tokens) == probe_logprobs(base, tokens)


def test_the_merged_export_is_the_base_plus_the_scaled_adapter_product(model_dir: Path, tmp_path: Path) -> None:
    model = adapted(model_dir, rank=4, alpha=32.0)
    adapter = {name: t.detach().clone() for name, t in adapter_tensors(model).items()}
    save_merged(model_dir, model.peft_config["default"], adapter, tmp_path, torch.float32)

    merged = AutoModelForCausalLM.from_pretrained(tmp_path)  # plain transformers, no peft
    base = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    a, b = adapter[f"{prefix}.lora_A.weight"], adapter[f"{prefix}.lora_B.weight"]
    expected = base["model.layers.0.self_attn.q_proj.weight"] + (32.0 / 4) * b @ a
    assert torch.allclose(merged.state_dict()["model.layers.0.self_attn.q_proj.weight"], expected, atol=1e-6, rtol=0)
    assert torch.equal(merged.state_dict()["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    tokens = probe_sequence(merged.config.vocab_size)
    gap = max(abs(x - y) for x, y in zip(probe_logprobs(merged, tokens), probe_logprobs(model, tokens), strict=True))
    assert gap < 1e-4


def test_the_adapter_export_loads_with_peft_on_the_base(model_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel

    model = adapted(model_dir)
    save_adapter(model, adapter_tensors(model), tmp_path)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), tmp_path)
    tokens = probe_sequence(model.config.vocab_size)
    assert probe_logprobs(loaded, tokens) == probe_logprobs(model, tokens)


def test_loading_another_adapters_tensors_is_refused_naming_them(model_dir: Path) -> None:
    q_only = adapter_tensors(adapted(model_dir, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="tensors given for an adapter of"):
        load_adapter(adapted(model_dir), q_only)
