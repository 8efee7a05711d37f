"""Workloads as plugins, from a user's side: a task defined outside the repo (a module of its own
with its own JSONL and reward functions) trains end to end; several rewards are weighed; a
reward function that raises or hangs fails only its samples; bad task names are named."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from pathlib import Path

import pytest

from tandem.core.config import ConfigError, validate_config
from tandem.pipeline import AsyncTrainingFlow
from tandem.tasks.registry import available_tasks, load_task
from tests.conftest import make_config, run_virtual
from tests.unit.pipeline.test_flow import RecordingTrain, recording

USER_TASK = '''
"""A user's task, outside the repo: sums from its own JSONL file, scored by its own rewards."""
import time
from pathlib import Path

from tandem.core.records import TaskItem
from tandem.core.task import RewardFunction
from tandem.tasks.dataset import FileItems

HERE = Path(__file__).parent


def correct(response, answer):
    if answer == "boom":
        raise ValueError("cannot read the response")
    if answer == "hang":
        time.sleep(60)
    return 1.0 if response == answer else 0.0


def short(response, answer, *, meta):
    return meta["bonus"] / (1 + len(response))


class SumsTask:
    name = "sums"
    kind = "text"
    model_path = None

    def __init__(self, path=HERE / "sums.jsonl"):
        self.file = FileItems(Path(path))

    def items(self, seed, start=0):
        return self.file(seed, start)

    def held_out(self, n):
        return self.file.first(n)

    def rewards(self):
        return [RewardFunction("correct", "user_task:correct", weight=1.0),
                RewardFunction("short", "user_task:short", weight=0.5)]


TASK = SumsTask()
'''


# Real time, fast fakes: the reward pool's timeout is real time, which a virtual clock would skip.
FAST = {key: {"type": "constant", "mean_s": 0.002} for key in
        ("generation_latency", "train_step_latency", "logp_latency", "reward_latency", "sync_latency")}


@pytest.fixture
def user_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "user_task.py").write_text(textwrap.dedent(USER_TASK))
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a), "bonus": 1.0 + a % 2} for a in range(12)]
    (tmp_path / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.syspath_prepend(str(tmp_path))  # reward worker processes inherit the path
    yield tmp_path
    sys.modules.pop("user_task", None)


def test_a_task_from_outside_the_repo_trains_end_to_end_on_the_fake_engines(user_task: Path) -> None:
    cfg = make_config(
        task={"name": "user_task:TASK"},
        run={"max_steps": 6},
        flow={"custom_stages": {"train": "tests.unit.pipeline.test_flow:RecordingTrain"}},
        validation={"every_versions": 3, "prompts": 4},
        engines=FAST,
    )
    components, trainer = recording(cfg)
    flow = AsyncTrainingFlow(cfg, components)
    try:
        result = asyncio.run(flow.run())
    finally:
        components.close()
    assert result.total_steps == 6 and result.ledger["balanced"]
    trained = [t for batch in trainer.batches for t in batch]
    train = next(m for m in flow.machines if isinstance(m, RecordingTrain))
    for t in trained:
        group = train.group_of[t.prompt_id].group
        right = t.payload.text == group.answer
        short = group.item.meta["bonus"] / (1 + len(t.payload.text))
        assert t.rewards == pytest.approx({"correct": float(right), "short": short})
        assert t.reward == pytest.approx(t.rewards["correct"] + 0.5 * t.rewards["short"])
    assert {train.group_of[t.prompt_id].group.prompt for t in trained} <= {f"{a}+{a}=" for a in range(12)}
    assert [v.samples for v in result.validations] == [4] * len(result.validations)  # its held-out rows


def test_config_rewards_replace_the_tasks_own(user_task: Path) -> None:
    cfg = make_config(
        task={"name": "user_task:TASK", "rewards": [{"fn": "user_task:correct", "weight": 2.0, "runner": "inline"}]},
        flow={"custom_stages": {"train": "tests.unit.pipeline.test_flow:RecordingTrain"}},
    )
    components, trainer = recording(cfg)
    try:
        run_virtual(AsyncTrainingFlow(cfg, components).run())
    finally:
        components.close()
    rewards = {t.reward for batch in trainer.batches for t in batch}
    assert rewards <= {0.0, 2.0} and 2.0 in rewards
    assert all(t.rewards is None for batch in trainer.batches for t in batch)  # one function: no components


@pytest.mark.parametrize("bad", ["boom", pytest.param("hang", marks=pytest.mark.slow)])
def test_a_reward_function_that_raises_or_hangs_fails_only_its_samples(user_task: Path, bad: str) -> None:
    # The user's function misbehaves on one item (its answer is "boom" or "hang"), for every
    # sample of it, whatever the (fake) policy wrote.
    rows = [{"prompt": f"{a}+{a}=", "answer": bad if a == 3 else str(2 * a), "bonus": 1.0} for a in range(12)]
    (user_task / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = make_config(
        # A started worker scores in milliseconds; each timeout the hang costs is this second.
        task={"name": "user_task:TASK", "reward_timeout_s": 1.0, "rewards": [{"fn": "user_task:correct"}]},
        run={"max_steps": 3},
        flow={"custom_stages": {"train": "tests.unit.pipeline.test_flow:RecordingTrain"}},
        engines=FAST,
    )
    components, trainer = recording(cfg)
    flow = AsyncTrainingFlow(cfg, components)
    try:
        result = asyncio.run(flow.run())  # real time: the pool's timeout is
    finally:
        components.close()
    train = next(m for m in flow.machines if isinstance(m, RecordingTrain))
    trained = [t for batch in trainer.batches for t in batch]
    failed = [t for t in trained if t.reward_info.startswith("failed")]
    culprit = [t for t in trained if train.group_of[t.prompt_id].group.answer == bad]
    assert culprit and failed == culprit  # that item's samples, and only those
    reason = "raised ValueError: cannot read the response" if bad == "boom" else "timed out after 1.0s"
    assert all(reason in t.reward_info and t.reward == 0.0 for t in failed)
    assert any(t.reward == 1.0 for t in trained) and result.ledger["balanced"]


def test_task_names_resolve_or_are_named() -> None:
    assert {"arithmetic", "synthetic"} <= set(available_tasks())
    assert load_task("arithmetic").name == "arithmetic"
    with pytest.raises(ConfigError, match=r"task.name: no task 'nope'; built-in: \[.*'arithmetic'.*\]"):
        load_task("nope")
    with pytest.raises(ConfigError, match="task.name: cannot import 'no_such_module:TASK'"):
        load_task("no_such_module:TASK")
    with pytest.raises(ConfigError, match="is neither a Task nor a callable"):
        load_task("tandem.tasks.arithmetic:MAX_RESPONSE_TOKENS")
    with pytest.raises(ConfigError, match="task.options for 'arithmetic'"):
        load_task("arithmetic", {"size": 3})
    with pytest.raises(ConfigError, match="task.name: engines.type=torch trains a real model: name its task"):
        validate_config({"engines": {"type": "torch"}})
