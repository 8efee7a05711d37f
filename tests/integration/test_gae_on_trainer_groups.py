"""PPO with a critic (GAE's per-token advantages) trains on two FSDP2 ranks and on two megatron-core
ranks: the shipped critic config, shortened. Every trainer runs the one loss loop
(``engines.trainers.loss_loop``), which reads per-token advantages; that the two-rank step equals
one process's with them is in ``tests/unit/engines/trainers/test_fsdp.py``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tandem import AsyncTrainingFlow, load_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.mark.parametrize("trainer", [["engines.data_parallel=fsdp2"], ["engines.train=megatron"]], ids=["fsdp2", "megatron"])
def test_the_critic_config_trains_two_steps_on_two_ranks(trainer: list[str], tmp_path: Path) -> None:
    config = load_config("ppo_critic_arithmetic", [
        *trainer, "engines.train_world_size=2", "engines.train_threads=1", "engines.generation_threads=1",
        "run.max_steps=2", f"run.output_dir={tmp_path}", "train.prompts_per_step=4", "rollout.samples_per_prompt=4",
        "validation.every_versions=null", "observability.metrics_port=null",
        "observability.trace=false",
    ])  # fmt: skip
    assert config.engines.trainer_group == trainer[0].rsplit("=", 1)[1]
    result = asyncio.run(AsyncTrainingFlow(config).run())
    assert result.total_steps == 2 and result.final_version == 2 and result.ledger["balanced"]
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if row["kind"] == "step"]
    assert len(steps) == 2
    # Some answers were right (the shipped model solves part of them), so GAE's advantages are not
    # all zero and the policy moved; the critic trained on the returns beside it.
    assert any(row["reward_mean"] > 0 for row in steps)
    assert any(row["train_metrics"]["grad_norm"] > 0 for row in steps)
    assert any(row["kind"] == "critic" and row["metrics"]["value_loss"] > 0 for row in rows)
