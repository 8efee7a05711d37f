"""The run's history streams to metrics.jsonl and to trackers; memory keeps bounded summaries only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.core.history import CriticRecord, RunHistory, StepRecord, read_step_rows
from tandem.pipeline import AsyncTrainingFlow
from tandem.pipeline.tracking import scalars
from tests.conftest import make_config, run_virtual


def step(i: int, reward: float) -> StepRecord:
    return StepRecord(
        step=i, time_s=float(i), step_time_s=1.0, groups=2, samples=4, tokens=40, reward_mean=reward,
        staleness=[0, 1], loaded_version=i, staleness_bound=1, prompt_ids=[2 * i, 2 * i + 1],
        train_metrics={"loss": 0.5}, rollout_metrics={"turns": 3.0},
    )


def test_memory_keeps_the_latest_records_and_running_totals_while_the_file_gets_every_row(tmp_path: Path) -> None:
    history = RunHistory(tmp_path / "metrics.jsonl", keep=5, max_steps=100)
    for i in range(100):
        history.add(step(i, reward=i / 100))
        history.add_sync(i + 1, {"bytes": 1.0})
    history.close()
    assert [s.step for s in history.steps] == [95, 96, 97, 98, 99] and len(history.syncs) == 5
    assert (history.total_steps, history.samples, history.tokens) == (100, 400, 4000)
    assert history.staleness_counts == {0: 100, 1: 100}
    # The summary's start and end: the first and last tenth of max_steps (10 steps each).
    assert history.first_rewards == pytest.approx([i / 100 for i in range(10)])
    assert list(history.last_rewards) == pytest.approx([i / 100 for i in range(90, 100)])
    assert [row["step"] for row in read_step_rows(tmp_path / "metrics.jsonl")] == list(range(100))


def test_a_long_run_returns_the_latest_steps_and_totals_over_all_of_them(tmp_path: Path) -> None:
    cfg = make_config(
        run={"max_steps": 30, "output_dir": str(tmp_path), "name": "long"},
        observability={"write_run_dir": True, "trace": False, "keep_steps": 8},
    )
    result = run_virtual(AsyncTrainingFlow(cfg).run())
    assert [s.step for s in result.steps] == list(range(22, 30))
    assert result.total_steps == 30 and result.samples == 30 * 4 * 2  # prompts_per_step 4, n 2
    assert sum(result.staleness_counts.values()) == 30 * 4
    summary = json.loads((tmp_path / "long" / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["reward_first"] == pytest.approx(result.reward_first)
    assert len(read_step_rows(tmp_path / "long" / "metrics.jsonl")) == 30  # the plot reads them all


def test_rows_become_scalars_on_the_policy_version_axis() -> None:
    global_step, values = scalars({"kind": "step", **step(4, 0.25).to_json()})
    assert global_step == 5
    assert values["step/reward_mean"] == 0.25 and values["step/staleness_max"] == 1.0
    assert values["train/loss"] == 0.5 and values["rollout/turns"] == 3.0
    assert "step/prompt_ids" not in values  # not a scalar
    global_step, values = scalars({"kind": "validation", "version": 50, "accuracy": 0.5, "reward_mean": 0.4})
    assert (global_step, values) == (50, {"validation/accuracy": 0.5, "validation/reward_mean": 0.4})
    global_step, values = scalars({"kind": "mode", "trained_version": 7, "degraded": True, "staleness_bound": 0})
    assert (global_step, values) == (7, {"mode/degraded": 1.0, "mode/staleness_bound": 0.0})
    critic = CriticRecord(version=3, policy_step=6, time_s=1.0, metrics={"value_loss": 0.2})
    global_step, values = scalars(critic.to_json())
    assert (global_step, values) == (7, {"critic/value_loss": 0.2, "critic/version": 3.0})


def test_tensorboard_gets_every_step_and_validation(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = make_config(
        run={"max_steps": 6, "output_dir": str(tmp_path), "name": "tb"},
        validation={"every_versions": 3, "prompts": 4},
        observability={"write_run_dir": True, "trace": False, "trackers": ["tensorboard"]},
    )
    result = run_virtual(AsyncTrainingFlow(cfg).run())
    events = EventAccumulator(str(tmp_path / "tb" / "tensorboard"))
    events.Reload()
    rewards = events.Scalars("step/reward_mean")
    assert [e.step for e in rewards] == list(range(1, 7))
    assert [e.value for e in rewards] == pytest.approx([s.reward_mean for s in result.steps])
    assert [e.step for e in events.Scalars("validation/accuracy")] == [v.version for v in result.validations]


def test_a_tracker_that_is_not_installed_is_named_before_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from tandem.core.config import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    cfg = make_config(
        run={"output_dir": str(tmp_path), "name": "w"},
        observability={"write_run_dir": True, "trace": False, "trackers": ["wandb"]},
    )
    with pytest.raises(ConfigError, match=r"observability.trackers: wandb needs the wandb package \(pip install wandb\)"):
        run_virtual(AsyncTrainingFlow(cfg).run())
    with pytest.raises(ConfigError, match="trackers write into the run folder"):
        make_config(observability={"write_run_dir": False, "trackers": ["tensorboard"]})


class _Recorder:
    """Stands in for the wandb / mlflow modules (not installed here): records what the trackers
    call, with the signatures of the libraries' documented APIs."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name: str):
        def call(*args: object, **kwargs: object) -> "_Recorder":
            self.calls.append((name, args, kwargs))
            return self

        return call


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_wandb_and_mlflow_get_the_same_scalars_offline(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.machinery
    import importlib.util
    import sys

    module = _Recorder()
    monkeypatch.setitem(sys.modules, name, module)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: importlib.machinery.ModuleSpec(n, None) if n == name else real(n, *a))
    cfg = make_config(
        run={"max_steps": 4, "output_dir": str(tmp_path), "name": name},
        observability={"write_run_dir": True, "trace": False, "trackers": [name]},
    )
    result = run_virtual(AsyncTrainingFlow(cfg).run())
    calls = [c for c in module.calls if c[0] in ("log", "log_metrics")]
    assert len(calls) == 4  # one per step row
    if name == "wandb":
        [(_, _, init)] = [c for c in module.calls if c[0] == "init"]
        assert init["mode"] == "offline" and init["dir"] == str(tmp_path / name)
        logged = [args[0] for _, args, _ in calls]
        assert [row["policy_version"] for row in logged] == [1, 2, 3, 4]
        assert [row["step/reward_mean"] for row in logged] == pytest.approx([s.reward_mean for s in result.steps])
        assert module.calls[-1][0] == "finish"
    else:
        [(_, (uri,), _)] = [c for c in module.calls if c[0] == "set_tracking_uri"]
        assert uri == (tmp_path / name / "mlruns").resolve().as_uri()
        assert [kwargs["step"] for _, _, kwargs in calls] == [1, 2, 3, 4]
        assert [args[0]["step.reward_mean"] for _, args, _ in calls] == pytest.approx([s.reward_mean for s in result.steps])
        assert module.calls[-1][0] == "end_run"
