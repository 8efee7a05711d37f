"""Rollout server processes the flow starts, watches, restarts and stops: ``tandem serve`` or sglang.

What it owns: the command line of each server (:func:`tandem_command`, :func:`sglang_command`:
``python -m sglang.launch_server`` with sglang's flags, one per GPU slot), the processes, their
readiness probe (``GET /health`` answering 200, or the process exiting first: then the error
quotes its log's tail), restarts of a process that exits while the run goes on (up to
``max_restarts`` each, same port), and stopping them all.

Invariants (no orphan survives a run):
- a server is started in a session of its own (a Ctrl-C at the terminal reaches the driver
  alone, which stops the servers in order) and with the parent-death signal set, so it gets
  SIGTERM if the driver dies, even by ``kill -9``; processes are started from the thread that
  runs the event loop, which lives as long as the driver (the signal follows the thread that
  started a process, not the process);
- :meth:`ServerFleet.stop` sends SIGTERM to each server's process group, waits up to
  ``stop_timeout_s`` for the whole group to exit (what a server's helpers clean up, such as
  vLLM's shared memory, is cleaned), then SIGKILLs what is left; it runs on success, error and
  Ctrl-C alike (a components close callback), and a stopped fleet restarts nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import structlog
from pydantic import SecretStr

from tandem.core.threadsafe import post_to_loop

if TYPE_CHECKING:
    from tandem.core.config import LoraConfig

__all__ = ["ServerFleet", "ServerLaunchError", "ServerSpec", "sglang_command", "tandem_command"]

log = structlog.get_logger("tandem.launcher")
_PR_SET_PDEATHSIG = 1
_SECRET_OPTIONS = frozenset({"--api-key", "--admin-api-key"})


class ServerLaunchError(RuntimeError):
    """A server did not become ready; the message names it and quotes its log."""


def tandem_command(model_path: str, host: str, port: int, *, name: str, threads: int, max_batch_size: int,
                   resume_policy: str, dtype: str, device: str, consume_bucket_mb: float,
                   weight_dirs: Sequence[Path] = (), group_addresses: Sequence[str] = (),
                   allow_unauthenticated: bool = False, lora: LoraConfig | None = None) -> list[str]:
    """``tandem serve``'s command line. Keys are not on it (the environment gives them: see
    ``engines.server.build``); ``weight_dirs`` and ``group_addresses`` empty: its defaults;
    ``lora``: the trainer's adapter, which the server then holds (``engines.server.lora``)."""
    command = [
        sys.executable, "-m", "tandem.pipeline.cli", "serve", "--model-path", model_path, "--host", host, "--port", str(port),
        "--name", name, "--threads", str(threads), "--max-batch-size", str(max_batch_size),
        "--resume-policy", resume_policy, "--dtype", dtype, "--device", device, "--consume-bucket-mb", f"{consume_bucket_mb:g}",
    ]
    for folder in weight_dirs:
        command += ["--weight-dir", str(folder)]
    for address in group_addresses:
        command += ["--weight-group-address", address]
    if allow_unauthenticated:
        command.append("--allow-unauthenticated")
    if lora is not None:
        command += ["--lora-rank", str(lora.rank), "--lora-alpha", str(lora.alpha)]
        command += ["--lora-target-modules", *lora.target_modules] if lora.target_modules else []
    return command


def sglang_command(model_path: str, host: str, port: int, *, dtype: str, api_key: SecretStr | None = None) -> list[str]:
    """sglang's own launcher with the flags it documents; the GPU comes from CUDA_VISIBLE_DEVICES.
    sglang reads its key from the command line only (the launch log shows it redacted)."""
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host, "--port", str(port),
               "--dtype", dtype]
    if api_key is not None:
        command += ["--api-key", api_key.get_secret_value()]
    return command


def redacted(command: list[str]) -> str:
    """``command`` for a log line: the value after a key option shown as ``***``."""
    return " ".join("***" if i > 0 and command[i - 1] in _SECRET_OPTIONS else arg for i, arg in enumerate(command))


@dataclass(slots=True)
class ServerSpec:
    """One server to run: its command, URL, log file and extra environment (its GPU)."""

    name: str
    command: list[str]
    url: str
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class _Process:
    spec: ServerSpec
    popen: subprocess.Popen[bytes] | None = None
    restarts: int = 0


# Resolved here, not in the child: between fork and exec the child must not load libraries.
_prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl if sys.platform == "linux" else None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class ServerFleet:
    """The server processes of one run (see the module docstring)."""

    def __init__(self, specs: list[ServerSpec], *, startup_timeout_s: float, max_restarts: int,
                 stop_timeout_s: float = 10.0, on_restart: Callable[[str], None] | None = None) -> None:
        self._procs = [_Process(spec) for spec in specs]
        self._startup_timeout_s = startup_timeout_s
        self._max_restarts = max_restarts
        self._stop_timeout_s = stop_timeout_s
        self._stopping = False
        self._ready: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.on_restart = on_restart

    @property
    def urls(self) -> list[str]:
        return [p.spec.url for p in self._procs]

    @property
    def pids(self) -> list[int]:
        return [p.popen.pid for p in self._procs if p.popen is not None]

    def launch(self) -> None:
        """Start every process now (no waiting: :meth:`ready` waits)."""
        for proc in self._procs:
            self._spawn(proc)

    async def ready(self) -> None:
        """Wait until every server answers ``/health``, then watch for exits. Idempotent."""
        if self._ready is None:
            self._loop = asyncio.get_running_loop()
            self._ready = asyncio.ensure_future(self._all_ready())
        await asyncio.shield(self._ready)

    async def _all_ready(self) -> None:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(self._wait_ready(session, p) for p in self._procs))
        for proc in self._procs:
            self._watch(proc)

    async def _wait_ready(self, session: aiohttp.ClientSession, proc: _Process) -> None:
        deadline = time.monotonic() + self._startup_timeout_s
        while True:  # a readiness probe: the server says nothing when it is up, so ask
            assert proc.popen is not None
            if proc.popen.poll() is not None:
                raise ServerLaunchError(f"{proc.spec.name} exited with code {proc.popen.returncode} before it was ready; "
                                        f"its log ({proc.spec.log_path}):\n{_tail(proc.spec.log_path)}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(proc.spec.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    if resp.status == 200:
                        log.info("rollout server ready", server=proc.spec.name, url=proc.spec.url, pid=proc.popen.pid)
                        return
            if time.monotonic() > deadline:
                raise ServerLaunchError(f"{proc.spec.name} at {proc.spec.url} not ready after {self._startup_timeout_s:g} s; "
                                        f"its log ({proc.spec.log_path}):\n{_tail(proc.spec.log_path)}")
            await asyncio.sleep(0.2)

    def _spawn(self, proc: _Process) -> None:
        spec = proc.spec
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        with spec.log_path.open("ab") as out:
            proc.popen = subprocess.Popen(
                spec.command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **spec.env}, start_new_session=True, preexec_fn=_die_with_parent,
            )
        log.info("rollout server started", server=spec.name, pid=proc.popen.pid, command=redacted(spec.command))

    def _watch(self, proc: _Process) -> None:
        """A thread waits for the process to exit and tells the loop (no polling)."""
        popen, loop = proc.popen, self._loop
        assert popen is not None and loop is not None

        def wait() -> None:
            popen.wait()
            if not self._stopping:  # stop() ends the group itself, once it had time to clean up
                _kill_group(popen.pid)  # a server's own children (vLLM's engine core, its workers) go with it
            post_to_loop(loop, self._exited, proc, popen)  # a closed loop: the run is over

        threading.Thread(target=wait, name=f"watch-{proc.spec.name}", daemon=True).start()

    def _exited(self, proc: _Process, popen: subprocess.Popen[bytes]) -> None:
        if self._stopping or proc.popen is not popen:
            return
        if proc.restarts >= self._max_restarts:
            log.error("rollout server exited; no restarts left", server=proc.spec.name, code=popen.returncode)
            return
        proc.restarts += 1
        log.warning("rollout server exited; restarting", server=proc.spec.name, code=popen.returncode, restart=proc.restarts)
        self._spawn(proc)  # on the loop's thread, which outlives the process (parent-death signal)
        if self.on_restart is not None:
            self.on_restart(proc.spec.url)
        task = asyncio.ensure_future(self._rewatch(proc))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _rewatch(self, proc: _Process) -> None:
        async with aiohttp.ClientSession() as session:
            await self._wait_ready(session, proc)
        self._watch(proc)

    def stop(self) -> None:
        """Stop every server: SIGTERM to its process group, SIGKILL after ``stop_timeout_s``."""
        self._stopping = True
        live = [p.popen for p in self._procs if p.popen is not None and p.popen.poll() is None]
        for popen in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + self._stop_timeout_s
        for popen in live:
            try:
                popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(popen.pid)
                popen.wait()
            _drain_group(popen.pid, deadline)  # children the server left behind when it exited
        if self._ready is not None and not self._ready.done():
            self._ready.cancel()


def _drain_group(pgid: int, deadline: float) -> None:
    """Give what is left of a stopped server's process group until ``deadline`` to exit, then
    SIGKILL it. The wait matters for vLLM: its engine core's shared memory (~400 MB of /dev/shm)
    is unlinked by Python's resource tracker, in the group, only once every process that used
    it is gone; killed at once, the tracker leaves the segments behind."""
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)  # the group's processes are not our children: no wait() tells when they are gone
    _kill_group(pgid)


def _kill_group(pgid: int) -> None:
    """SIGKILL what is left of a server's process group (each server leads a session of its own)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
