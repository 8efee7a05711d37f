"""One writer per run folder, and a metrics port that cannot be bound: both refused by name."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from tandem.pipeline.cli import main
from tandem.pipeline.run_lock import LOCK_FILE, RunFolderBusy, RunFolderLock

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """The CLI configures structlog for the process; give later tests their quiet config back."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def test_a_held_folder_refuses_a_second_lock_naming_the_holder_until_released(tmp_path: Path) -> None:
    first = RunFolderLock.acquire(tmp_path)
    with pytest.raises(RunFolderBusy, match=rf"run folder {tmp_path} is in use by another run \(pid {os.getpid()},"):
        RunFolderLock.acquire(tmp_path)  # a second open file in the same process conflicts too
    first.release()
    first.release()  # idempotent
    RunFolderLock.acquire(tmp_path).release()


def _wait_for(condition: object, proc: subprocess.Popen[str], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert proc.poll() is None, f"the first run exited before {what}: {proc.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s}s"
        time.sleep(0.05)


def test_a_second_run_into_a_live_runs_folder_is_refused_and_after_kill_9_a_resume_proceeds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = [f"run.output_dir={tmp_path}", "run.name=live", "observability.metrics_port=null", "--no-progress"]
    first = subprocess.Popen(
        [sys.executable, "-m", "tandem.pipeline.cli", "run", "sim_k1", "run.max_steps=100000", "run.save_steps=1", *run],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    folder = tmp_path / "live"
    try:
        _wait_for(lambda: any((folder / "checkpoints").glob("step_*")), first, "a checkpoint")
        assert (folder / LOCK_FILE).read_text().strip() == str(first.pid)

        assert main(["run", "sim_k1", "run.resume=true", *run]) == 2
        err = capsys.readouterr().err
        assert f"run folder {folder} is in use by another run (pid {first.pid}" in err and "Traceback" not in err
    finally:
        first.kill()  # SIGKILL: no handler runs, only the OS lets go of the lock
        first.communicate(timeout=30)

    resumed_from = max(int(p.name.removeprefix("step_")) for p in (folder / "checkpoints").glob("step_*"))
    assert main(["run", "sim_k1", "run.resume=true", f"run.max_steps={resumed_from + 2}", *run]) == 0
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["resumed_from_version"] == resumed_from and summary["final_version"] == resumed_from + 2


def test_a_metrics_port_in_use_exits_2_naming_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["run", "sim_k1", f"run.output_dir={tmp_path}", f"observability.metrics_port={port}", "--no-progress"])
    assert code == 2
    err = capsys.readouterr().err
    assert f"observability.metrics_port: cannot serve metrics on 127.0.0.1:{port}" in err
    assert "Traceback" not in err
    RunFolderLock.acquire(tmp_path / "sim_k1").release()  # the refused run let go of its folder
