"""Shared helpers: configs built from nested overrides, flows run on a virtual clock."""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import json
import logging
import subprocess
import sys
import time
import tomllib
from collections import Counter
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import looptime
import pytest
import structlog

from tandem.core.config import TandemConfig, validate_config

T = TypeVar("T")

# Quiet logs in tests; a failing test still shows its assertion.
structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

BASE: dict[str, Any] = {
    "run": {"max_steps": 6, "seed": 0},
    "train": {"prompts_per_step": 4},
    "rollout": {"samples_per_prompt": 2},
    "flow": {"micro_batch_size": 4, "channel_capacity": 8},
    "engines": {
        "type": "fake",
        "generation_slots": 16,
        "generation_latency": {"type": "lognormal", "mean_s": 1.0, "sigma": 0.8},
        "train_step_latency": {"type": "constant", "mean_s": 0.5},
        "logp_latency": {"type": "constant", "mean_s": 0.05},
        "reward_latency": {"type": "constant", "mean_s": 0.05},
        "sync_latency": {"type": "constant", "mean_s": 0.1},
    },
    "observability": {"write_run_dir": False, "trace": False},
}


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def make_config(**sections: Any) -> TandemConfig:
    """The small test config with some sections overridden (nested dicts merge)."""
    return validate_config(merge(BASE, sections))


def run_virtual(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on a fresh event loop whose clock jumps to the next timer (looptime).

    ``noop_cycles=1``: nothing here waits on threads, so the loop may advance time as soon as
    it is idle (the default 42 idle cycles made simulations 9x slower).
    """
    loop = looptime.new_event_loop(noop_cycles=1)
    try:
        result = loop.run_until_complete(coro)
        leftover = [t for t in asyncio.all_tasks(loop) if not t.done()]
        assert not leftover, f"tasks left pending after the run: {leftover}"
        return result
    finally:
        loop.close()


@pytest.fixture
def config() -> TandemConfig:
    return make_config()


def wait_until_dead(handle: Any, timeout_s: float = 30.0) -> None:
    """Return once a killed Ray actor is gone: ``ray.kill`` returns before it is, and a call made
    in between may still run. Ray offers no event for this, so ask until a call fails."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError(f"actor {handle} still answers {timeout_s} s after it was killed")


# `make test` runs the suite in two pytest-xdist workers (`--dist loadgroup`), one module at a time
# per worker: a module's tests share module-scoped fixtures (trainer groups of rank processes, a
# model) that would otherwise be built once in each worker. A heavy instance shared per session
# (one Ray cluster, one vLLM engine) must be shared per *suite*: every test that uses one runs in
# the same worker, whatever its module, in the group named here. Tests that start vLLM processes of
# their own are marked `xdist_group("vllm")` in their modules: they count the machine's vLLM
# processes, so no other vLLM may start beside them.
SHARED_INSTANCE_GROUPS = {"ray_cluster": "ray", "vllm_engine": "vllm"}


def pytest_configure(config: pytest.Config) -> None:
    """Name xdist's marker here too, so the suite still collects under ``-p no:xdist`` (one process,
    as when timing a single test) with ``--strict-markers``."""
    config.addinivalue_line("markers", "xdist_group(name): run in the xdist worker of this group")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test gets its xdist group, and the groups with the most slow tests come first.

    xdist hands the groups out in collection order (`make test` passes `--no-loadscope-reorder`;
    by default it puts the groups with the most tests first, which left the one-test benchmark
    smoke runs, 35-45 s each, for the end, when one worker went on alone for 70-80 s after the
    other had finished). Heavy groups first (the vLLM and Ray groups, minutes each, have the
    most slow tests), the many quick tests fill the end."""
    for item in items:
        for fixture, group in SHARED_INSTANCE_GROUPS.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(pytest.mark.xdist_group(group))
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
    slow = Counter(_group(item) for item in items if item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: -slow[_group(item)])  # stable: each group keeps its order


def _group(item: pytest.Item) -> str:
    marker = item.get_closest_marker("xdist_group")
    assert marker is not None
    return str(marker.args[0] if marker.args else marker.kwargs["name"])


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread() -> None:
    """The tests' own torch compute (models built, trained and evaluated in the test process) runs
    on one thread. `make test` runs two workers on two cores, so torch's default of one thread per
    core in each oversubscribes the machine: beside one CPU-bound process (the other worker), the
    shipped arithmetic model's greedy evaluation of 300 problems took 16.5 CPU-s and 13.5 s on two
    threads against 8 CPU-s and 8 s on one. One thread everywhere also makes a test's arithmetic the
    same whatever ran before it in its worker. Engines keep their own budgets: each applies its
    own on its worker threads."""
    if importlib.util.find_spec("torch") is not None:
        import torch

        torch.set_num_threads(1)


@pytest.fixture
def ray_cluster() -> Any:
    """A local Ray cluster (2 CPUs), started by the first test that asks for it and kept for the
    next ones; the Ray backend joins it instead of starting its own. It stops as soon as the next
    test needs none (:func:`pytest_runtest_teardown`): idle, its processes still took 5 % of a
    core, and `make test`'s worker ran for another ten minutes after the last Ray test."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    return ray


@pytest.hookimpl(trylast=True)  # after the test's own fixtures are torn down: they may still use Ray
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if "ray_cluster" in getattr(item, "fixturenames", ()) and (
        nextitem is None or "ray_cluster" not in getattr(nextitem, "fixturenames", ())
    ):
        import ray

        ray.shutdown()


REPO = Path(__file__).resolve().parents[1]


def run_benchmark(script: str, *args: str, out: Path, timeout_s: float) -> Any:
    """Run ``benchmarks/<script>`` as a user would (this interpreter, from the repository root),
    writing its results to ``out``; the JSON it wrote. A failed run fails the test with the end
    of its stderr."""
    command = [sys.executable, str(REPO / "benchmarks" / script), *args, "--out", str(out)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def package_dirs() -> dict[str, str]:
    """``tandem``'s packages and the repository folders they are made of (pyproject.toml's
    ``package-dir``: the one place the layout is written down)."""
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
