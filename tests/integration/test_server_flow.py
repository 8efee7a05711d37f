"""The flow with generation in rollout servers (``engines.rollout: server``) on the shipped model:
it trains, the staleness bound and the ledger hold as in-process, a server killed -9 mid-run is
replaced and every prompt is trained exactly once, the servers are gone afterwards, an agent
written against the ``openai`` client trains end to end, and the LoRA job syncs its adapter
alone. A ``gpu`` test runs real sglang."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tandem.core.config import ConfigError, TandemConfig, load_config, validate_config
from tandem.core.paths import CONFIGS_DIR
from tandem.pipeline import AsyncTrainingFlow
from tandem.pipeline.builders import build_components
from tandem.tasks.arithmetic import MAX_RESPONSE_TOKENS, MODEL_DIR
from tests.conftest import merge

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(), reason="the shipped model is missing"),
]

SMALL: dict[str, Any] = {
    "run": {"max_steps": 4, "seed": 1},
    "staleness": {"max_staleness": 1},
    "train": {"prompts_per_step": 4},
    "rollout": {"samples_per_prompt": 4, "max_new_tokens": MAX_RESPONSE_TOKENS},
    "flow": {"stages": ["dataloader", "generate", "rollout", "logp", "reward", "train"], "micro_batch_size": 2},
    "engines": {"type": "torch", "model_path": str(MODEL_DIR), "lr": 1e-3, "generation_threads": 1, "train_threads": 1,
                "rollout": "server", "servers": {"startup_timeout_s": 240}},
    "task": {"name": "arithmetic"},
    "observability": {"write_run_dir": False, "trace": False},
}


def server_config(tmp_path: Path, **sections: Any) -> TandemConfig:
    return validate_config(merge(merge(SMALL, {"run": {"output_dir": str(tmp_path)}}), sections))


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    status = Path(f"/proc/{pid}/status")
    return not status.exists() or "State:\tZ" in status.read_text()


def check_run(result: Any, config: TandemConfig) -> None:
    k = config.staleness.k
    ledger = result.ledger
    assert len(result.steps) == config.run.max_steps
    assert ledger["trained"] == config.run.max_steps * config.train.prompts_per_step and ledger["dropped"] == 0
    assert ledger["balanced"]
    assert all(int(s) <= k for s in result.staleness_counts)  # the bound, as in-process


def test_the_default_job_trains_with_generation_in_a_server_and_stops_it(tmp_path: Path) -> None:
    config = server_config(tmp_path)
    components = build_components(config)
    fleet = components.close_callbacks[2].__self__  # the fleet's stop: its pids, to check they are gone
    result = asyncio.run(AsyncTrainingFlow(config, components=components).run())
    components.close()
    check_run(result, config)
    assert all(r.reward_mean == r.reward_mean for r in result.steps)  # a number every step
    assert result.syncs and result.syncs[-1].version >= config.run.max_steps - 1
    assert all(gone(pid) for pid in fleet.pids)


def test_a_server_killed_mid_run_is_replaced_and_every_prompt_is_trained_once(tmp_path: Path) -> None:
    config = server_config(
        tmp_path, run={"max_steps": 5},  # killed after step 2: at k = 1 what it holds trains by step 4
        engines={"servers": {"count": 2, "max_restarts": 1, "health_interval_s": 0.5, "startup_timeout_s": 240}},
        roles={"param_update": {"max_retries": 3, "retry_backoff_s": 0.5}},
    )
    components = build_components(config)
    fleet = components.close_callbacks[2].__self__
    killed: list[int] = []

    def on_step(record: Any) -> None:
        if record.step == 2 and not killed:
            killed.append(fleet.pids[0])
            os.kill(fleet.pids[0], signal.SIGKILL)

    result = asyncio.run(AsyncTrainingFlow(config, components=components, on_step=on_step).run())
    restarts = [p.restarts for p in fleet._procs]
    components.close()
    check_run(result, config)
    assert killed and restarts == [1, 0]
    assert all(gone(pid) for pid in [*killed, *fleet.pids])


def test_an_openai_client_agent_named_in_the_config_trains_end_to_end(tmp_path: Path) -> None:
    """The agent sees only an OpenAI endpoint (the shipped one calls it with the ``openai``
    client); the workflow turns its calls into trajectories, and the flow opens the agent's
    session once and closes it when the run ends."""
    pytest.importorskip("openai")
    from tests.unit.engines.agents_for_tests import COUNTED

    config = load_config(CONFIGS_DIR / "arithmetic_openai_agent.yaml", [  # the shipped config, made small
        f"run.output_dir={tmp_path}", "run.max_steps=4", "train.prompts_per_step=4", "rollout.samples_per_prompt=4",
        "engines.generation_threads=1", "engines.train_threads=1", "engines.lr=1e-3",
        "engines.servers.startup_timeout_s=240", "validation.every_versions=null",
        "observability.write_run_dir=false", "observability.trace=false", "observability.metrics_port=null",
        "engines.servers.agent=tests.unit.engines.agents_for_tests:counted_solver",  # the shipped solver, counted
    ])
    assert load_config(CONFIGS_DIR / "arithmetic_openai_agent.yaml").engines.servers.agent == (
        "tandem.tasks.arithmetic.openai_agent:solver")
    before = len(COUNTED.entered_in)

    async def run_and_count() -> tuple[Any, int]:
        result = await AsyncTrainingFlow(config).run()  # the flow builds and closes the bundle
        return result, len(COUNTED.exited_in)  # before asyncio.run would cancel a session left open

    result, exited = asyncio.run(run_and_count())
    check_run(result, config)
    assert len(COUNTED.entered_in) == exited == before + 1
    assert result.syncs and result.syncs[-1].version >= 3  # the trained weights reached the agent's server
    trained = [s.tokens for s in result.steps]
    assert all(t > 0 for t in trained)  # the recorded calls' tokens were trained


def test_servers_behind_keys_train_an_openai_agent_and_the_keys_are_written_nowhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's servers require an API key (from an environment variable) and a separate admin
    key (from a file): the agent's openai client, the router and the shared-memory weight sync
    each send theirs, and neither key reaches the config, the run's logs or the servers' logs."""
    pytest.importorskip("openai")
    api_key, admin_key = "api-5c1d0e9b", "admin-0a7f3e21"
    monkeypatch.setenv("TANDEM_TEST_ROLLOUT_KEY", api_key)
    key_file = tmp_path / "admin.key"
    key_file.write_text(admin_key + "\n")
    config = load_config(CONFIGS_DIR / "arithmetic_openai_agent.yaml", [
        f"run.output_dir={tmp_path}", "run.max_steps=3", "train.prompts_per_step=4", "rollout.samples_per_prompt=2",
        "engines.generation_threads=1", "engines.train_threads=1", "engines.lr=1e-3",
        "engines.servers.startup_timeout_s=240", "validation.every_versions=null",
        "observability.trace=false", "observability.metrics_port=null",
        "engines.servers.api_key.env=TANDEM_TEST_ROLLOUT_KEY", f"engines.servers.admin_key.file={key_file}",
    ])
    result = asyncio.run(AsyncTrainingFlow(config).run())
    check_run(result, config)
    assert result.syncs and result.syncs[-1].version >= 2  # the admin key opened the weight route
    written = [p for p in tmp_path.rglob("*") if p.is_file() and p != key_file]
    assert any(p.name == "server0.log" for p in written)
    leaked = [p for p in written if api_key.encode() in p.read_bytes() or admin_key.encode() in p.read_bytes()]
    assert leaked == []
    assert api_key not in config.model_dump_json() and admin_key not in config.model_dump_json()


def test_the_shipped_lora_job_trains_with_its_adapter_synced_to_a_server_and_probed(tmp_path: Path) -> None:
    pytest.importorskip("peft", reason="LoRA needs the lora extra (peft)")
    config = load_config(CONFIGS_DIR / "lora_arithmetic.yaml", [  # the shipped config, made small
        "engines.rollout=server", "engines.servers.startup_timeout_s=240", "run.max_steps=3", "train.prompts_per_step=2",
        "rollout.samples_per_prompt=4", "rollout.max_new_tokens=16", "engines.lora.export_merged=false",
        "validation.every_versions=null", "observability.metrics_port=null", "observability.trace=false",
        "observability.write_run_dir=false", f"run.output_dir={tmp_path}",
    ])
    result = asyncio.run(AsyncTrainingFlow(config).run())  # the flow builds, and closes, the server and the sync
    assert len(result.steps) == 3 and result.syncs
    adapter_bytes = result.syncs[0].metrics["bytes"]
    assert all(s.metrics["bytes"] == adapter_bytes for s in result.syncs)
    assert adapter_bytes < (MODEL_DIR / "model.safetensors").stat().st_size / 10  # the adapter, not the model
    assert all(s.metrics["logprob_gap"] < 1e-4 for s in result.syncs)  # each sync proven on the server


def test_an_agent_that_cannot_be_loaded_is_refused_before_any_server_starts(tmp_path: Path) -> None:
    config = server_config(tmp_path, engines={"servers": {"agent": "tandem.tasks.arithmetic.openai_agent:no_such_agent"}})
    with pytest.raises(ConfigError, match=r"engines.servers.agent: cannot import .*no_such_agent"):
        build_components(config)
    assert not list((tmp_path).rglob("server0.log"))  # no server was started


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed (it needs CUDA)")
def test_real_sglang_servers_train_the_default_job(tmp_path: Path) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    config = server_config(tmp_path, engines={"rollout": "sglang", "device": "cuda",
                                              "servers": {"weight_transport": "dist", "startup_timeout_s": 600}})
    result = asyncio.run(AsyncTrainingFlow(config).run())
    check_run(result, config)
