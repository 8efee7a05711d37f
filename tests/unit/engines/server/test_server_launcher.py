"""Server processes: the command lines (``tandem serve``, ``python -m sglang.launch_server``), the
readiness probe, restarts, and stopping — no process survives a run, even a driver killed -9.

sglang is not installable on these machines: its launch path is tested up to the command line
and the readiness probe (a stand-in process answering ``/health`` as sglang does)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tandem.core.config import validate_config
from tandem.engines.server.build import server_fleet
from tandem.engines.server.launcher import ServerFleet, ServerLaunchError, ServerSpec, sglang_command, tandem_command
from tandem.engines.server.weights import free_port

# Answers /health 503 for DELAY seconds, then 200; exits after LIFE seconds (sglang's readiness, faked).
STAND_IN = textwrap.dedent("""
    import asyncio, sys, time
    from aiohttp import web
    port, delay, life = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    t0 = time.monotonic()
    async def health(request):
        return web.Response(status=200 if time.monotonic() - t0 > delay else 503)
    async def main():
        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        print("serving", flush=True)
        await asyncio.sleep(life)
    asyncio.run(main())
""")


def stand_in(tmp_path: Path, name: str, *, delay: float = 0.0, life: float = 600.0, port: int | None = None) -> ServerSpec:
    port = port or free_port()
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    return ServerSpec(name, [sys.executable, str(script), str(port), str(delay), str(life)], f"http://127.0.0.1:{port}",
                      tmp_path / f"{name}.log")


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie (exited, not yet reaped by its parent) is gone too.
    status = Path(f"/proc/{pid}/status")
    return not status.exists() or "State:\tZ" in status.read_text()


def wait_gone(pid: int, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if gone(pid):
            return True
        time.sleep(0.05)
    return False


def test_sglang_servers_are_sglangs_own_launcher_one_per_gpu(tmp_path: Path) -> None:
    assert sglang_command("/m", "127.0.0.1", 30000, dtype="bfloat16") == [
        sys.executable, "-m", "sglang.launch_server", "--model-path", "/m", "--host", "127.0.0.1", "--port", "30000",
        "--dtype", "bfloat16",
    ]
    config = validate_config({
        "task": {"name": "arithmetic"}, "flow": {"stages": ["dataloader", "generate", "rollout", "reward", "train"]},
        "algorithm": {"decoupled": False},
        "engines": {"type": "torch", "device": "cuda", "rollout": "sglang",
                    "servers": {"count": 2, "base_port": 31000, "weight_transport": "dist"}},
    })
    fleet = server_fleet(config, "/m", 1, tmp_path)
    specs = [p.spec for p in fleet._procs]
    assert [s.url for s in specs] == ["http://127.0.0.1:31000", "http://127.0.0.1:31001"]
    assert [s.env for s in specs] == [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}]
    assert all(s.command[1:3] == ["-m", "sglang.launch_server"] for s in specs)


def test_tandem_servers_run_tandem_serve_with_the_engines_settings() -> None:
    command = tandem_command("/m", "127.0.0.1", 5, name="server0", threads=1, max_batch_size=64, resume_policy="recompute",
                             dtype="float32", device="cpu", consume_bucket_mb=64)
    assert command[1:4] == ["-m", "tandem.pipeline.cli", "serve"]
    args = dict(zip(command[4::2], command[5::2]))
    assert args == {"--model-path": "/m", "--host": "127.0.0.1", "--port": "5", "--name": "server0", "--threads": "1",
                    "--max-batch-size": "64", "--resume-policy": "recompute", "--dtype": "float32", "--device": "cpu",
                    "--consume-bucket-mb": "64"}


async def test_ready_waits_until_health_answers_200(tmp_path: Path) -> None:
    fleet = ServerFleet([stand_in(tmp_path, "s0", delay=1.5)], startup_timeout_s=60, max_restarts=0)
    fleet.launch()
    try:
        t0 = time.monotonic()
        await fleet.ready()
        assert time.monotonic() - t0 >= 1.4  # not before the server said it was ready
    finally:
        fleet.stop()


async def test_a_server_that_exits_before_it_is_ready_fails_naming_it_and_quoting_its_log(tmp_path: Path) -> None:
    spec = ServerSpec("bad", [sys.executable, "-c", "print('CUDA error: no device'); raise SystemExit(3)"],
                      f"http://127.0.0.1:{free_port()}", tmp_path / "bad.log")
    fleet = ServerFleet([spec], startup_timeout_s=60, max_restarts=0)
    fleet.launch()
    try:
        with pytest.raises(ServerLaunchError, match=r"bad exited with code 3(.|\n)*CUDA error: no device"):
            await fleet.ready()
    finally:
        fleet.stop()


async def test_a_server_that_never_gets_ready_times_out(tmp_path: Path) -> None:
    fleet = ServerFleet([stand_in(tmp_path, "slow", delay=600)], startup_timeout_s=1.0, max_restarts=0)
    fleet.launch()
    try:
        with pytest.raises(ServerLaunchError, match="not ready after 1 s"):
            await fleet.ready()
    finally:
        fleet.stop()


async def test_a_server_that_exits_is_restarted_on_its_port(tmp_path: Path) -> None:
    spec = stand_in(tmp_path, "s0", life=2.0)
    restarted: list[str] = []
    fleet = ServerFleet([spec], startup_timeout_s=60, max_restarts=1, on_restart=restarted.append)
    fleet.launch()
    try:
        await fleet.ready()
        first = fleet.pids[0]
        while not restarted:
            await asyncio.sleep(0.05)
        assert restarted == [spec.url] and fleet.pids[0] != first
    finally:
        fleet.stop()
    assert all(wait_gone(pid) for pid in fleet.pids)


def test_stop_kills_a_server_that_ignores_sigterm(tmp_path: Path) -> None:
    stubborn = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('up', flush=True); time.sleep(600)"]
    fleet = ServerFleet([ServerSpec("stubborn", stubborn, "http://127.0.0.1:1", tmp_path / "s.log")],
                        startup_timeout_s=60, max_restarts=0, stop_timeout_s=1.0)
    fleet.launch()
    pid = fleet.pids[0]
    while "up" not in (tmp_path / "s.log").read_text():
        time.sleep(0.05)
    t0 = time.monotonic()
    fleet.stop()
    assert gone(pid) and time.monotonic() - t0 < 10


# A helper in the server's process group that, as Python's resource tracker does (it unlinks vLLM's
# shared memory), ignores SIGTERM and cleans up only once the server has exited.
HELPER = textwrap.dedent("""
    import os, signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    server = os.getppid()
    while os.getppid() == server:
        time.sleep(0.05)
    time.sleep(0.3)  # the cleanup itself
    open(sys.argv[1], "w").write("cleaned")
""")


def test_stop_lets_a_servers_helpers_clean_up_before_its_group_is_killed(tmp_path: Path) -> None:
    helper, marker = tmp_path / "helper.py", tmp_path / "cleaned"
    helper.write_text(HELPER)
    spec = stand_in(tmp_path, "s")
    server = tmp_path / "server.py"  # the stand-in, with the helper beside it
    server.write_text(f"import runpy, subprocess, sys\nsubprocess.Popen([sys.executable, {str(helper)!r}, {str(marker)!r}])\n"
                      f"runpy.run_path({spec.command[1]!r}, run_name='__main__')\n")
    spec.command[1] = str(server)
    fleet = ServerFleet([spec], startup_timeout_s=60, max_restarts=0, stop_timeout_s=10.0)
    fleet.launch()
    asyncio.run(fleet.ready())  # from here a thread watches the server's exit, as in a run
    fleet.stop()
    assert marker.read_text() == "cleaned"
    with pytest.raises(ProcessLookupError):
        os.killpg(fleet.pids[0], 0)  # and then nothing of the group is left


def test_no_server_outlives_a_driver_killed_with_sigkill(tmp_path: Path) -> None:
    """The driver has no chance to stop anything: the parent-death signal does."""
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).resolve().parents[4])!r})
        from tandem.engines.server.launcher import ServerFleet, ServerSpec
        specs = [ServerSpec(f"s{{i}}", [sys.executable, "-c", "import time; time.sleep(600)"], "http://127.0.0.1:1",
                            __import__("pathlib").Path({str(tmp_path)!r}) / f"s{{i}}.log") for i in range(2)]
        fleet = ServerFleet(specs, startup_timeout_s=60, max_restarts=0)
        fleet.launch()
        print("PIDS", *fleet.pids, flush=True)
        time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE, text=True)
    try:
        line = next(line for line in proc.stdout if line.startswith("PIDS"))  # type: ignore[union-attr]
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == 2 and not any(gone(p) for p in pids)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert all(wait_gone(pid) for pid in pids)
    finally:
        if proc.poll() is None:
            proc.kill()
