"""A rollout server reachable from other machines is safe to expose: with a key, every route but
``/health`` answers 401 without it; the admin routes can take a key of their own; a non-loopback
bind without a key is refused; and the trainer's side (router, client, weight transports, agents,
launcher) sends the key it was configured with, never writing it anywhere."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import structlog
from aiohttp import web
from pydantic import SecretStr
from tiny_lm import decode, encode

from tandem.core.config import ConfigError, RolloutServersConfig, SecretSource, is_loopback
from tandem.engines.server.app import RolloutServer, run
from tandem.engines.server.auth import ADMIN_ROUTES, ApiKeys, check_bind
from tandem.engines.server.build import server_keys, tandem_key_env
from tandem.engines.server.client import ServerClient, ServerError
from tandem.engines.server.launcher import redacted, sglang_command, tandem_command
from tandem.engines.server.limits import ServerLimits
from tandem.engines.server.options import add_arguments
from tandem.engines.server.router import ServerRolloutEngine, running
from tandem.engines.server.weights import DiskTransport, post_json
from tandem.engines.vllm.server import VllmServerClient, vllm_key_env
from tandem.param_sync import ParamSyncer
from tests.unit.engines.server.test_server_router import collect, requests
from tests.unit.engines.server.test_server_support import served
from tests.unit.engines.server.test_server_weights import trainer_source

KEY, ADMIN = "k-3f9a1c", "adm-77e2b0"


def routes(server: RolloutServer) -> list[tuple[str, str]]:
    """Every (method, path) the server's application registers (a path parameter filled in)."""
    found = []
    for route in server.application().router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        if route.method != "HEAD":
            found.append((route.method, path.replace("{conversation_id}", "c1")))
    return sorted(set(found))


async def call(session: aiohttp.ClientSession, method: str, url: str, key: str | None = None,
               body: Any = None) -> tuple[int, dict[str, Any] | str, aiohttp.typedefs.LooseHeaders]:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    async with session.request(method, url, json=body, headers=headers) as resp:
        text = await resp.text()
        return resp.status, (await resp.json() if resp.content_type == "application/json" else text), resp.headers


async def test_every_route_but_health_is_401_without_the_key(model_dir: Path) -> None:
    keys = ApiKeys(api_key=SecretStr(KEY))
    async with served(model_dir, keys=keys) as (server, url), aiohttp.ClientSession() as session:
        table = routes(server)
        answers = {(m, p): await call(session, m, url + p) for m, p in table}
        health, _, _ = await call(session, "GET", url + "/health")
    assert ("POST", "/generate") in table and ("POST", "/v1/completions") in table and len(table) > 15
    refused = {route for route, (status, _, _) in answers.items() if status == 401}
    assert refused == set(table) - {("GET", "/health")}
    assert health == 200
    for status, body, headers in answers.values():
        if status == 401:
            assert isinstance(body, dict) and body["code"] == 401 and "Authorization" in body["message"]
            assert headers["WWW-Authenticate"] == "Bearer"


async def test_a_wrong_key_is_401_and_logged_without_the_key(model_dir: Path) -> None:
    body = {"input_ids": encode("1+2="), "sampling_params": {"max_new_tokens": 3}}
    async with served(model_dir, keys=ApiKeys(api_key=SecretStr(KEY))) as (_, url), aiohttp.ClientSession() as session:
        with structlog.testing.capture_logs() as logs:
            wrong, _, _ = await call(session, "POST", url + "/generate", "not-the-key-5521", body)
            lowercase_scheme, _, _ = await call(session, "POST", url + "/generate", None, body)
        right, answer, _ = await call(session, "POST", url + "/generate", KEY, body)
    assert wrong == 401 and lowercase_scheme == 401
    assert right == 200 and isinstance(answer, dict) and len(answer["output_ids"]) == 3
    attempts = [e for e in logs if e["event"] == "unauthorized request"]
    assert [e["reason"] for e in attempts] == ["wrong key", "no bearer key"]
    assert all(e["path"] == "/generate" and e["peer"] == "127.0.0.1" for e in attempts)
    assert "not-the-key-5521" not in repr(logs) and KEY not in repr(logs)


async def test_the_admin_key_alone_opens_the_weight_and_control_routes(model_dir: Path) -> None:
    keys = ApiKeys(api_key=SecretStr(KEY), admin_key=SecretStr(ADMIN))
    body = {"input_ids": encode("1+2="), "sampling_params": {"max_new_tokens": 2}}
    async with served(model_dir, keys=keys) as (_, url), aiohttp.ClientSession() as session:
        with_api_key = {p: (await call(session, "POST", url + p, KEY, {}))[0] for p in ("/pause_generation", "/abort_request")}
        paused, _, _ = await call(session, "POST", url + "/pause_generation", ADMIN, {"mode": "abort"})
        resumed, _, _ = await call(session, "POST", url + "/continue_generation", ADMIN, {})
        generated_api, _, _ = await call(session, "POST", url + "/generate", KEY, body)
        generated_admin, _, _ = await call(session, "POST", url + "/generate", ADMIN, body)
    assert with_api_key == {"/pause_generation": 401, "/abort_request": 401}
    assert paused == resumed == 200
    assert generated_api == generated_admin == 200


def test_a_non_loopback_bind_without_a_key_is_refused_naming_the_override() -> None:
    with pytest.raises(ValueError, match="--allow-unauthenticated"):
        check_bind("0.0.0.0", ApiKeys(), allow_unauthenticated=False)
    with pytest.raises(ValueError, match="--allow-unauthenticated"):
        check_bind("10.1.2.3", ApiKeys(admin_key=SecretStr(ADMIN)), allow_unauthenticated=False)  # generation still open
    check_bind("0.0.0.0", ApiKeys(api_key=SecretStr(KEY)), allow_unauthenticated=False)
    check_bind("0.0.0.0", ApiKeys(), allow_unauthenticated=True)
    check_bind("127.0.0.1", ApiKeys(), allow_unauthenticated=False)  # loopback without a key: as before
    assert is_loopback("::1") and is_loopback("localhost") and is_loopback("127.0.0.5")
    assert not is_loopback("0.0.0.0") and not is_loopback("node7.cluster")


def test_tandem_serve_refuses_the_bind_before_loading_anything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    missing = tmp_path / "no-model-here"  # refused before anything reads it
    assert run(parser.parse_args(["--model-path", str(missing), "--host", "0.0.0.0", "--port", "0"])) == 2
    assert "--allow-unauthenticated" in capsys.readouterr().err
    monkeypatch.setenv("TANDEM_API_KEY", " ")
    assert run(parser.parse_args(["--model-path", str(missing)])) == 2
    assert "--api-key (or $TANDEM_API_KEY) is empty" in capsys.readouterr().err


def test_config_points_at_the_key_and_never_holds_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="engines.servers.allow_unauthenticated"):
        RolloutServersConfig(host="0.0.0.0")
    RolloutServersConfig(host="0.0.0.0", allow_unauthenticated=True)
    RolloutServersConfig(host="0.0.0.0", urls=["http://node7:30000"])  # servers it does not start: theirs to guard
    secret = tmp_path / "admin.key"
    secret.write_text(ADMIN + "\n")
    monkeypatch.setenv("MY_ROLLOUT_KEY", KEY)
    config = RolloutServersConfig(host="0.0.0.0", api_key=SecretSource(env="MY_ROLLOUT_KEY"),
                                  admin_key=SecretSource(file=secret))
    keys = server_keys(config)
    assert keys.api_key is not None and keys.api_key.get_secret_value() == KEY
    assert keys.admin_key is not None and keys.admin_key.get_secret_value() == ADMIN
    dumped = config.model_dump_json()
    assert KEY not in dumped and ADMIN not in dumped and KEY not in repr(keys)
    monkeypatch.delenv("MY_ROLLOUT_KEY")
    with pytest.raises(ConfigError, match="engines.servers.api_key: the environment variable MY_ROLLOUT_KEY is unset"):
        server_keys(config)
    with pytest.raises(ValueError, match="exactly one of env"):
        SecretSource(env="A", file=secret)


def test_started_servers_get_the_key_in_their_environment_not_their_command_line(tmp_path: Path) -> None:
    keys = ApiKeys(api_key=SecretStr(KEY), admin_key=SecretStr(ADMIN))
    command = tandem_command("m", "0.0.0.0", 1, name="s", threads=1, max_batch_size=2, resume_policy="recompute",
                             dtype="float32", device="cpu", consume_bucket_mb=8, weight_dirs=[tmp_path / "w"])
    assert KEY not in " ".join(command) and ["--weight-dir", str(tmp_path / "w")] == command[-2:]
    assert tandem_key_env(keys) == {"TANDEM_API_KEY": KEY, "TANDEM_ADMIN_API_KEY": ADMIN}
    assert vllm_key_env(keys) == {"VLLM_API_KEY": KEY}  # vLLM's --api-key reads this variable
    sglang = sglang_command("m", "0.0.0.0", 1, dtype="bfloat16", api_key=keys.api_key)
    assert KEY in sglang and KEY not in redacted(sglang) and "--api-key ***" in redacted(sglang)


async def test_the_router_and_weight_sync_send_their_keys(model_dir: Path, v1_model_dir: Path, tmp_path: Path) -> None:
    keys = ApiKeys(api_key=SecretStr(KEY), admin_key=SecretStr(ADMIN))
    generation_only = ApiKeys(api_key=SecretStr(KEY))
    async with served(model_dir, keys=keys, limits=ServerLimits(weight_dirs=(tmp_path,))) as (server, url):
        engine = ServerRolloutEngine([url], decode=decode, live_updates=True, request_timeout_s=60, health_interval_s=30,
                                     wait_for_server_s=30, keys=keys)
        async with running(engine):
            trajectories = await collect(engine, requests(1, 2, 4))
            await engine.check()
            in_service = [ep.in_service for ep in engine.endpoints]
            await engine.pause_generation()  # an admin route
            await engine.continue_generation()
        syncer = ParamSyncer(trainer_source(v1_model_dir), DiskTransport(lambda: [url], tmp_path / "w", timeout_s=30, keys=keys))
        metrics = await syncer.sync(1)
        await syncer.aclose()
        refused, _ = await asyncio.to_thread(post_json, url, "/update_weights_from_disk",
                                             {"model_path": str(tmp_path / "w")}, 30, generation_only)
        async with aiohttp.ClientSession() as session:
            with pytest.raises(ServerError, match="HTTP 401"):
                await ServerClient(url, session, request_timeout_s=10).model_info()
    assert len(trajectories) == 2 and in_service == [True]
    assert metrics[f"loaded_version/{url}"] == 1 and server.engine.version == 1  # a failed load raises
    assert refused == 401  # the API key does not open the admin routes


async def test_the_vllm_client_sends_the_key_vllm_checks() -> None:
    seen: list[str | None] = []

    async def weight_info(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"weight_version": "3"})

    app = web.Application()
    app.router.add_get("/weight_info", weight_info)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession() as session:
            client = VllmServerClient(f"http://127.0.0.1:{port}", session, request_timeout_s=10,
                                      keys=ApiKeys(api_key=SecretStr(KEY)))
            info = await client.model_info()
    finally:
        await runner.cleanup()
    assert seen == [f"Bearer {KEY}"] and info.weight_version == "3"


def test_no_key_configured_leaves_loopback_servers_open() -> None:
    assert ApiKeys().for_route("/generate") == [] and ApiKeys().for_route("/update_weights_from_disk") == []
    admin_only = ApiKeys(admin_key=SecretStr(ADMIN))
    assert admin_only.for_route("/generate") == [] and admin_only.for_route("/pause_generation") == [admin_only.admin_key]
    assert ADMIN_ROUTES >= {"/update_weights_from_disk", "/init_weights_update_group", "/tandem/update_weights_from_shm"}
