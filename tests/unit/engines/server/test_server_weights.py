"""Weight sync from a trainer's dual buffer into ``tandem serve``: shared memory (mapped, not
copied), a torch.distributed group (gloo, sglang's update_weights_from_distributed), and disk
(safetensors, sglang's update_weights_from_disk); versions and checksums as in-process."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.engines.server.limits import ServerLimits
from tandem.engines.server.weights import DiskTransport, HttpDistTransport, HttpShmTransport
from tandem.param_sync import (
    BucketHeader,
    BufferHalf,
    LoadReport,
    Manifest,
    ModuleSource,
    ParamSyncer,
    TransferError,
    unique_weights,
)
from tests.unit.engines.server.test_server_support import launched, served


def trainer_source(model_dir: Path) -> ModuleSource:
    return ModuleSource(AutoModelForCausalLM.from_pretrained(model_dir))


def weights_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    wa, wb = unique_weights(a), unique_weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


class CorruptingShm(HttpShmTransport):
    """Sends bucket 0 with a wrong checksum: the server must refuse the whole transfer."""

    def send(self, manifest: Manifest, half: BufferHalf, buckets: Iterable[BucketHeader]) -> list[LoadReport]:
        def bad() -> Iterable[BucketHeader]:
            for h in buckets:
                wrong = (h.checksum + 1) % (1 << 64)
                yield BucketHeader(h.version, h.seq, h.count, h.offset, h.nbytes, wrong) if h.seq == 0 else h

        return super().send(manifest, half, bad())


async def test_shared_memory_sync_maps_the_trainers_buffer_without_a_copy(model_dir: Path, v1_model_dir: Path) -> None:
    source = trainer_source(v1_model_dir)
    async with served(model_dir) as (server, url):
        syncer = ParamSyncer(source, HttpShmTransport(lambda: [url], timeout_s=30), produce_bucket_mb=0.05)
        try:
            metrics = await syncer.sync(3)
            model = server.engine.model
            assert server.engine.version == 3 and metrics["loaded_version/tandem"] == 3
            assert metrics["buckets"] > 1  # streamed bucket by bucket
            assert weights_equal(model, source.module)
            # Every weight lies inside the shared-memory segment the server mapped: no copy of its own.
            (segment,) = [s for name, s in server.updates._segments.items() if name == syncer._buffer.active.segment]
            base = np.frombuffer(segment, np.uint8).ctypes.data
            for name, tensor in unique_weights(model).items():
                assert base <= tensor.data_ptr() < base + len(segment), name
            # ... and is the trainer's bytes themselves: a byte the trainer's half changes, the server sees.
            meta = syncer._manifest.tensors[0]
            half = syncer._buffer.active.array
            before = unique_weights(model)[meta.name].reshape(-1).view(torch.uint8)[0].item()
            half[meta.offset] = (int(half[meta.offset]) + 1) % 256
            assert unique_weights(model)[meta.name].reshape(-1).view(torch.uint8)[0].item() == (before + 1) % 256
        finally:
            await syncer.aclose()


async def test_a_corrupt_bucket_is_refused_and_the_old_weights_keep_serving(model_dir: Path, v1_model_dir: Path) -> None:
    source = trainer_source(v1_model_dir)
    original = AutoModelForCausalLM.from_pretrained(model_dir)
    async with served(model_dir) as (server, url):
        syncer = ParamSyncer(source, CorruptingShm(lambda: [url], timeout_s=30), produce_bucket_mb=0.05)
        try:
            with pytest.raises(TransferError, match="checksum"):
                await syncer.sync(1)
        finally:
            await syncer.aclose()
        assert server.engine.version == 0
        assert weights_equal(server.engine.model, original)


async def test_a_server_that_cannot_be_reached_gets_a_failed_report(model_dir: Path, v1_model_dir: Path) -> None:
    from tandem.engines.server.weights import free_port

    async with served(model_dir) as (server, url):
        gone = f"http://127.0.0.1:{free_port()}"
        syncer = ParamSyncer(trainer_source(v1_model_dir), HttpShmTransport(lambda: [url, gone], timeout_s=30))
        try:
            with pytest.raises(TransferError, match=gone):
                await syncer.sync(1)
        finally:
            await syncer.aclose()
        assert server.engine.version == 1  # the one that answered loaded it whole


@pytest.mark.slow
async def test_distributed_sync_broadcasts_into_servers_in_a_gloo_group(model_dir: Path, v1_model_dir: Path,
                                                                         tmp_path: Path) -> None:
    """Two ``tandem serve`` processes (a group's ranks must be processes of their own) join the
    trainer's group; each version is one broadcast per tensor, checked by the bucket checksums."""
    source = trainer_source(v1_model_dir)
    async with launched(model_dir, 2, tmp_path) as fleet:
        transport = HttpDistTransport(lambda: fleet.urls, master_address="127.0.0.1", backend="gloo", checksums=True,
                                      timeout_s=60)
        syncer = ParamSyncer(source, transport, produce_bucket_mb=0.05)
        try:
            metrics = await syncer.sync(2)
            with torch.no_grad():
                for tensor in unique_weights(source.module).values():
                    tensor.add_(1)  # the next version: the same group carries it, no new rendezvous
            group = transport._group
            await syncer.sync(3)
            assert transport._group is group
            scores = [await logprob_of(url, source.module) for url in fleet.urls]
        finally:
            await syncer.aclose()
    assert [metrics[f"loaded_version/{url}"] for url in fleet.urls] == [2, 2]  # one report per server
    assert all(s < 1e-4 for s in scores), scores


async def logprob_of(url: str, module: torch.nn.Module) -> float:
    """Largest gap between a server's log-probs of a generated sequence and ``module``'s own."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        body = {"input_ids": [3, 4, 5], "return_logprob": True, "sampling_params": {"max_new_tokens": 6, "sampling_seed": 0}}
        async with session.post(url + "/generate", json=body) as resp:
            answer = await resp.json()
    tokens = answer["meta_info"]["output_token_logprobs"]
    assert answer["meta_info"]["weight_version"] == "3"
    ids = torch.tensor([[3, 4, 5, *[t for _, t, _ in tokens]]])
    with torch.no_grad():
        logits = module(ids).logits[0, 2:-1].float()
    expected = torch.log_softmax(logits, -1).gather(1, ids[0, 3:, None]).squeeze(1)
    return float((expected - torch.tensor([lp for lp, _, _ in tokens])).abs().max())


async def test_disk_sync_writes_a_checked_safetensors_checkpoint(model_dir: Path, v1_model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    source = trainer_source(v1_model_dir)
    async with served(model_dir, limits=ServerLimits(weight_dirs=(tmp_path,))) as (server, url):
        syncer = ParamSyncer(source, DiskTransport(lambda: [url], tmp_path / "w", timeout_s=30), produce_bucket_mb=0.05)
        try:
            await syncer.sync(4)
            await syncer.sync(5)
            await syncer.sync(6)
        finally:
            await syncer.aclose()
        assert server.engine.version == 6 and weights_equal(server.engine.model, source.module)
    # The file is a plain safetensors checkpoint (loadable by anything); only the newest two are kept.
    # (aclose removed the folder; a fresh sync shows the layout.)
    folder = tmp_path / "w2"
    async with served(model_dir, limits=ServerLimits(weight_dirs=(tmp_path,))) as (server, url):
        syncer = ParamSyncer(source, DiskTransport(lambda: [url], folder, timeout_s=30))
        await syncer.sync(1)
        await syncer.sync(2)
        await syncer.sync(3)
        kept = sorted(p.name for p in folder.iterdir())
        tensors = load_file(folder / "v00000003" / "model.safetensors")
        await syncer.aclose()
    assert kept == ["v00000002", "v00000003"]
    assert all(torch.equal(tensors[k], v) for k, v in unique_weights(source.module).items())


async def test_a_corrupted_checkpoint_is_refused(model_dir: Path, v1_model_dir: Path, tmp_path: Path) -> None:
    """A file whose bytes no longer match the trainer's checksums (torn, or rewritten) never loads."""
    import json

    from tandem.engines.server.receive import CHECKSUMS_KEY, LAYOUT_KEY
    from tandem.engines.server.schemas import manifest_to_json
    from tandem.engines.server.weights import post_json, write_safetensors

    source = trainer_source(v1_model_dir)
    async with served(model_dir, limits=ServerLimits(weight_dirs=(tmp_path,))) as (server, url):
        syncer = ParamSyncer(source, DiskTransport(lambda: [url], tmp_path / "w", timeout_s=30))
        await syncer.sync(1)
        manifest, half = syncer._manifest, syncer._buffer.active
        path = tmp_path / "torn"
        path.mkdir()
        sums = [1] * manifest.bucket_count  # checksums of other bytes
        layout = {LAYOUT_KEY: json.dumps(manifest_to_json(manifest)), CHECKSUMS_KEY: json.dumps(sums)}
        write_safetensors(path / "model.safetensors", manifest, half.array, layout)
        status, body = await asyncio.to_thread(post_json, url, "/update_weights_from_disk",
                                               {"model_path": str(path), "weight_version": "2"}, 30)
        await syncer.aclose()
        assert status == 400 and "checksum" in body["message"]
        assert server.engine.version == 1
