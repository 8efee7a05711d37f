"""A task from outside the repo trains the shipped model on the torch engines: its own JSONL,
its own two weighted reward functions, run in the reward worker processes."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from pathlib import Path

import pytest

from tandem.core.config import validate_config
from tandem.pipeline import AsyncTrainingFlow
from tandem.pipeline.builders import build_components
from tandem.tasks.arithmetic import MAX_RESPONSE_TOKENS, MODEL_DIR, generate_problems
from tests.integration.test_torch_flow import Recording, weights

pytestmark = pytest.mark.slow

USER_TASK = '''
from pathlib import Path

from tandem.core.task import RewardFunction
from tandem.tasks.dataset import FileItems


def final_answer(response, answer):
    lines = [line for line in response.splitlines() if line.strip()]
    return 1.0 if lines and lines[-1] == "=" + answer else 0.0


def brevity(response, answer):
    return 1.0 / (1.0 + len(response))


class MySums:
    name = "my_sums"
    kind = "text"
    model_path = None  # the config names the model

    def __init__(self, path):
        self.file = FileItems(Path(path))

    def items(self, seed, start=0):
        return self.file(seed, start)

    def held_out(self, n):
        return self.file.first(n)

    def rewards(self):
        return [RewardFunction("final_answer", "my_sums:final_answer"), RewardFunction("brevity", "my_sums:brevity", 0.1)]
'''


def test_a_user_task_trains_the_shipped_model_with_its_own_rewards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_sums.py").write_text(textwrap.dedent(USER_TASK))
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in generate_problems(16, 77)))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = validate_config({
        "run": {"max_steps": 4, "seed": 3},
        "task": {"name": "my_sums:MySums", "options": {"path": str(data)}},
        "engines": {"type": "torch", "model_path": str(MODEL_DIR), "lr": 1e-3},
        "train": {"prompts_per_step": 4},
        "rollout": {"samples_per_prompt": 4, "max_new_tokens": MAX_RESPONSE_TOKENS},
        "flow": {"stages": ["dataloader", "generate", "rollout", "logp", "reward", "train"], "micro_batch_size": 2},
        "observability": {"write_run_dir": False, "trace": False},
    })
    components = build_components(cfg)
    recorder = Recording(components.trainer)
    before = weights(components.trainer)
    try:
        result = asyncio.run(AsyncTrainingFlow(cfg, components).run())
        after = weights(components.trainer)
    finally:
        components.close()
        sys.modules.pop("my_sums", None)
    assert result.total_steps == 4 and result.ledger["balanced"]
    trained = [t for batch in recorder.batches for t in batch]
    assert all(set(t.rewards) == {"final_answer", "brevity"} for t in trained)
    for t in trained:
        assert t.rewards["brevity"] == pytest.approx(1 / (1 + len(t.payload.text)))
        assert t.rewards["final_answer"] in (0.0, 1.0)
        assert t.reward == pytest.approx(t.rewards["final_answer"] + 0.1 * t.rewards["brevity"])
    assert any(t.rewards["final_answer"] == 1.0 for t in trained)  # the shipped model solves some
    assert max((after[k] - before[k]).abs().max().item() for k in before) > 0  # and it trained
