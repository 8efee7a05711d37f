"""kill -9 mid-run, resume: on the shipped model, the run continues as if never interrupted.

A ``tandem run`` subprocess (synchronous, k = 0, a checkpoint every step) is killed with SIGKILL
once it has checkpointed step 2, then resumed with ``run.resume=true``. The resumed run must
continue the versions, train every prompt exactly once over both processes, and end with
weights equal, bit for bit, to an uninterrupted run's under the same seed.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from tandem.core.paths import PACKAGE_ROOT
from tandem.pipeline import AsyncTrainingFlow, load_config
from tandem.tasks.arithmetic import MAX_RESPONSE_TOKENS, MODEL_DIR

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(), reason="the shipped model is missing"),
]

STEPS = 4  # killed once step 2 is checkpointed: the resumed run trains the second half
PROMPTS_PER_STEP = 4


def write_config(tmp_path: Path) -> Path:
    config = {
        "run": {"seed": 1, "max_steps": STEPS, "output_dir": str(tmp_path), "save_steps": 1},
        "staleness": {"max_staleness": 0},
        "train": {"prompts_per_step": PROMPTS_PER_STEP},
        "rollout": {"samples_per_prompt": 4, "max_new_tokens": MAX_RESPONSE_TOKENS},
        # One generation call per step and one log-prob call per group: float rounding then does
        # not depend on which group finished first, so equal schedules give equal bits.
        "flow": {"stages": ["dataloader", "generate", "rollout", "logp", "reward", "train"], "micro_batch_size": 4},
        "roles": {"logp": {"micro_batch_size": 1}},
        "engines": {"type": "torch", "model_path": str(MODEL_DIR), "lr": 3e-4},
        "task": {"name": "arithmetic"},
        "observability": {"trace": False},
    }
    path = tmp_path / "resume.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def tandem(config: Path, *overrides: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tandem.pipeline.cli", "run", str(config), *overrides, "--no-progress"],
        cwd=PACKAGE_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def wait_for(path: Path, proc: subprocess.Popen[str], timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"the run ended before {path} appeared:\n{proc.stdout.read() if proc.stdout else ''}"
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout_s}s"
        time.sleep(0.05)  # polling a file another process writes: there is no event to wait on


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    state = torch.load(run_dir / "checkpoints" / f"step_{STEPS:08d}" / "trainer.pt", weights_only=True)
    assert state["version"] == STEPS
    return state["model"]


def step_rows(run_dir: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind", "step") == "step"]


def test_kill_9_mid_run_then_resume_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    killed_dir = tmp_path / "killed"
    proc = tandem(config, "run.name=killed")
    try:
        wait_for(killed_dir / "checkpoints" / "step_00000002", proc)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not (killed_dir / "summary.json").exists()  # it really died mid-run

    resumed = tandem(config, "run.name=killed", "run.resume=true")
    output, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, output
    summary = json.loads((killed_dir / "summary.json").read_text())
    assert summary["resumed_from_version"] >= 2 and summary["final_version"] == STEPS

    whole_cfg = load_config(config, ["run.name=whole"])
    whole = asyncio.run(AsyncTrainingFlow(whole_cfg).run())

    rows = step_rows(killed_dir)
    assert [r["step"] for r in rows] == list(range(STEPS))  # versions continue, no step twice
    trained = [pid for r in rows for pid in r["prompt_ids"]]
    assert sorted(trained) == list(range(STEPS * PROMPTS_PER_STEP))  # every prompt once: none twice, none lost
    assert [r["prompt_ids"] for r in rows] == [s.prompt_ids for s in whole.steps]
    assert summary["ledger"]["trained"] == STEPS * PROMPTS_PER_STEP and summary["ledger"]["balanced"]

    resumed_weights, whole_weights = final_weights(killed_dir), final_weights(tmp_path / "whole")
    initial = AutoModelForCausalLM.from_pretrained(MODEL_DIR).state_dict()
    assert any(not torch.equal(initial[name], t) for name, t in whole_weights.items())  # it trained
    for name, tensor in whole_weights.items():
        assert torch.equal(resumed_weights[name], tensor), name
