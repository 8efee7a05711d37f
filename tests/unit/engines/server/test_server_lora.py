"""A LoRA adapter on ``tandem serve``: adapter-only syncs through the weight-update path, each proven
by the probe over HTTP, and sglang's ``/load_lora_adapter`` and ``/unload_lora_adapter``.

Specification: a sync moves the adapter's bytes and nothing else; afterwards the server scores
like the trainer (fp32, below 1e-4) and its base is untouched; a sync the server acknowledges
without applying is caught by the probe at that sync, saying the adapter did not land; the
adapter routes take sglang's bodies and answers, and bad input gets a 4xx naming the field.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tandem.core.config import LoraConfig
from tandem.engines.server.app import RolloutServer
from tandem.engines.server.limits import ServerLimits
from tandem.engines.server.lora import ServerProbe
from tandem.engines.server.weights import HttpShmTransport
from tandem.engines.shared.lora import adapter_tensors, lora_settings, save_adapter, with_adapter
from tandem.engines.shared.probe import ProbedTransport, ProbedWeightSync, probe_gap
from tandem.engines.shared.weight_sync import TorchWeightSync
from tandem.engines.trainers.torch_train import TorchTrainEngine
from tandem.param_sync import BucketHeader, BufferHalf, LoadReport, Manifest, TransferError, unique_weights
from tests.unit.engines.server.test_server_support import served
from tests.unit.engines.shared.test_torch_sync import collect, differing, groups, raw, requests
from tests.unit.engines.trainers.test_torch_train import pg_loss

pytest.importorskip("peft", reason="LoRA needs the lora extra (peft)")


class AcknowledgingShm(HttpShmTransport):
    """From version ``drop_from`` on, answers every transfer as loaded without sending it: the
    server keeps its old adapter while the report says otherwise (the bug the probe is for)."""

    def __init__(self, *args: Any, drop_from: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.drop_from = drop_from

    def send(self, manifest: Manifest, half: BufferHalf, buckets: Iterable[BucketHeader]) -> list[LoadReport]:
        if manifest.version < self.drop_from:
            return super().send(manifest, half, buckets)
        list(buckets)  # the gather runs to its end, as a real transfer's would
        return [LoadReport("tandem", manifest.version, ok=True)]


@contextlib.asynccontextmanager
async def lora_pair(model_dir: Path, drop_from: int | None = None, **server_options: Any) -> AsyncIterator[Any]:
    """A LoRA trainer, a ``tandem serve`` holding the same adapter, and the probed sync between them."""
    settings = lora_settings(LoraConfig(rank=4), model_dir)
    trainer = TorchTrainEngine(str(model_dir), lr=1e-2, lora=settings, probe=True)
    try:
        async with served(model_dir, lora=settings, **server_options) as (server, url):
            inner = (HttpShmTransport(lambda: [url], timeout_s=30) if drop_from is None
                     else AcknowledgingShm(lambda: [url], timeout_s=30, drop_from=drop_from))
            assert trainer.probe is not None
            probed = ProbedTransport(inner, trainer.probe, ServerProbe(lambda: [url], timeout_s=30), max_gap=1e-4,
                                     what="the adapter")
            sync = ProbedWeightSync(TorchWeightSync.through(trainer, probed, produce_bucket_mb=0.01), probed)
            try:
                yield trainer, server, url, sync
            finally:
                sync.close()
    finally:
        trainer.close()


async def test_a_sync_moves_the_adapters_bytes_and_the_server_then_scores_like_the_trainer(model_dir: Path) -> None:
    async with lora_pair(model_dir) as (trainer, server, _, sync):
        served_model = server.engine.model
        base = {n: b for n, b in raw(unique_weights(served_model.get_base_model()).items()).items() if ".lora_" not in n}
        adapter_bytes = sum(t.numel() * t.element_size() for _, t in trainer.named_tensors_for_sync())
        model_bytes = sum(t.numel() * t.element_size() for t in unique_weights(served_model.get_base_model()).values())
        for version in (1, 2):
            await trainer.train_step(groups(version), pg_loss)
            report = await sync.sync(version)
            assert report.version == server.engine.version == version
            assert report.metrics["bytes"] == adapter_bytes < model_bytes / 10
            assert report.metrics["logprob_gap"] < 1e-4
            assert differing(raw(adapter_tensors(served_model).items()), raw(trainer.named_tensors_for_sync())) == []
        samples = await collect(server.engine.generate(requests(4, 12)))
        scored = await trainer.logprobs(samples)
        assert all(s.versions == [2] * 12 for s in samples)
        assert max(abs(b - t) for s, lp in zip(samples, scored) for b, t in zip(s.behaviour_logprobs, lp)) < 1e-4
        after = raw(unique_weights(served_model.get_base_model()).items())
        assert differing({n: after[n] for n in base}, base) == []  # the base is never written


async def test_a_sync_the_server_acknowledges_but_does_not_apply_is_caught_by_the_probe_at_that_sync(
    model_dir: Path,
) -> None:
    async with lora_pair(model_dir, drop_from=2) as (trainer, server, _, sync):
        await trainer.train_step(groups(1), pg_loss)
        assert (await sync.sync(1)).metrics["logprob_gap"] < 1e-4
        await trainer.train_step(groups(2), pg_loss)
        with pytest.raises(TransferError, match=r"version 2 .* by up to .* nats \(bound 0.0001\): the adapter did not land"):
            await sync.sync(2)
        assert server.engine.version == 1


async def post(url: str, path: str, body: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.post(url + path, json=body) as resp:
        return resp.status, await resp.json(content_type=None)


async def probe(url: str, server: RolloutServer, trainer: TorchTrainEngine) -> list[float]:
    assert trainer.probe is not None
    status, body = await post(url, "/tandem/probe_logprobs", {"input_ids": trainer.probe.inputs})
    assert status == 200 and body["name"] == server.name
    return body["logprobs"]


async def test_load_and_unload_lora_adapter_take_sglangs_bodies_and_answers(model_dir: Path, tmp_path: Path) -> None:
    async with lora_pair(model_dir, limits=ServerLimits(weight_dirs=(tmp_path,))) as (trainer, server, url, _):
        base = await probe(url, server, trainer)
        await trainer.train_step(groups(1), pg_loss)
        folder = tmp_path / "step1"
        save_adapter(trainer.model, trainer.state_dict()["model"], folder)
        assert trainer.probe is not None
        trained = trainer.probe.expected(1)

        status, body = await post(url, "/load_lora_adapter", {"lora_name": "step1", "lora_path": str(folder)})
        assert (status, body) == (200, {"success": True, "error_message": None, "loaded_adapters": {"step1": str(folder)}})
        assert probe_gap(await probe(url, server, trainer), trained) < 1e-4

        generate = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
        assert (await post(url, "/generate", {**generate, "lora_path": "step1"}))[0] == 200  # as sglang's clients name it
        status, body = await post(url, "/generate", {**generate, "lora_path": "other"})
        assert status == 400 and "lora_path: no adapter named 'other' is loaded (loaded: ['step1'])" in str(body)

        status, body = await post(url, "/unload_lora_adapter", {"lora_name": "step1"})
        assert (status, body) == (200, {"success": True, "error_message": None, "loaded_adapters": {}})
        assert probe_gap(await probe(url, server, trainer), base) < 1e-6  # the base serves again


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("/load_lora_adapter", {"lora_path": "x"}, 400, r"lora_name"),
        ("/load_lora_adapter", {"lora_name": "a", "lora_path": "/etc"}, 403, r"lora_path: '/etc' is outside"),
        ("/load_lora_adapter", {"lora_name": "a", "lora_path": "{tmp}/rank8"}, 400, r"lora_path: .* r=8 \(this server: 4\)"),
        ("/load_lora_adapter", {"lora_name": "a", "lora_path": "{tmp}/empty"}, 400, r"lora_path: no readable adapter_config"),
        ("/unload_lora_adapter", {"lora_name": "never"}, 400, r"lora_name: no adapter named 'never' is loaded"),
        ("/unload_lora_adapter", {"lora_name": "a", "extra": 1}, 400, r"extra"),
    ],
)
async def test_bad_adapter_requests_get_a_4xx_naming_the_field(
    model_dir: Path, tmp_path: Path, path: str, body: dict[str, Any], status: int, message: str
) -> None:
    from transformers import AutoModelForCausalLM

    (tmp_path / "empty").mkdir()
    other = with_adapter(AutoModelForCausalLM.from_pretrained(model_dir), lora_settings(LoraConfig(rank=8), model_dir))
    other.save_pretrained(tmp_path / "rank8", save_embedding_layers=False)
    body = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in body.items()}
    async with served(model_dir, lora=lora_settings(LoraConfig(rank=4), model_dir),
                      limits=ServerLimits(weight_dirs=(tmp_path,))) as (server, url):
        got, answer = await post(url, path, body)
        assert got == status
        text = answer.get("error_message") or answer.get("message") or str(answer)
        assert re.search(message, text), text
        assert server.adapter is not None and server.adapter.loaded == {}


async def test_a_server_without_an_adapter_refuses_the_adapter_routes_naming_the_option(model_dir: Path) -> None:
    async with served(model_dir) as (_, url):
        status, body = await post(url, "/load_lora_adapter", {"lora_name": "a", "lora_path": str(model_dir)})
        assert status == 400 and body["success"] is False and "--lora-rank" in body["error_message"]


async def test_a_second_adapter_is_refused_until_the_first_is_unloaded(model_dir: Path, tmp_path: Path) -> None:
    async with lora_pair(model_dir, limits=ServerLimits(weight_dirs=(tmp_path,))) as (trainer, _, url, _):
        save_adapter(trainer.model, trainer.state_dict()["model"], tmp_path / "a")
        assert (await post(url, "/load_lora_adapter", {"lora_name": "a", "lora_path": str(tmp_path / "a")}))[0] == 200
        status, body = await post(url, "/load_lora_adapter", {"lora_name": "b", "lora_path": str(tmp_path / "a")})
        assert status == 400 and "lora_name: this server holds one adapter and 'a' is loaded" in body["error_message"]
        assert body["loaded_adapters"] == {"a": str(tmp_path / "a")}
