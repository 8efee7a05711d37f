"""``tandem serve`` speaks sglang's native API: a real HTTP round trip of every endpoint an RL
trainer calls, each request and answer validated against the pydantic models of sglang's
schemas (``engines.server.schemas``, field names from sglang's io_struct.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from tiny_lm import encode

from tandem.engines.server.limits import ServerLimits
from tandem.engines.server.schemas import (
    AbortReq,
    GenerateReqInput,
    GenerateResponse,
    InitWeightsUpdateGroupReqInput,
    ModelInfo,
    PauseGenerationReqInput,
    SuccessResponse,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromTensorReqInput,
)
from tandem.engines.trainers.torch_train import TorchLogProbEngine
from tests.unit.engines.server.test_server_support import served

LONG = 400  # tokens: long enough to be caught running


async def post(session: aiohttp.ClientSession, url: str, path: str, body: Any, model: Any = None) -> tuple[int, Any]:
    """POST ``body`` (validated against ``model`` first, as a client written against sglang would send it)."""
    if model is not None:
        model.model_validate(body)
    async with session.post(url + path, json=body) as resp:
        text = await resp.text()
        return resp.status, json.loads(text) if text.startswith(("{", "[")) else text


async def get(session: aiohttp.ClientSession, url: str, path: str) -> tuple[int, str]:
    async with session.get(url + path) as resp:
        return resp.status, await resp.text()


async def wait_running(server: Any, rid: str, tokens: int = 3) -> None:
    """Until request ``rid`` is in the engine and has produced ``tokens`` tokens."""
    for _ in range(2000):
        running = server.running.get(rid)
        if running is not None and len(running.seq.versions) >= tokens:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"request {rid} never ran")


async def test_generate_with_input_ids_answers_in_sglangs_format(model_dir: Path) -> None:
    body = {"rid": "r1", "input_ids": encode("12+3="), "return_logprob": True,
            "sampling_params": {"max_new_tokens": 7, "temperature": 1.0, "sampling_seed": 5}}
    async with served(model_dir) as (_, url), aiohttp.ClientSession() as session:
        status, answer = await post(session, url, "/generate", body, GenerateReqInput)
        _, again = await post(session, url, "/generate", body, GenerateReqInput)
    assert status == 200
    out = GenerateResponse.model_validate(answer)
    meta = out.meta_info
    assert meta.id == "r1" and meta.prompt_tokens == 5 and meta.completion_tokens == len(out.output_ids) == 7
    assert meta.finish_reason is not None and meta.finish_reason.type == "length" and meta.finish_reason.length == 7
    assert [token for _, token, _ in meta.output_token_logprobs] == out.output_ids
    assert all(lp <= 0 for lp, _, _ in meta.output_token_logprobs)
    assert meta.weight_version == "0" and meta.output_token_versions == [0] * 7
    assert again["output_ids"] == out.output_ids  # sampling_seed makes a request reproducible


async def test_generate_batch_text_and_parallel_samples(model_dir: Path) -> None:
    body = {"text": ["1+2=", "34+5="], "sampling_params": {"max_new_tokens": 4, "n": 2}, "rid": "batch"}
    async with served(model_dir) as (_, url), aiohttp.ClientSession() as session:
        status, answers = await post(session, url, "/generate", body, GenerateReqInput)
    assert status == 200 and isinstance(answers, list) and len(answers) == 4
    outs = [GenerateResponse.model_validate(a) for a in answers]
    assert [o.meta_info.id for o in outs] == [f"batch_{i}" for i in range(4)]  # sglang's rid prefix expansion
    assert [o.meta_info.prompt_tokens for o in outs] == [4, 5, 4, 5]
    assert all("output_token_logprobs" not in a["meta_info"] for a in answers)  # not asked for


async def test_streaming_sends_the_output_so_far_then_done(model_dir: Path) -> None:
    body = {"input_ids": encode("6="), "stream": True, "sampling_params": {"max_new_tokens": 6}}
    events = []
    async with served(model_dir) as (_, url), aiohttp.ClientSession() as session:
        GenerateReqInput.model_validate(body)
        async with session.post(url + "/generate", json=body) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            async for raw in resp.content:
                if raw.startswith(b"data:"):
                    events.append(raw[5:].strip())
    assert events[-1] == b"[DONE]"
    outs = [GenerateResponse.model_validate_json(e) for e in events[:-1]]
    lengths = [len(o.output_ids) for o in outs]
    assert lengths == sorted(lengths) and lengths[-1] == 6  # each event is the whole output so far
    assert all(o.meta_info.finish_reason is None for o in outs[:-1]) and outs[-1].meta_info.finish_reason.type == "length"
    assert all(outs[-1].output_ids[: len(o.output_ids)] == o.output_ids for o in outs)


async def test_a_field_the_server_does_not_implement_is_refused_by_name(model_dir: Path) -> None:
    async with served(model_dir) as (_, url), aiohttp.ClientSession() as session:
        status, answer = await post(session, url, "/generate", {"input_ids": [3], "lora_path": "x"})
        bad_top_k, answer_k = await post(session, url, "/generate", {"input_ids": [3], "sampling_params": {"top_k": 0}})
    assert status == 400 and "lora_path" in answer["message"] and answer["code"] == 400
    assert bad_top_k == 400 and "top_k" in answer_k["message"]


async def test_abort_request_answers_with_the_partial_output(model_dir: Path) -> None:
    body = {"rid": "long", "input_ids": encode("1+1="), "return_logprob": True, "sampling_params": {"max_new_tokens": LONG}}
    async with served(model_dir) as (server, url), aiohttp.ClientSession() as session:
        pending = asyncio.ensure_future(post(session, url, "/generate", body))
        await wait_running(server, "long")
        status, _ = await post(session, url, "/abort_request", {"rid": "lo"}, AbortReq)  # a prefix, as sglang matches
        _, answer = await pending
    assert status == 200
    out = GenerateResponse.model_validate(answer)
    assert out.meta_info.finish_reason.type == "abort"
    assert 3 <= len(out.output_ids) < LONG
    assert len(out.meta_info.output_token_logprobs) == len(out.meta_info.output_token_versions) == len(out.output_ids)


async def test_pause_abort_mode_ends_requests_and_holds_new_ones_until_continue(model_dir: Path) -> None:
    body = {"rid": "a", "input_ids": encode("2+2="), "sampling_params": {"max_new_tokens": LONG}}
    async with served(model_dir) as (server, url), aiohttp.ClientSession() as session:
        running = asyncio.ensure_future(post(session, url, "/generate", body))
        await wait_running(server, "a")
        status, paused = await post(session, url, "/pause_generation", {"mode": "abort"}, PauseGenerationReqInput)
        _, aborted = await running
        short = {**body, "rid": "b", "sampling_params": {"max_new_tokens": 2}}
        held = asyncio.ensure_future(post(session, url, "/generate", short))
        await asyncio.sleep(0.3)
        assert not held.done()  # waits while paused
        await post(session, url, "/continue_generation", {})
        _, finished = await held
    assert status == 200 and paused["status"] == "ok"
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert finished["meta_info"]["finish_reason"]["type"] == "length"


async def test_pause_in_place_freezes_requests_with_their_cache(model_dir: Path) -> None:
    body = {"rid": "f", "input_ids": encode("3+3="), "sampling_params": {"max_new_tokens": 60}}
    async with served(model_dir) as (server, url), aiohttp.ClientSession() as session:
        running = asyncio.ensure_future(post(session, url, "/generate", body))
        await wait_running(server, "f")
        await post(session, url, "/pause_generation", {"mode": "in_place"}, PauseGenerationReqInput)
        frozen_at = len(server.running["f"].seq.versions)
        await asyncio.sleep(0.3)
        still = len(server.running["f"].seq.versions)
        await post(session, url, "/continue_generation", {})
        _, answer = await running
    assert still == frozen_at  # no decode step ran while paused in place
    assert answer["meta_info"]["finish_reason"]["type"] == "length" and len(answer["output_ids"]) == 60


async def test_update_weights_from_disk_serves_the_new_weights_from_then_on(model_dir: Path, v1_model_dir: Path) -> None:
    prompt = encode("45+6=")
    body = {"input_ids": prompt, "return_logprob": True, "sampling_params": {"max_new_tokens": 8, "sampling_seed": 1}}
    limits = ServerLimits(weight_dirs=(model_dir, v1_model_dir))
    async with served(model_dir, limits=limits) as (_, url), aiohttp.ClientSession() as session:
        update = {"model_path": str(v1_model_dir), "weight_version": "1"}
        status, answer = await post(session, url, "/update_weights_from_disk", update, UpdateWeightFromDiskReqInput)
        _, info = await get(session, url, "/get_model_info")
        _, out = await post(session, url, "/generate", body)
        bad, refused = await post(session, url, "/update_weights_from_disk",
                                  {"model_path": str(model_dir), "weight_version": "0"}, UpdateWeightFromDiskReqInput)
        _, info_after = await get(session, url, "/get_model_info")
    assert status == 200 and SuccessResponse.model_validate(answer).success
    assert ModelInfo.model_validate_json(info).weight_version == "1"
    gen = GenerateResponse.model_validate(out)
    assert gen.meta_info.output_token_versions == [1] * 8
    # The log-probs are the new weights' (the trainer's scoring of the same tokens agrees).
    from tandem.core.records import FinishReason, token_trajectory

    trajectory = token_trajectory(0, 0, prompt, gen.output_ids, [lp for lp, _, _ in gen.meta_info.output_token_logprobs],
                                  [1] * 8, FinishReason.LENGTH)
    async with TorchLogProbEngine(str(v1_model_dir)) as scorer:
        (expected,) = await scorer.logprobs([trajectory])
    assert max(abs(a - b) for a, b in zip(expected, trajectory.behaviour_logprobs)) < 1e-4
    # Going back a version is refused, and the newer weights keep serving.
    assert bad == 400 and not refused["success"] and "older" in refused["message"]
    assert json.loads(info_after)["weight_version"] == "1"


async def test_update_weights_from_tensor_is_answered_in_sglangs_format(model_dir: Path) -> None:
    body = {"serialized_named_tensors": ["e30="], "flush_cache": True}
    async with served(model_dir) as (_, url), aiohttp.ClientSession() as session:
        status, answer = await post(session, url, "/update_weights_from_tensor", body, UpdateWeightsFromTensorReqInput)
    assert status == 400
    reply = SuccessResponse.model_validate(answer)
    assert not reply.success and "update_weights_from_shm" in reply.message


async def test_init_weights_update_group_reports_a_failed_rendezvous(model_dir: Path) -> None:
    """Nobody hosts the rendezvous: the server says so in sglang's format (a successful group
    is formed in test_server_weights.py, by the dist transport)."""
    from tandem.engines.server.weights import free_port

    body = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
            "group_name": "g", "backend": "gloo"}
    limits = ServerLimits(connect_timeout_s=1.0)  # torch's store tries twice: the default 5 s cost 10
    async with served(model_dir, dist_timeout_s=1.0, limits=limits) as (_, url), aiohttp.ClientSession() as session:
        status, answer = await post(session, url, "/init_weights_update_group", body, InitWeightsUpdateGroupReqInput)
        dist_status, dist_answer = await post(session, url, "/update_weights_from_distributed",
                                              {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "g"})
    assert status == 400 and not SuccessResponse.model_validate(answer).success
    assert dist_status == 400 and "init_weights_update_group" in dist_answer["message"]


async def test_health_model_info_and_flush_cache(model_dir: Path) -> None:
    async with served(model_dir, name="s0") as (server, url), aiohttp.ClientSession() as session:
        health, _ = await get(session, url, "/health")
        health_generate, _ = await get(session, url, "/health_generate")
        status, info = await get(session, url, "/get_model_info")
        flushed, text = await post(session, url, "/flush_cache", None)
        server.engine.close()  # a dead engine: unhealthy
        dead, _ = await get(session, url, "/health")
    assert health == health_generate == status == flushed == 200
    model = ModelInfo.model_validate_json(info)
    assert model.model_path == str(model_dir) and model.is_generation and model.weight_version == "0"
    assert model.tandem is not None and model.tandem["live_weight_updates"] and model.tandem["name"] == "s0"
    assert text.startswith("Cache flushed")
    assert dead == 503


@pytest.mark.parametrize("bad", [{"text": "x", "input_ids": [1]}, {"input_ids": []}, {}])
def test_generate_request_needs_exactly_one_input(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        GenerateReqInput.model_validate(bad)
