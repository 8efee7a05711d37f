"""The shipped LoRA config, shortened, trains on two FSDP2 ranks end to end: every sync carries the
adapter alone and the probe proves it landed in the embedded engine; the run exports the adapter
in peft's format and merged. That the group's first step equals one process's, and its checkpoints
resume exactly, is in ``tests/unit/engines/trainers/test_fsdp_lora.py``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem import AsyncTrainingFlow, load_config
from tandem.core.config import TandemConfig
from tandem.tasks.arithmetic import MODEL_DIR

pytest.importorskip("peft", reason="LoRA needs the lora extra (peft)")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def short(name: str, tmp_path: Path, *overrides: str) -> TandemConfig:
    """The shipped config ``name`` on two ranks of one thread each, a few small steps."""
    return load_config(name, [
        *overrides, "engines.train_world_size=2", "engines.train_threads=1", "engines.generation_threads=1",
        f"run.output_dir={tmp_path}", "train.prompts_per_step=4", "rollout.samples_per_prompt=4",
        "validation.every_versions=null", "observability.metrics_port=null", "observability.trace=false",
    ])  # fmt: skip


def test_the_lora_config_trains_on_two_fsdp2_ranks_with_every_sync_probed_on_a_server(tmp_path: Path) -> None:
    # Generation in a tandem serve process: the group's adapter crosses a process boundary and the
    # server's own log-probs prove each sync (the embedded engine's case: test_fsdp_lora.py).
    from peft import PeftModel

    config = short("lora_arithmetic", tmp_path, "engines.data_parallel=fsdp2", "engines.rollout=server", "run.max_steps=3")
    assert config.engines.trainer_group == "fsdp2"
    result = asyncio.run(AsyncTrainingFlow(config).run())
    assert result.total_steps == 3 and result.final_version == 3

    export = result.run_dir / "checkpoint"
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(MODEL_DIR), export)
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in tuned.named_parameters() if ".lora_" in n)
    assert result.syncs and all(s.metrics["bytes"] == adapter_bytes for s in result.syncs)  # the adapter alone
    assert all(s.metrics["logprob_gap"] < 1e-4 for s in result.syncs)  # each proven to have landed
    merged = AutoModelForCausalLM.from_pretrained(export / "merged")
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.allclose(tuned(ids).logits, merged(ids).logits, atol=1e-5)
        assert not torch.allclose(merged(ids).logits, AutoModelForCausalLM.from_pretrained(MODEL_DIR)(ids).logits)


def test_ppo_with_a_critic_and_a_kl_reference_trains_adapters_on_two_ddp_ranks(tmp_path: Path) -> None:
    config = short(
        "ppo_critic_arithmetic", tmp_path, "engines.lora.rank=4", "run.max_steps=2", "algorithm.kl_estimator=k3",
        "algorithm.kl_coef=0.1", "flow.stages=[dataloader,generate,rollout,logp,ref_logp,critic,reward,train]",
    )
    assert config.engines.trainer_group == "ddp"
    result = asyncio.run(AsyncTrainingFlow(config).run())
    assert result.total_steps == 2 and result.final_version == 2
    assert all(s.metrics["logprob_gap"] < 1e-4 for s in result.syncs)
    assert (result.run_dir / "checkpoint" / "adapter_config.json").is_file()  # the policy's adapter, in peft's format
    # The base, adapter disabled, is the reference: once the adapter moved, a KL opened.
    assert result.steps[1].train_metrics["kl_loss"] > 0
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(row["kind"] == "critic" and row["metrics"]["value_loss"] > 0 for row in rows)  # its adapter trained
