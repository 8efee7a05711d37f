"""Each task names what its held-out evaluation measures, and the run reports that measure by its
name: in the summary line, ``summary.json``, the validation rows and the metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.core.history import StepRecord
from tandem.core.protocols import RewardResult
from tandem.core.task import HeldOutMeasure, held_out_measure
from tandem.pipeline import AsyncTrainingFlow
from tandem.pipeline.builders import build_components
from tandem.pipeline.cli import summary_line
from tandem.tasks.registry import load_task
from tests.conftest import make_config, run_virtual


@pytest.mark.parametrize(
    ("result", "met"),
    [
        (RewardResult(1.05, components={"ocr": 0.55, "ink": 0.5}), True),
        (RewardResult(1.4, components={"ocr": 0.3, "ink": 1.0}), False),  # a high total, yet not recognized
        (RewardResult(0.55), True),  # the judge alone: its value is the reward
        (RewardResult(0.0, ok=False, info="timed out", components={"ocr": 0.9}), False),  # a failed reward never counts
    ],
)
def test_a_measure_reads_its_own_reward_component(result: RewardResult, met: bool) -> None:
    assert HeldOutMeasure("recognized", component="ocr", threshold=0.5).met_by(result) is met


def test_the_default_measure_is_accuracy_full_reward() -> None:
    assert HeldOutMeasure().met_by(RewardResult(1.0)) and not HeldOutMeasure().met_by(RewardResult(0.99))


@pytest.mark.parametrize(
    ("task", "rewards", "name"),
    [("arithmetic", ["correct"], "exact_answer"), ("digits", ["ocr"], "recognized"),
     ("frozenlake", ["goal", "format"], "success"), ("calculator", ["correct"], "success"),
     ("synthetic", ["correct"], "accuracy")],
)
def test_each_shipped_task_names_its_measure(task: str, rewards: list[str], name: str) -> None:
    assert held_out_measure(load_task(task), rewards).name == name


def test_a_measure_of_a_reward_the_config_replaced_falls_back_to_accuracy() -> None:
    assert held_out_measure(load_task("digits"), ["my_judge"]) == HeldOutMeasure()


def test_the_run_reports_the_tasks_measure_by_its_name(tmp_path: Path) -> None:
    cfg = make_config(
        run={"max_steps": 6, "output_dir": str(tmp_path), "name": "m"},
        task={"name": "arithmetic"},
        validation={"every_versions": 3, "prompts": 4},
        observability={"write_run_dir": True, "trace": False},
    )
    components = build_components(cfg)
    assert components.held_out_measure.name == "exact_answer"
    seen: list[float | None] = []

    def on_step(record: StepRecord) -> None:
        assert flow.metrics is not None
        seen.append(flow.metrics.registry.get_sample_value("tandem_validation_measure", {"measure": "exact_answer"}))

    flow = AsyncTrainingFlow(cfg, components, on_step=on_step)
    result = run_virtual(flow.run())
    first, last = result.validations[0], result.validations[-1]
    assert {v.measure for v in result.validations} == {"exact_answer"}
    assert f"held-out exact answer {first.score:.3f} (v0) -> {last.score:.3f} (v{last.version})" in summary_line(result)
    rows = [json.loads(line) for line in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
    validation_rows = [r for r in rows if r["kind"] == "validation"]
    assert [r["exact_answer"] for r in validation_rows] == [v.score for v in result.validations]
    assert all("accuracy" not in r and r["measure"] == "exact_answer" for r in validation_rows)
    summary = json.loads((tmp_path / "m" / "summary.json").read_text())
    assert [v["exact_answer"] for v in summary["validation"]] == [v.score for v in result.validations]
    assert last.score in seen  # the dashboard's gauge, labelled by the measure
