"""Shared by the param_sync tests: a small module with every dtype we sync, ways to fill it,
a fake decode loop, and a transport wrapper that spoils one transfer on purpose.

Importable by name (pytest puts this folder on ``sys.path``), so spawned worker processes can
find the functions defined here.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable, Iterator
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist
from torch import nn

from tandem.param_sync import (
    BucketHeader,
    BufferHalf,
    DistTransport,
    GatherError,
    LoadReport,
    Manifest,
    ModuleSource,
    ModuleTarget,
    ParamSyncer,
    Receiver,
    TransferError,
    Transport,
    serve_dist,
    serve_shm,
)
from tandem.param_sync.bucket import tensor_bytes


class Net(nn.Module):
    """fp32, bf16 and fp16 parameters, an embedding tied to the output head, int64, bool and
    0-dim fp64 buffers, and a non-persistent buffer that is not synced."""

    def __init__(self, *, tied: bool = True, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, width)
        self.proj = nn.Linear(width, width, dtype=torch.bfloat16)
        self.gate = nn.Parameter(torch.zeros(7, 3, dtype=torch.float16))
        self.head = nn.Linear(width, 50, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.register_buffer("steps", torch.zeros(5, dtype=torch.int64))
        self.register_buffer("mask", torch.zeros(9, dtype=torch.bool))
        self.register_buffer("scale", torch.tensor(0.0, dtype=torch.float64))
        self.register_buffer("cache", torch.zeros(4), persistent=False)


def unique_tensors(module: nn.Module) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for tensor in module.state_dict(keep_vars=True).values():
        seen.setdefault(id(tensor), tensor)
    return list(seen.values())


@torch.no_grad()
def fill_random(module: nn.Module, seed: int) -> None:
    """Random raw bits in every float and int weight (NaN payloads, subnormals and all), so a
    single cast anywhere on the way would show; bools get 0/1."""
    gen = torch.Generator().manual_seed(seed)
    for tensor in unique_tensors(module):
        if tensor.dtype == torch.bool:
            tensor.copy_(torch.randint(0, 2, tensor.shape, generator=gen).bool())
        else:
            raw = tensor.detach().reshape(-1).view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))


@torch.no_grad()
def fill_version(module: nn.Module, version: int) -> None:
    """Every element of every numeric weight equals ``version`` (exact in every dtype for small
    versions); bools are all True."""
    for tensor in unique_tensors(module):
        tensor.fill_(True if tensor.dtype == torch.bool else version)


def seen_versions(module: nn.Module) -> set[float]:
    """The distinct values of every numeric weight: one value iff one version is loaded."""
    values: set[float] = set()
    for tensor in unique_tensors(module):
        if tensor.dtype != torch.bool:
            values.update(tensor.detach().double().unique().tolist())
    return values


def raw_state(module: nn.Module) -> dict[str, bytes]:
    """Every synced name (tied aliases included) -> its raw bytes."""
    return {name: tensor_bytes(t).numpy().tobytes() for name, t in module.state_dict().items()}


class DecodeLoop:
    """A fake generator in a thread: each decode step reads every weight at its start and its
    end (``step_s`` apart) inside ``target.decode_step()``, and records how long it waited to
    enter and whether it saw more than one version."""

    def __init__(self, target: ModuleTarget, step_s: float) -> None:
        self.target = target
        self.step_s = step_s
        self.waits: list[float] = []
        self.mixed: list[set[float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-decode", daemon=True)

    def __enter__(self) -> DecodeLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            with self.target.decode_step():
                self.waits.append(time.perf_counter() - t0)
                first = seen_versions(self.target.module)
                time.sleep(self.step_s)
                seen = first | seen_versions(self.target.module)
            if len(seen) > 1:
                self.mixed.append(seen)


def spoil(buckets: Iterable[BucketHeader], half: BufferHalf, fault: str) -> Iterator[BucketHeader]:
    """The buckets of one transfer with ``fault`` applied (a transfer needs >= 2 buckets)."""
    headers = list(buckets)
    if fault == "drop_last":
        yield from headers[:-1]
    elif fault == "reorder":
        yield from [headers[1], headers[0], *headers[2:]]
    elif fault == "corrupt":
        middle = headers[len(headers) // 2]
        half.array[middle.offset] ^= 0xFF  # after its checksum was taken: a torn write
        yield from headers
    elif fault == "wrong_version":
        first = headers[0]
        yield BucketHeader(first.version - 1, *(getattr(first, f) for f in ("seq", "count", "offset", "nbytes", "checksum")))
        yield from headers[1:]
    elif fault == "killed":
        yield headers[0]
        raise ConnectionResetError("sender killed midway")
    else:
        raise ValueError(fault)


class FaultyTransport:
    """Wraps a transport; the next transfer after ``arm(fault)`` is spoiled, later ones are not."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self._fault: str | None = None

    def arm(self, fault: str) -> None:
        self._fault = fault

    def allocate(self, nbytes: int) -> BufferHalf:
        return self.inner.allocate(nbytes)

    def send(self, manifest: Manifest, half: BufferHalf, buckets: Iterable[BucketHeader]) -> list[LoadReport]:
        fault, self._fault = self._fault, None
        return self.inner.send(manifest, half, buckets if fault is None else spoil(buckets, half, fault))

    def close(self) -> None:
        self.inner.close()


class FlakySource:
    """A module's weights; after ``arm(after)`` the next walk dies after ``after`` tensors,
    like a trainer killed in the middle of a gather."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._after: int | None = None

    def arm(self, after: int) -> None:
        self._after = after

    def named_tensors_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        after, self._after = self._after, None
        for i, (name, tensor) in enumerate(ModuleSource(self.module).named_tensors_for_sync()):
            if after is not None and i == after:
                raise RuntimeError(f"trainer died while gathering tensor {i}")
            yield name, tensor


def shm_rollout_worker(conn: Connection, results: Connection, mode: str, seed: int) -> None:
    """A rollout process: serves shared-memory transfers into its own ``Net`` until closed,
    then reports the version it serves and its raw weights on ``results``."""
    torch.set_num_threads(1)
    module = Net()
    fill_random(module, seed)
    target = ModuleTarget(module, load_mode=mode)
    serve_shm(conn, Receiver(target, consume_bucket_mb=300 / 2**20, engine="shm-rollout"))
    results.send((target.loaded_version, raw_state(module)))


def dist_worker(rank: int, init_file: str, mode: str) -> None:
    """Rank 0 trains and syncs through a series of healthy and broken transfers; rank 1 serves
    them and checks at the end that it holds exactly the last good version."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        if rank == 0:
            asyncio.run(_dist_trainer(mode))
        else:
            module = Net()
            fill_random(module, 99)
            target = ModuleTarget(module, load_mode=mode)
            serve_dist(Receiver(target, consume_bucket_mb=300 / 2**20, engine="dist-rollout"))
            expected = Net()
            fill_random(expected, 5)
            assert target.loaded_version == 5, target.loaded_version
            assert raw_state(module) == raw_state(expected), "rank 1 does not hold version 5 bit for bit"
    finally:
        dist.destroy_process_group()


async def _dist_trainer(mode: str) -> None:
    trainer = Net()
    source = FlakySource(trainer)
    transport = FaultyTransport(DistTransport())
    syncer = ParamSyncer(source, transport, produce_bucket_mb=256 / 2**20)
    try:
        await _broken_then_good(syncer, trainer, source, transport)
        assert syncer.loaded_versions == {"dist-rollout": 5}, syncer.loaded_versions
    finally:
        await syncer.aclose()


async def _broken_then_good(syncer: ParamSyncer, trainer: Net, source: FlakySource, transport: FaultyTransport) -> None:
    """v1 good; v2 corrupt, v3 sender killed, v4 gather killed (each rejected whole, the engine
    still serving v1); v5 good."""
    fill_random(trainer, 1)
    await syncer.sync(1)
    for version, fault in ((2, "corrupt"), (3, "killed")):
        fill_random(trainer, version)
        transport.arm(fault)
        try:
            await syncer.sync(version)
        except TransferError:
            pass
        else:
            raise AssertionError(f"a {fault} transfer was accepted")
        assert set(syncer.loaded_versions.values()) == {1}, syncer.loaded_versions
    fill_random(trainer, 4)
    source.arm(after=2)
    try:
        await syncer.sync(4)
    except GatherError:
        pass
    else:
        raise AssertionError("a gather killed midway was accepted")
    fill_random(trainer, 5)
    await syncer.sync(5)
