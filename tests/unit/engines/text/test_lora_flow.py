"""A LoRA run on the shipped model, end to end: adapter-only syncs each proven by the probe, the
KL reference as the base with the adapter disabled, checkpoints of the adapter that resume
exactly, the adapter and merged exports, and a dropped sync stopping the run at that sync."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

import tandem.engines.text.build as text_build
from tandem.core.config import TandemConfig, validate_config
from tandem.core.protocols import RewardResult
from tandem.core.records import PromptGroup, Trajectory
from tandem.pipeline import AsyncTrainingFlow
from tandem.pipeline.builders import build_components
from tandem.state_machines.base import StageError
from tandem.tasks.arithmetic import MODEL_DIR
from tests.conftest import merge
from tests.unit.engines.text.test_lora_sync import Dropping

pytest.importorskip("peft", reason="LoRA needs the lora extra (peft)")

STEPS = 3
SMALL: dict[str, Any] = {
    "run": {"max_steps": STEPS, "seed": 1},
    "staleness": {"max_staleness": 0},
    "train": {"prompts_per_step": 2},
    "rollout": {"samples_per_prompt": 2, "max_new_tokens": 8},
    # One log-prob call per group (as tests/integration/test_resume.py): equal schedules give equal bits.
    "flow": {"stages": ["dataloader", "generate", "rollout", "logp", "ref_logp", "reward", "train"], "micro_batch_size": 2},
    "roles": {"logp": {"micro_batch_size": 1}, "ref_logp": {"micro_batch_size": 1}},
    "algorithm": {"kl_estimator": "k3", "kl_coef": 0.1},
    "engines": {"type": "torch", "model_path": str(MODEL_DIR), "lr": 1e-2, "lora": {"rank": 4}},
    "task": {"name": "arithmetic"},
    "observability": {"trace": False},
}


def lora_config(tmp_path: Path, name: str, **sections: Any) -> TandemConfig:
    return validate_config(merge(merge(SMALL, {"run": {"output_dir": str(tmp_path), "name": name}}), sections))


class ByIndex:
    """Rewards 1 for odd samples, 0 for even: every group is mixed, so every step moves the adapter."""

    async def score(self, trajectories: Sequence[Trajectory], groups: Sequence[PromptGroup]) -> list[RewardResult]:
        return [RewardResult(float(t.index % 2)) for t in trajectories]


def run(config: TandemConfig) -> Any:
    components = build_components(config)
    components.reward = ByIndex()
    return asyncio.run(AsyncTrainingFlow(config, components).run())


def adapter(run_dir: Path, version: int) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / f"step_{version:08d}" / "trainer.pt", weights_only=True)["model"]


def test_a_lora_run_syncs_probes_checkpoints_and_exports_the_adapter_alone(tmp_path: Path) -> None:
    config = lora_config(tmp_path, "lora", run={"save_steps": 1}, engines={"lora": {"rank": 4, "export_merged": True}})
    result = run(config)

    assert [s.version for s in result.syncs][:2] == [1, 2]  # (the last may end the run before its sync)
    saved = adapter(tmp_path / "lora", STEPS)
    assert saved and all(".lora_A." in n or ".lora_B." in n for n in saved)  # the adapter, not the base
    adapter_bytes = sum(t.numel() * t.element_size() for t in saved.values())
    assert all(s.metrics["bytes"] == adapter_bytes for s in result.syncs)
    assert all(s.metrics["logprob_gap"] < 1e-4 for s in result.syncs)
    assert any(r.train_metrics["kl_loss"] > 0 for r in result.steps[1:])  # the base as reference: a KL opened

    from peft import PeftModel

    export = tmp_path / "lora" / "checkpoint"
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(MODEL_DIR), export)
    merged = AutoModelForCausalLM.from_pretrained(export / "merged")
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.allclose(tuned(ids).logits, merged(ids).logits, atol=1e-5)
        assert not torch.allclose(merged(ids).logits, AutoModelForCausalLM.from_pretrained(MODEL_DIR)(ids).logits)


def test_a_resume_at_k0_continues_the_adapter_as_if_never_interrupted(tmp_path: Path) -> None:
    run(lora_config(tmp_path, "whole", run={"save_steps": 1}))
    step_2 = tmp_path / "whole" / "checkpoints" / "step_00000002"
    resumed = run(lora_config(tmp_path, "resumed", run={"save_steps": 1, "resume": str(step_2)}))
    # Its first sync (at the start, of the restored adapter) was probed too: a miss would have failed the run.
    assert resumed.resumed_from_version == 2
    whole, again = adapter(tmp_path / "whole", STEPS), adapter(tmp_path / "resumed", STEPS)
    assert whole.keys() == again.keys()
    assert [n for n in whole if not torch.equal(whole[n], again[n])] == []


def test_a_dropped_sync_stops_the_run_at_that_sync_saying_the_adapter_did_not_land(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = text_build.rollout_engine

    def dropping(config: TandemConfig, threads: int) -> Any:
        rollout = engine(config, threads)
        rollout.target = Dropping(rollout.target, drop_from=2)
        return rollout

    monkeypatch.setattr(text_build, "rollout_engine", dropping)
    with pytest.raises(StageError, match="param_update.* TransferError: version 2 .*: the adapter did not land"):
        run(lora_config(tmp_path, "dropped", observability={"trace": False, "write_run_dir": False}))
