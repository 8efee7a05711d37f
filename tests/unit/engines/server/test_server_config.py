"""``engines.rollout`` and ``engines.servers``: every field validated before anything starts, naming the field."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tandem.core.config import ConfigError, TandemConfig, validate_config
from tests.conftest import merge
from tests.unit.engines import agents_for_tests

AGENTS = "tests.unit.engines.agents_for_tests"

BASE: dict[str, Any] = {
    "task": {"name": "arithmetic"},
    "flow": {"stages": ["dataloader", "generate", "rollout", "logp", "reward", "train"]},
    "engines": {"type": "torch"},
}


def config(**engines: Any) -> TandemConfig:
    return validate_config(merge(BASE, {"engines": engines}))


def test_embedded_is_the_default_and_servers_default_to_one_on_loopback() -> None:
    c = config()
    assert c.engines.rollout == "embedded"
    s = config(rollout="server").engines.servers
    assert (s.servers, s.host, s.weight_transport, s.urls) == (1, "127.0.0.1", "shm", [])
    assert config(rollout="server", servers={"urls": ["http://h:1", "http://h:2"]}).engines.servers.servers == 2


@pytest.mark.parametrize(
    ("engines", "named"),
    [
        ({"servers": {"count": 2}}, "engines.servers applies to engines.rollout=server, vllm_server or sglang"),
        ({"rollout": "sglang"}, "engines.servers.weight_transport=shm"),
        ({"rollout": "server", "servers": {"urls": ["h:1"]}}, "engines.servers.urls"),
        ({"rollout": "server", "servers": {"urls": ["http://h:1"], "count": 2}}, "engines.servers.count=2"),
        ({"rollout": "server", "servers": {"urls": ["http://h:1"], "max_restarts": 1}}, "engines.servers.max_restarts"),
        ({"rollout": "server", "servers": {"count": 3, "base_port": 65534}}, "engines.servers.base_port"),
        ({"rollout": "server", "servers": {"max_restarts": 1}}, "roles.param_update.max_retries"),
        ({"rollout": "server", "servers": {"weight_transport": "tcp"}}, "weight_transport"),
        ({"rollout": "tgi"}, "rollout"),  # not a rollout engine tandem drives
        ({"rollout": "server", "servers": {"request_timeout_s": 0}}, "request_timeout_s"),
        ({"rollout": "server", "servers": {"agent": "tasks.arithmetic.openai_agent"}}, "engines.servers.agent must be"),
        ({"rollout": "sglang", "servers": {"weight_transport": "dist", "agent": "a:b"}},
         "engines.servers.agent needs engines.rollout=server or vllm_server"),
    ],
)
def test_invalid_server_settings_fail_naming_the_field(engines: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.").replace("=", "=")):
        config(**engines)


@pytest.mark.parametrize("rollout", ["server", "vllm_server"])
def test_an_agent_trains_on_tandem_serve_or_vllm_servers(rollout: str) -> None:
    # tandem serve records the agent's calls; in front of vLLM's servers the run's proxy does
    assert config(rollout=rollout, servers={"agent": "a:b"}).engines.servers.agent == "a:b"


def test_servers_need_the_local_backend() -> None:
    with pytest.raises(ConfigError, match="cluster.backend=local"):
        validate_config(merge(BASE, {"engines": {"rollout": "server"}, "cluster": {"backend": "ray"}}))


def test_restarts_with_sync_retries_are_accepted() -> None:
    c = validate_config(merge(BASE, {"engines": {"rollout": "server", "servers": {"count": 2, "max_restarts": 1}},
                                     "roles": {"param_update": {"max_retries": 2}}}))
    assert c.engines.servers.max_restarts == 1


def test_an_agent_is_loaded_by_path_as_a_session_or_an_async_function() -> None:
    from tandem.engines.server.agent import load_agent

    pytest.importorskip("openai")
    from tandem.tasks.arithmetic.openai_agent import solver

    assert load_agent("tandem.tasks.arithmetic.openai_agent:solver") is solver  # an asynccontextmanager function

    async def enter_plain() -> object:  # an async function is a session that holds nothing
        async with load_agent(f"{AGENTS}:one_completion")() as agent:
            return agent

    assert asyncio.run(enter_plain()) is agents_for_tests.one_completion
    with pytest.raises(ConfigError, match="engines.servers.agent: 'tandem.tasks.arithmetic:make_task' is neither"):
        load_agent("tandem.tasks.arithmetic:make_task")
    with pytest.raises(ConfigError, match="engines.servers.agent: cannot import 'no_such_module:solve'"):
        load_agent("no_such_module:solve")
