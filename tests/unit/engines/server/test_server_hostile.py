"""What an attacker who reaches ``tandem serve`` can send: each hostile or malformed request gets
the 4xx it deserves with a message naming what is wrong, never a 500; the server keeps serving;
a burst beyond its caps gets 429 with ``Retry-After`` (the router waits and retries) while its
memory stays bounded."""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from tiny_lm import encode

from tandem.engines.server.limits import ServerLimits
from tandem.engines.server.weights import free_port
from tests.unit.engines.server.test_server_router import collect, requests, router
from tests.unit.engines.server.test_server_support import served

MAX_BODY = 64 << 10
PROMPT = encode("12+3=")


def gen(**sampling: Any) -> dict[str, Any]:
    return {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, **sampling}}


def raw(text: str) -> bytes:
    return text.encode()


# (name, path, body: JSON-able or raw bytes, expected status, what the message must name)
CASES: list[tuple[str, str, Any, int, str]] = [
    ("deeply nested JSON", "/generate", raw("[" * 60_000), 400, "nested"),  # under the body cap
    ("not JSON", "/generate", raw('{"input_ids": [1,'), 400, "body"),
    ("not UTF-8", "/generate", b"\xff\xfe\x00{", 400, "body"),
    ("oversized body", "/generate", raw(json.dumps({"text": "1" * (2 * MAX_BODY)})), 413, "body"),
    ("wrong type", "/generate", {"input_ids": "12+3="}, 400, "input_ids"),
    ("no prompt", "/generate", {"sampling_params": {}}, 400, "input_ids"),
    ("empty text batch", "/generate", {"text": []}, 400, "text"),
    ("empty prompt", "/generate", {"input_ids": [[]]}, 400, "input_ids"),
    ("NaN temperature", "/generate", raw('{"input_ids": [3, 4], "sampling_params": {"temperature": NaN}}'), 400, "temperature"),
    ("infinite top_p", "/generate", raw('{"input_ids": [3, 4], "sampling_params": {"top_p": Infinity}}'), 400, "top_p"),
    ("negative temperature", "/generate", gen(temperature=-1), 400, "temperature"),
    ("negative length", "/generate", gen(max_new_tokens=-5), 400, "max_new_tokens"),
    ("huge length", "/generate", gen(max_new_tokens=10**12), 400, "max_new_tokens"),
    ("huge n", "/generate", gen(n=10**9), 400, "n"),
    ("huge top_k", "/generate", gen(top_k=10**12), 400, "top_k"),
    ("negative seed", "/generate", gen(sampling_seed=-1), 400, "sampling_seed"),
    ("huge seed", "/generate", gen(sampling_seed=1 << 70), 400, "sampling_seed"),
    ("out-of-vocabulary id", "/generate", {"input_ids": [3, 10**9]}, 400, "input_ids"),
    ("negative id", "/generate", {"input_ids": [-1]}, 400, "input_ids"),
    ("unknown field", "/generate", {"input_ids": PROMPT, "lora_path": "/etc"}, 400, "lora_path"),
    ("batch streamed", "/generate", {"input_ids": [PROMPT, PROMPT], "stream": True}, 400, "stream"),
    ("top log-probs beyond the cap", "/v1/completions", {"prompt": "1+2=", "logprobs": 100_000}, 400, "logprobs"),
    ("chat top_logprobs beyond the cap", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "1+2="}], "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("OpenAI NaN temperature", "/v1/completions", raw('{"prompt": "1+2=", "temperature": NaN}'), 400, "temperature"),
    ("OpenAI negative max_tokens", "/v1/completions", {"prompt": "1+2=", "max_tokens": -1}, 400, "max_tokens"),
    ("OpenAI out-of-vocabulary prompt", "/v1/completions", {"prompt": [3, 10**9]}, 400, "prompt"),
    ("OpenAI no messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("abort with a wrong type", "/abort_request", {"rid": 5}, 400, "rid"),
    ("unknown pause mode", "/pause_generation", {"mode": "bogus"}, 400, "mode"),
    ("misaligned weight names", "/update_weights_from_distributed", {"names": ["a"], "dtypes": [], "shapes": []}, 400, "names"),
    ("path traversal", "/update_weights_from_disk", "MODEL/../../../../etc", 403, "model_path"),
    ("a folder not allowed", "/update_weights_from_disk", {"model_path": "/etc/passwd"}, 403, "model_path"),
    ("a group at a foreign address", "/init_weights_update_group",
     {"master_address": "10.255.255.1", "master_port": 29500, "rank_offset": 1, "world_size": 2, "backend": "gloo"},
     403, "master_address"),
    ("a group where nothing listens", "/init_weights_update_group", "UNREACHABLE", 400, "master_address"),
    ("shm message not JSON", "/tandem/update_weights_from_shm", raw("hello\n"), 400, "bad transfer message"),
    ("shm begin without its segment", "/tandem/update_weights_from_shm", raw('{"type": "begin"}\n'), 400, "segment"),
    ("shm segment outside /dev/shm", "/tandem/update_weights_from_shm",
     raw('{"type": "begin", "segment": "../../etc/passwd", "manifest": {}}\n'), 400, "segment"),
]


def rss() -> int:
    """This process's resident memory in bytes (the server runs in it)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def concrete(body: Any, model_dir: Path) -> Any:
    if body == "MODEL/../../../../etc":
        return {"model_path": f"{model_dir}/../../../../etc"}
    if body == "UNREACHABLE":
        return {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
                "backend": "gloo"}
    return body


async def test_hostile_requests_get_a_4xx_naming_the_field_and_the_server_keeps_serving(model_dir: Path) -> None:
    limits = ServerLimits(max_body_bytes=MAX_BODY, connect_timeout_s=1.0)
    failures = []
    async with served(model_dir, limits=limits) as (_, url), aiohttp.ClientSession() as session:
        for name, path, body, expected, names in CASES:
            body = concrete(body, model_dir)
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            started = time.monotonic()
            async with session.post(url + path, data=data, headers={"Content-Type": "application/json"}) as resp:
                status, text = resp.status, await resp.text()
            elapsed = time.monotonic() - started
            try:
                answer = json.loads(text)
                message = str(answer.get("message") or answer.get("error"))
            except ValueError:
                message = text
            if status != expected or names not in message or elapsed > 8:
                failures.append(f"{name}: HTTP {status} in {elapsed:.1f} s: {message[:300]}")
        async with session.post(url + "/generate", json=gen(sampling_seed=1)) as resp:
            good_status, good = resp.status, await resp.json()
        async with session.post(url + "/v1/completions", json={"prompt": "1+2=", "max_tokens": 3, "logprobs": 20}) as resp:
            openai_status = resp.status
    assert failures == []
    assert good_status == 200 and len(good["output_ids"]) == 4
    assert openai_status == 200  # the cap itself is allowed


async def test_a_burst_beyond_the_caps_gets_429_with_retry_after_and_memory_stays_bounded(model_dir: Path) -> None:
    limits = ServerLimits(max_running_requests=8, max_queued_tokens=8 * 300)
    async with served(model_dir, limits=limits) as (server, url), aiohttp.ClientSession() as session:
        async def one(i: int) -> tuple[int, str | None]:
            async with session.post(url + "/generate", json=gen(max_new_tokens=200, sampling_seed=i)) as resp:
                await resp.read()
                return resp.status, resp.headers.get("Retry-After")

        await asyncio.gather(*(one(i) for i in range(8)))  # warm: the allocator's steady state
        before = rss()
        answers = await asyncio.gather(*(one(i) for i in range(400)))
        after = rss()
        held = (server.admission.requests, server.admission.tokens)
        async with session.post(url + "/generate", json=gen(max_new_tokens=5000)) as resp:
            too_big, message = resp.status, (await resp.json())["message"]
    statuses = [s for s, _ in answers]
    assert set(statuses) == {200, 429} and statuses.count(200) >= 8
    assert all(after_s == "1" for s, after_s in answers if s == 429)
    assert held == (0, 0)  # every admitted request released its share
    assert after - before < 64 << 20, f"RSS grew {(after - before) / 2**20:.1f} MiB over a burst of 400"
    assert too_big == 400 and "max_new_tokens" in message  # could never fit: not a 429


async def test_the_router_waits_out_a_429_instead_of_taking_the_server_out(model_dir: Path) -> None:
    async with served(model_dir, limits=ServerLimits(max_running_requests=2)) as (server, url):
        busy = []
        server.on_generated.append(lambda *_: busy.append(server.admission.requests))
        engine = router([url])
        async with asyncio.timeout(120):
            await engine.start()
            try:
                trajectories = await collect(engine, requests(3, 2, 6))
                in_service = [ep.in_service for ep in engine.endpoints]
            finally:
                engine.close()
    assert len(trajectories) == 6 and all(t.num_actions == 6 for t in trajectories)
    assert in_service == [True] and max(busy) <= 2


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_numbers_are_refused_by_the_schema(value: float) -> None:
    from tandem.engines.server.schemas import SamplingParams

    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=value)
