"""The ``tandem`` command: config lookup, overrides, errors as exit codes, the summary line."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import structlog
import yaml
from pydantic import BaseModel

from tandem.core.config import load_config, validate_config
from tandem.core.paths import CONFIGS_DIR
from tandem.pipeline import AsyncTrainingFlow
from tandem.pipeline.cli import main, summary_line
from tests.conftest import make_config, run_virtual

REPO = Path(__file__).resolve().parents[3]
QUIET = ["observability.write_run_dir=false", "observability.log_level=warning", "--no-progress"]


@contextmanager
def ctrl_c_reaches_children() -> Iterator[None]:
    """Children started inside start as a terminal's foreground job would, with Ctrl-C live.

    An ignored SIGINT is inherited across exec, and Python then never turns it into
    ``KeyboardInterrupt``: a test run started in the background of a non-interactive shell
    (which ignores SIGINT there) would otherwise see the CLI shrug off the test's Ctrl-C.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """The CLI configures structlog for the process; give later tests their quiet config back."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def test_help_lists_every_shipped_config_with_its_description(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    top = capsys.readouterr().out
    assert main(["run", "--help"]) == 0
    run = capsys.readouterr().out
    shipped = sorted(CONFIGS_DIR.glob("*.yaml"))
    assert {"sim_sync", "sim_k1", "sim_colocated"} <= {p.stem for p in shipped}
    for path in shipped:
        description = path.read_text().splitlines()[0].lstrip("# ").strip()
        for text in (top, run):
            assert path.stem in text and description[:40] in text


def test_run_by_name_trains_and_prints_the_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "sim_k1", "run.max_steps=2", *QUIET]) == 0
    out, err = capsys.readouterr()
    per_step = load_config(CONFIGS_DIR / "sim_k1.yaml").train.prompts_per_step
    summary = out.strip().splitlines()[-1]
    assert summary.startswith("done: 2 steps in ")
    for part in ("samples/s", "reward ", " -> ", "staleness {", f"ledger trained {2 * per_step} dropped 0",
                 "run folder (not written)"):
        assert part in summary
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--no-progress", "run.max_steps=3", "observability.write_run_dir=false"],
        ["run.max_steps=3", "--no-progress", "observability.write_run_dir=false"],
        ["--set", "run.max_steps=3", "--no-progress", "--set=observability.write_run_dir=false"],
        ["--no-progress", "--set", "run.max_steps=3", "observability.write_run_dir=false"],
    ],
    ids=["overrides-after-option", "option-between-overrides", "set-only", "set-and-bare"],
)
def test_options_and_overrides_come_in_any_order(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "sim_k1", "observability.log_level=warning", *argv]) == 0
    out, err = capsys.readouterr()
    assert out.strip().splitlines()[-1].startswith("done: 3 steps in ")
    assert out.strip().endswith("run folder (not written)")
    assert "step" not in err  # --no-progress took effect wherever it stood: no bar


def test_an_override_given_twice_exits_2_naming_the_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "sim_k1", "run.max_steps=2", *QUIET, "--set", "run.max_steps=3"]) == 2
    err = capsys.readouterr().err
    assert "override given more than once: run.max_steps" in err and "Traceback" not in err


def test_run_by_path_writes_the_run_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "mine.yaml"
    config.write_text("# A tiny run.\nrun: {name: mine, max_steps: 2}\ntrain: {prompts_per_step: 2}\n")
    code = main(["run", str(config), f"run.output_dir={tmp_path}", "observability.log_level=warning", "--no-progress"])
    assert code == 0
    assert capsys.readouterr().out.strip().endswith(f"run folder {tmp_path / 'mine'}")
    assert {"metrics.jsonl", "summary.json", "trace.json"} <= {p.name for p in (tmp_path / "mine").iterdir()}


def test_an_unknown_override_key_exits_2_naming_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "sim_k1", "run.max_stpes=2", *QUIET]) == 2
    out, err = capsys.readouterr()
    assert "run.max_stpes" in err and "unknown field" in err
    assert "did you mean run.max_steps?" in err  # the closest valid key
    assert "Traceback" not in err and not out


@pytest.mark.parametrize("name", ["default", "sim_k1", "agentic_frozenlake", "flow_grpo_digits"])
def test_config_show_prints_the_resolved_config_with_each_fields_doc(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", name, "run.max_steps=7"]) == 0
    out = capsys.readouterr().out
    assert "  max_steps: 7  # Train steps (versions) to train" in out  # the override, the default's doc
    resolved = load_config(name, ["run.max_steps=7"])
    shown = validate_config(yaml.safe_load(out))  # it loads back as the same config
    assert shown == resolved
    assert len(re.findall(r"^ *\w+:", out, flags=re.M)) == count_fields(resolved)  # every field, set or not


def count_fields(model: BaseModel) -> int:
    """Fields of ``model`` and of the sections nested in it, each section counted with its fields."""
    return sum(1 + (count_fields(v) if isinstance(v := getattr(model, name), BaseModel) else 0)
               for name in type(model).model_fields)


def test_config_show_refuses_a_bad_override_naming_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "sim_k1", "run.max_stepz=7"]) == 2
    assert "run.max_stepz: unknown field; did you mean run.max_steps?" in capsys.readouterr().err


def test_an_invalid_literal_exits_2_naming_the_allowed_values(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "sim_k1", "observability.log_format=xml", *QUIET]) == 2
    err = capsys.readouterr().err
    assert "observability.log_format" in err and "'console'" in err and "'json'" in err
    assert "Traceback" not in err


def test_a_malformed_override_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "sim_k1", "max_steps", *QUIET]) == 2
    assert "dotted.key=value" in capsys.readouterr().err


def test_a_missing_config_exits_2_naming_the_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nowhere.yaml"
    assert main(["run", str(missing), *QUIET]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "not found" in err
    assert "Traceback" not in err


def test_a_failing_stage_exits_1_naming_the_stage(capsys: pytest.CaptureFixture[str]) -> None:
    failing = "flow.custom_stages.reward=tests.unit.pipeline.stages_for_tests:FailOnPrompt"
    assert main(["run", "sim_k1", failing, "flow.micro_batch_size=1", *QUIET]) == 1
    out, err = capsys.readouterr()
    assert "stage 'reward' failed on prompt(s) [5]" in err and "verifier exploded" in err
    assert "Traceback" not in err and "done:" not in out


def test_ctrl_c_stops_cleanly_with_exit_code_130() -> None:
    with ctrl_c_reaches_children():
        proc = subprocess.Popen(
            [sys.executable, "-m", "tandem.pipeline.cli", "run", "sim_sync", "run.max_steps=1000",
             "observability.write_run_dir=false", "--no-progress"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
    assert proc.stderr is not None
    try:
        # Interrupt only once the flow is running (its first log line), not during imports.
        seen = ""
        while "flow started" not in (line := proc.stderr.readline()):
            assert line, f"the CLI exited before the flow started: {seen}"
            seen += line
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert "interrupted" in err and "Traceback" not in err
    assert "done:" not in out


def test_the_summary_names_drops_per_stage_degradations_and_held_out_accuracy() -> None:
    cfg = make_config(
        run={"max_steps": 12},
        validation={"every_versions": 4, "prompts": 4},
        staleness={"degrade_after_sync_failures": 1},
        # Held-out scoring goes through the same faulty reward: retried, so every evaluation lands.
        roles={"reward": {"on_error": "drop"}, "param_update": {"on_error": "drop"}, "validate": {"max_retries": 5}},
        engines={"faults": {"reward": {"failure_rate": 0.2}, "param_update": {"failure_rate": 0.3}}},
    )
    result = run_virtual(AsyncTrainingFlow(cfg).run())
    summary = summary_line(result)
    dropped = result.ledger["dropped"]
    assert dropped > 0 and f"dropped {dropped} (reward: {dropped})" in summary
    degradations = sum(m.degraded for m in result.mode_changes)
    assert degradations > 0 and f"degraded to synchronous {degradations}x" in summary
    first, last = result.validations[0], result.validations[-1]
    assert f"held-out accuracy {first.score:.3f} (v0) -> {last.score:.3f} (v{last.version})" in summary


def test_ctrl_c_checkpoints_the_run_and_resume_continues_it(tmp_path: Path) -> None:
    run = [f"run.output_dir={tmp_path}", "run.name=stopped", "observability.metrics_port=null"]
    with ctrl_c_reaches_children():
        proc = subprocess.Popen(
            [sys.executable, "-m", "tandem.pipeline.cli", "run", "sim_k1", "run.max_steps=100000", *run, "--no-progress"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
    assert proc.stderr is not None
    try:
        while "flow started" not in (line := proc.stderr.readline()):
            assert line, "the CLI exited before the flow started"
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    [checkpoint] = (tmp_path / "stopped" / "checkpoints").iterdir()
    state = json.loads((checkpoint / "flow.json").read_text())
    ledger = json.loads((tmp_path / "stopped" / "summary.json").read_text())["ledger"]
    assert ledger["dropped_by_stage"].get("flow", 0) == len(state["in_flight"])  # cancelled at shutdown

    steps = state["version"] + 2
    assert main(["run", "sim_k1", *run, "run.resume=true", f"run.max_steps={steps}", "--no-progress"]) == 0
    summary = json.loads((tmp_path / "stopped" / "summary.json").read_text())
    assert summary["resumed_from_version"] == state["version"] and summary["final_version"] == steps
    assert summary["ledger"]["trained"] == steps * 16


def test_resume_from_a_missing_checkpoint_exits_2_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no" / "such" / "checkpoint"
    code = main(["run", "sim_k1", f"run.output_dir={tmp_path}", f"run.resume={missing}", "--no-progress"])
    assert code == 2
    assert f"run.resume: no checkpoint at {missing}" in capsys.readouterr().err
