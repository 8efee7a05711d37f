"""Checkpoints and resume on the fake engines (virtual clock): exact continuation, in-flight
prompts generated again and trained once, a clean stop, damaged checkpoints, bad resume paths."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tandem.core.checkpoint import CheckpointError, find_checkpoint, verify_checkpoint
from tandem.core.config import TandemConfig
from tandem.pipeline import AsyncTrainingFlow
from tandem.pipeline.flow import CANCELLED_AT_SHUTDOWN, FlowResult
from tests.conftest import make_config, run_virtual


def config(tmp_path: Path, name: str = "r", k: int = 1, **run: Any) -> TandemConfig:
    return make_config(
        run={"output_dir": str(tmp_path), "name": name, "max_steps": 6, **run},
        staleness={"max_staleness": k},
        observability={"write_run_dir": True, "trace": False},
    )


def checkpoints(tmp_path: Path, name: str = "r") -> list[str]:
    return sorted(p.name for p in (tmp_path / name / "checkpoints").iterdir())


def flow_state(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "flow.json").read_text())


def step_rows(tmp_path: Path, name: str = "r") -> list[dict[str, Any]]:
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if row.get("kind", "step") == "step"]


def stop_mid_run(cfg: TandemConfig, after_s: float) -> None:
    """Run the flow and cancel it (a clean stop, as Ctrl-C does) after ``after_s`` virtual seconds."""

    async def scenario() -> None:
        task = asyncio.ensure_future(AsyncTrainingFlow(cfg).run())
        await asyncio.sleep(after_s)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run_virtual(scenario())


def test_checkpoints_every_save_steps_and_at_the_end_keeping_the_newest(tmp_path: Path) -> None:
    cfg = config(tmp_path, max_steps=5, save_steps=2, keep_checkpoints=2)
    run_virtual(AsyncTrainingFlow(cfg).run())
    # Steps 2 and 4 by save_steps, 5 at the end; the oldest (2) was removed once 5 was whole.
    assert checkpoints(tmp_path) == ["step_00000004", "step_00000005"]
    last = tmp_path / "r" / "checkpoints" / "step_00000005"
    assert verify_checkpoint(last) is None
    state = flow_state(last)
    assert state["version"] == 5 and state["in_flight"] == [] and state["trained"] == 5 * cfg.train.prompts_per_step
    assert state["next_prompt_id"] == 5 * cfg.train.prompts_per_step


@pytest.mark.parametrize("k", [0, 1])
def test_a_resumed_run_continues_version_data_position_and_metrics(tmp_path: Path, k: int) -> None:
    whole = run_virtual(AsyncTrainingFlow(config(tmp_path, "whole", k, max_steps=6)).run())
    first = config(tmp_path, k=k, max_steps=3)
    run_virtual(AsyncTrainingFlow(first).run())
    resumed = run_virtual(AsyncTrainingFlow(config(tmp_path, k=k, max_steps=6, resume=True)).run())

    assert resumed.resumed_from_version == 3 and resumed.final_version == 6
    assert [s.step for s in resumed.steps] == [3, 4, 5]  # versions continue
    rows = step_rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(6))  # the first run's rows kept, then the resumed run's
    trained = [pid for r in rows for pid in r["prompt_ids"]]
    assert sorted(trained) == list(range(6 * first.train.prompts_per_step))  # each prompt once, none lost
    assert resumed.ledger["trained"] == len(trained) and resumed.ledger["balanced"]
    assert max(resumed.staleness_counts) <= k
    if k == 0:  # the synchronous schedule is the uninterrupted run's, step for step
        assert [r["prompt_ids"] for r in rows] == [s.prompt_ids for s in whole.steps]


def test_a_clean_stop_saves_in_flight_prompts_and_the_resume_trains_each_once(tmp_path: Path) -> None:
    cfg = config(tmp_path, max_steps=8, save_steps=100)
    stop_mid_run(cfg, after_s=4.2)  # virtual seconds: a few steps in, with k = 1 work in flight

    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    [folder] = (tmp_path / "r" / "checkpoints").iterdir()
    state = flow_state(folder)
    version = state["version"]
    assert 0 < version < cfg.run.max_steps and state["in_flight"], state
    # This run's ledger: the in-flight prompts were cancelled at shutdown, with that reason.
    assert summary["ledger"]["dropped_by_stage"] == {"flow": len(state["in_flight"])}
    assert summary["ledger"]["in_flight"] == 0 and summary["ledger"]["balanced"]

    resumed = run_virtual(AsyncTrainingFlow(config(tmp_path, max_steps=8, resume=True)).run())
    assert resumed.steps[0].step == version and resumed.final_version == 8
    rows = step_rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(8))
    counts = Counter(pid for r in rows for pid in r["prompt_ids"])
    assert max(counts.values()) == 1  # trained at most once, over both runs
    assert set(state["in_flight"]) <= set(counts)  # the in-flight prompts were generated again and trained
    assert set(counts) == set(range(8 * cfg.train.prompts_per_step))  # none lost
    assert max(resumed.staleness_counts) <= cfg.staleness.k  # no burst of stale work after the resume
    assert resumed.ledger["trained"] == 8 * cfg.train.prompts_per_step
    assert all(d.reason != CANCELLED_AT_SHUTDOWN for d in resumed.drops)  # the checkpoint has them in flight


def test_a_truncated_checkpoint_is_detected_and_the_previous_one_used(tmp_path: Path) -> None:
    run_virtual(AsyncTrainingFlow(config(tmp_path, max_steps=4, save_steps=2)).run())
    root = tmp_path / "r" / "checkpoints"
    newest = root / "step_00000004"
    state_file = newest / "fake_trainer.json"
    state_file.write_bytes(state_file.read_bytes()[:-3])
    (root / ".tmp-step_00000006-1").mkdir()  # what a kill mid-write leaves: never taken for a checkpoint

    assert "truncated" in verify_checkpoint(newest)  # type: ignore[operator]
    assert find_checkpoint(root) == root / "step_00000002"
    with pytest.raises(CheckpointError, match="step_00000004 is damaged: fake_trainer.json has"):
        find_checkpoint(newest)  # named explicitly: an error, not a silent fallback
    resumed = run_virtual(AsyncTrainingFlow(config(tmp_path, max_steps=4, resume=True)).run())
    assert resumed.resumed_from_version == 2 and [s.step for s in resumed.steps] == [2, 3]
    assert checkpoints(tmp_path) == ["step_00000002", "step_00000004"]  # rewritten whole; the .tmp- left over is gone
    assert verify_checkpoint(newest) is None


def test_a_checkpoint_whose_file_changed_is_detected(tmp_path: Path) -> None:
    run_virtual(AsyncTrainingFlow(config(tmp_path, max_steps=2)).run())
    folder = tmp_path / "r" / "checkpoints" / "step_00000002"
    text = (folder / "flow.json").read_text()
    (folder / "flow.json").write_text(text.replace('"version": 2', '"version": 7'))
    assert verify_checkpoint(folder) is not None
    (folder / "MANIFEST.json").unlink()
    assert verify_checkpoint(folder) == "no MANIFEST.json"


def test_resume_errors_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "step_00000003"
    with pytest.raises(CheckpointError, match=f"no checkpoint at {missing}"):
        run_virtual(AsyncTrainingFlow(config(tmp_path, resume=str(missing))).run())
    with pytest.raises(CheckpointError, match="run.resume: no checkpoint at .*r/checkpoints"):
        run_virtual(AsyncTrainingFlow(config(tmp_path, resume=True)).run())


def test_resume_refuses_a_checkpoint_written_with_another_seed(tmp_path: Path) -> None:
    run_virtual(AsyncTrainingFlow(config(tmp_path, max_steps=2)).run())
    with pytest.raises(CheckpointError, match=r"other values of \['run.seed'\]"):
        run_virtual(AsyncTrainingFlow(config(tmp_path, max_steps=4, resume=True, seed=9)).run())


def test_resume_from_another_runs_checkpoint_path(tmp_path: Path) -> None:
    run_virtual(AsyncTrainingFlow(config(tmp_path, "a", max_steps=2)).run())
    source = tmp_path / "a" / "checkpoints" / "step_00000002"
    result: FlowResult = run_virtual(AsyncTrainingFlow(config(tmp_path, "b", max_steps=3, resume=str(source))).run())
    assert result.resumed_from_version == 2 and [s.step for s in result.steps] == [2]
    assert checkpoints(tmp_path, "b") == ["step_00000003"]
    assert find_checkpoint(tmp_path / "b") == tmp_path / "b" / "checkpoints" / "step_00000003"  # a run folder will do


def test_a_run_saved_while_degraded_resumes_degraded(tmp_path: Path) -> None:
    # Every sync fails: the first failure degrades admission to synchronous, and the run stops
    # (cleanly) while still degraded. The resumed run (its syncs now healthy) starts degraded,
    # not at the configured k, and recovers on its first good sync.
    sections: dict[str, Any] = {
        "run": {"output_dir": str(tmp_path), "name": "d", "max_steps": 8},
        "staleness": {"max_staleness": 2, "degrade_after_sync_failures": 1},
        "roles": {"param_update": {"on_error": "drop", "retry_backoff_s": 0.5}},
        "observability": {"write_run_dir": True, "trace": False},
    }
    stop_mid_run(make_config(**sections, engines={"faults": {"param_update": {"failure_rate": 1.0}}}), after_s=15.0)
    [saved] = (tmp_path / "d" / "checkpoints").iterdir()
    syncs = flow_state(saved)["syncs"]
    assert syncs["degraded"] and syncs["degradations"] == 1 and syncs["failures"] >= 1

    sections["run"]["resume"] = True
    result = run_virtual(AsyncTrainingFlow(make_config(**sections)).run())
    [recovered] = result.mode_changes
    assert not recovered.degraded and recovered.staleness_bound == 2 and "succeeded" in recovered.reason
    assert result.ledger["balanced"] and result.final_version == 8


def test_a_checkpoint_of_format_1_resumes_with_a_fresh_sync_record(tmp_path: Path) -> None:
    cfg = config(tmp_path, max_steps=3)
    run_virtual(AsyncTrainingFlow(cfg).run())
    [saved] = (tmp_path / "r" / "checkpoints").iterdir()
    state = flow_state(saved)
    del state["syncs"], state["reference_saved"]
    state["format"] = 1
    (saved / "flow.json").write_text(json.dumps(state))
    (saved / "MANIFEST.json").unlink()  # re-manifest the edited file, as format 1 wrote it
    files = {p.name: p for p in saved.iterdir()}
    manifest = {"format": 1, "version": 3, "files": {
        name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()} for name, p in files.items()
    }}
    (saved / "MANIFEST.json").write_text(json.dumps(manifest))
    later = config(tmp_path, max_steps=5, resume=True)
    result = run_virtual(AsyncTrainingFlow(later).run())
    assert result.resumed_from_version == 3 and result.final_version == 5 and result.ledger["balanced"]
