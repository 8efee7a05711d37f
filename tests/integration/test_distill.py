"""On-policy distillation on the real engines and the shipped models (the arithmetic student and
its teacher): the trainer gets each token's negative reverse KL to the teacher as its advantage,
and a run checkpoints the teacher with it, so the prompts in flight at a checkpoint are scored on
resume by the teacher the run started with, whatever happened to the teacher's files since."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.core.checkpoint import CheckpointError
from tandem.core.config import TandemConfig, validate_config
from tandem.core.records import Trajectory
from tandem.engines.trainers.torch_train import TEACHER_STATE_FILE, TorchLogProbEngine
from tandem.pipeline import AsyncTrainingFlow
from tandem.pipeline.builders import build_components
from tandem.tasks.arithmetic import TEACHER_DIR
from tests.integration.test_torch_flow import Recording

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (TEACHER_DIR / "config.json").is_file(), reason="the shipped teacher is missing"),
]


def distill_config(tmp_path: Path, teacher: Path, **run: Any) -> TandemConfig:
    return validate_config({
        "run": {"output_dir": str(tmp_path), "name": "distill", "seed": 0, **run},
        "staleness": {"max_staleness": 1},
        "train": {"prompts_per_step": 2},
        "rollout": {"samples_per_prompt": 2, "max_new_tokens": 24},
        "flow": {"stages": ["dataloader", "generate", "rollout", "teacher_logp", "reward", "train"], "micro_batch_size": 2},
        "engines": {"type": "torch"},
        "task": {"name": "arithmetic"},
        "algorithm": {"proximal": "current"},
        "teacher": {"model_path": str(teacher), "threads": 1},
        "observability": {"write_run_dir": True, "trace": False},
    })


def trained(cfg: TandemConfig) -> list[Trajectory]:
    """Run ``cfg``; every trajectory the trainer was handed."""
    components = build_components(cfg)
    recorder = Recording(components.trainer)  # type: ignore[arg-type]
    try:
        asyncio.run(AsyncTrainingFlow(cfg, components).run())
    finally:
        components.close()
    return [t for batch in recorder.batches for t in batch]


def scores(model_path: Path, trajectories: list[Trajectory]) -> list[list[float]]:
    engine = TorchLogProbEngine(str(model_path))
    try:
        return asyncio.run(engine.logprobs(trajectories))
    finally:
        engine.close()


def test_a_resumed_run_scores_with_the_teacher_it_checkpointed(tmp_path: Path) -> None:
    teacher = tmp_path / "teacher"
    shutil.copytree(TEACHER_DIR, teacher)
    first = trained(distill_config(tmp_path, teacher, max_steps=3, save_steps=2))
    for t in first:  # the trainer was handed the teacher's per-token advantages
        assert t.teacher_logprobs is not None and t.teacher_version == 0
        assert t.token_advantages == pytest.approx([b - a for a, b in zip(t.behaviour_logprobs, t.teacher_logprobs)])
    saved = tmp_path / "distill" / "checkpoints" / "step_00000002"
    state = json.loads((saved / "flow.json").read_text())
    assert state["teacher_saved"] and (saved / TEACHER_STATE_FILE).is_file()
    assert state["in_flight"]  # step 2's prompts were being generated when step 2's checkpoint was written

    # The teacher's files change under the run (retrained, overwritten...).
    model = AutoModelForCausalLM.from_pretrained(teacher)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    model.save_pretrained(teacher)

    resumed = trained(distill_config(tmp_path, teacher, max_steps=3, resume=str(saved)))
    assert resumed and {t.prompt_id for t in resumed} >= set(state["in_flight"])  # generated again, trained once
    expected = scores(TEACHER_DIR, resumed)  # the teacher the run started with
    changed = scores(teacher, resumed)  # what its files hold now
    for t, original, now in zip(resumed, expected, changed):
        assert t.teacher_version == 0
        assert t.teacher_logprobs == pytest.approx(original, abs=1e-4)
        assert max(abs(a - b) for a, b in zip(original, now)) > 0.01  # the test could tell them apart
    rows = [json.loads(line) for line in (tmp_path / "distill" / "metrics.jsonl").read_text().splitlines()]
    assert all("teacher_reverse_kl" in r["train_metrics"] for r in rows if r.get("kind", "step") == "step")

    # Another teacher would train the rest of the run toward another target: refused, naming the field.
    other = tmp_path / "other"
    shutil.copytree(TEACHER_DIR, other)
    with pytest.raises(CheckpointError, match=r"other values of \['teacher\.model_path'\]"):
        trained(distill_config(tmp_path, other, max_steps=3, resume=str(saved)))
