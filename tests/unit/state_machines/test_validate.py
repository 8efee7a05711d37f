"""The validate role: held-out evaluations every N loaded versions, beside training, tagged with
the weight version they ran on, outside the ledger and the staleness accounting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.core.config import ConfigError
from tandem.core.history import StepRecord
from tandem.pipeline import AsyncTrainingFlow
from tandem.pipeline.builders import build_components
from tandem.state_machines.base import StageError
from tandem.state_machines.validate import VALIDATION_IDS
from tests.conftest import make_config, run_virtual
from tests.unit.pipeline.test_flow import intervals, overlap, recording


def test_evaluations_run_every_n_versions_beside_training_and_are_tagged_with_their_version(tmp_path: Path) -> None:
    cfg = make_config(
        run={"max_steps": 10, "output_dir": str(tmp_path), "name": "v"},
        staleness={"max_staleness": 0},
        validation={"every_versions": 3, "prompts": 6},
        observability={"write_run_dir": True, "trace": True},
    )
    components, trainer = recording(cfg)
    result = run_virtual(AsyncTrainingFlow(cfg, components).run())

    versions = [v.version for v in result.validations]
    assert versions[:3] == [0, 3, 6] and all(v % 3 == 0 for v in versions)
    for record in result.validations:
        assert record.samples == 6 and 0.0 <= record.score <= 1.0 and record.max_token_version >= record.version
    # Outside the training accounting: k = 0 still trains block t in step t, nothing else.
    per_step = cfg.train.prompts_per_step
    for t, batch in enumerate(trainer.batches):
        assert sorted({s.prompt_id for s in batch}) == list(range(t * per_step, (t + 1) * per_step))
    assert result.ledger["balanced"] and result.ledger["admitted"] == cfg.run.max_steps * per_step
    assert result.staleness_counts == {0: cfg.run.max_steps * per_step}
    # Training was not paused for it: the train role ran while an evaluation was running.
    trace = json.loads((tmp_path / "v" / "trace.json").read_text())
    assert overlap(intervals(trace, "validate", "running"), intervals(trace, "train", "running")) > 0
    # Recorded in metrics.jsonl (rows of kind "validation") and the summary.
    rows = [json.loads(line) for line in (tmp_path / "v" / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows if r["kind"] == "validation"] == versions
    assert [r["step"] for r in rows if r["kind"] == "step"] == list(range(cfg.run.max_steps))
    summary = json.loads((tmp_path / "v" / "summary.json").read_text())
    assert [v["version"] for v in summary["validation"]] == versions


def test_the_latest_evaluation_is_in_the_metrics() -> None:
    cfg = make_config(run={"max_steps": 8}, validation={"every_versions": 2, "prompts": 4})
    seen: list[tuple[float | None, float | None]] = []

    def on_step(record: StepRecord) -> None:
        assert flow.metrics is not None
        read = flow.metrics.registry.get_sample_value
        seen.append((read("tandem_validation_version"), read("tandem_validation_measure", {"measure": "accuracy"})))

    flow = AsyncTrainingFlow(cfg, on_step=on_step)
    result = run_virtual(flow.run())
    latest = result.validations[-1]
    assert (float(latest.version), latest.score) in seen


def test_the_held_out_set_is_the_same_every_time_and_never_the_training_stream() -> None:
    components = build_components(make_config())
    assert components.held_out is not None
    first, again = components.held_out(16), components.held_out(16)
    assert first == again
    training = [p for p, _ in zip(components.prompts(0), range(16), strict=False)]
    assert first != training
    assert VALIDATION_IDS > 2**40  # never a training prompt id (those count prompts from 0)


def test_validation_without_held_out_prompts_fails_naming_the_setting() -> None:
    cfg = make_config(validation={"every_versions": 2})
    components = build_components(cfg)
    components.held_out = None
    with pytest.raises(StageError, match="validation.every_versions is set but the engines provide no held-out"):
        run_virtual(AsyncTrainingFlow(cfg, components).run())


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"validation": {"every_versions": 0}}, "validation.every_versions"),
        ({"validation": {"prompts": 0}}, "validation.prompts"),
        ({"flow": {"stages": ["dataloader", "generate", "rollout", "validate", "train"]}}, "validate is not a channel stage"),
    ],
)
def test_bad_validation_settings_fail_naming_the_field(sections: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_config(**sections)


def test_validate_takes_a_role_policy() -> None:
    assert make_config(roles={"validate": {"on_error": "drop"}}).role("validate").on_error == "drop"
