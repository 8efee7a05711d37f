"""``engines.lora``: refused, naming the fields, wherever adapters were not built; documented defaults."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.core.config import ConfigError, LoraConfig, load_config, validate_config

TORCH: dict[str, Any] = {
    "task": {"name": "arithmetic"},
    "flow": {"stages": ["dataloader", "generate", "rollout", "logp", "reward", "train"]},
    "engines": {"type": "torch", "lora": {}},
}


def config(**engines: Any) -> Any:
    data: dict[str, Any] = {**TORCH, "engines": {**TORCH["engines"], **engines.pop("engines", {})}, **engines}
    return validate_config(data)


def test_the_defaults_train_rank_8_at_the_engines_lr_with_the_probe_on() -> None:
    lora = config().engines.lora
    assert (lora.rank, lora.alpha, lora.dropout, lora.target_modules, lora.lr) == (8, 16.0, 0.0, None, None)
    assert lora.max_gap("float32") == 1e-3 and lora.max_gap("bfloat16") == 0.25  # the vLLM probe's defaults
    assert LoraConfig(probe_max_gap=1e-5).max_gap("float32") == 1e-5


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"engines": {"rollout": "vllm_server"}}, r"engines.lora with engines.rollout=vllm_server: .*embedded, server or vllm"),
        ({"engines": {"train": "megatron"}}, r"engines.lora with engines.train=megatron: .*engines.data_parallel=fsdp2 or ddp"),
        ({"cluster": {"backend": "ray"}}, r"engines.lora with cluster.backend=ray"),
        ({"engines": {"lora": {"target_modules": []}}}, r"engines.lora.target_modules: give at least one"),
        ({"engines": {"lora": {"rank": 0}}}, r"lora.rank: Input should be greater than or equal to 1"),
        ({"engines": {"lora": {"dropout": 1.0}}}, r"lora.dropout: Input should be less than 1"),
    ],
)
def test_what_adapters_do_not_support_is_refused_naming_the_fields(sections: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config(**sections)


@pytest.mark.parametrize(
    "engines", [{"data_parallel": "fsdp2"}, {"data_parallel": "fsdp2", "train_world_size": 2}, {"train_world_size": 2}]
)
def test_adapters_train_on_fsdp2_and_ddp_trainer_groups(engines: dict[str, Any]) -> None:
    assert config(engines=engines).engines.lora is not None


def test_an_adapter_reaches_tandem_serve() -> None:
    assert config(engines={"rollout": "server"}).engines.lora is not None


def test_the_image_workload_takes_an_adapter_and_its_refusals_name_the_fields() -> None:
    from tandem.engines.diffusion.build import check_image_config

    cfg = load_config("flow_grpo_digits_lora")
    lora = check_image_config(cfg).lora
    assert lora is not None and (lora.rank, lora.alpha, lora.target_modules) == (8, 16.0, None)  # the SD3 default
    with pytest.raises(ConfigError, match=r"engines.lora with cluster.backend=ray"):
        load_config("flow_grpo_digits_lora", ["cluster.backend=ray"])
