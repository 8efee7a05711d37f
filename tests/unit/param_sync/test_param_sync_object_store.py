"""Ray object-store transport: buckets travel through the object store to rollout actors, and
the endpoint runs a transfer's calls in the order they were sent whatever order they arrive in."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterable
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from param_sync_models import Net, fill_random, raw_state

from tandem.param_sync import (
    LoadReport,
    ModuleSource,
    ModuleTarget,
    ParamSyncer,
    Receiver,
    TransferError,
)
from tandem.param_sync.bucket import BucketHeader, Manifest, plan_manifest
from tandem.param_sync.buffer import BufferHalf, host_half
from tandem.param_sync.transports.object_store import (
    ObjectStoreEndpoint,
    ObjectStoreTransport,
    RemoteReceiver,
)
from tests.conftest import wait_until_dead

# The actor below and the test models cross to Ray's workers by value: workers cannot import
# test modules by name.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(sys.modules[Net.__module__])


def endpoint_for(module: Net, name: str = "net") -> ObjectStoreEndpoint:
    return ObjectStoreEndpoint(Receiver(ModuleTarget(module, load_mode="pause"), consume_bucket_mb=1e-4, engine=name))


class BackwardsTransport:
    """Delivers each transfer's calls to an endpoint in reverse order (end first, begin last)."""

    def __init__(self, endpoint: ObjectStoreEndpoint) -> None:
        self.endpoint = endpoint
        self.buckets = 0

    def allocate(self, nbytes: int) -> BufferHalf:
        return host_half(nbytes)

    def send(self, manifest: Manifest, half: BufferHalf, buckets: Iterable[BucketHeader]) -> list[LoadReport]:
        chunks = [(h, half.array[h.offset : h.offset + h.nbytes].copy()) for h in buckets]
        self.buckets += len(chunks)

        async def deliver() -> LoadReport:
            ep = self.endpoint
            calls = [ep.begin(1, manifest), *(ep.bucket(1, i + 1, h, c) for i, (h, c) in enumerate(chunks))]
            calls.append(ep.end(1, len(chunks) + 1))
            tasks = [asyncio.ensure_future(call) for call in reversed(calls)]
            return (await asyncio.gather(*tasks))[0]

        return [asyncio.run(deliver())]

    def close(self) -> None:
        pass


def test_calls_delivered_backwards_still_load_the_exact_weights() -> None:
    trainer, rollout = Net(), Net()
    fill_random(trainer, 1)
    transport = BackwardsTransport(endpoint_for(rollout))
    syncer = ParamSyncer(ModuleSource(trainer), transport, produce_bucket_mb=256 / 2**20)

    metrics = asyncio.run(syncer.sync(1))

    assert transport.buckets > 3  # enough calls for the order to matter
    assert metrics["version"] == 1 and raw_state(rollout) == raw_state(trainer)


def test_a_call_of_an_older_transfer_is_refused_once_a_newer_one_began() -> None:
    module = Net()
    endpoint = endpoint_for(module)
    named = list(ModuleSource(module).named_tensors_for_sync())
    manifest = plan_manifest(
        [(n, t.dtype, tuple(t.shape), t.numel() * t.element_size()) for n, t in named], bucket_nbytes=256, version=2
    )

    async def scenario() -> None:
        await endpoint.begin(2, manifest)  # a restarted actor's first call may be any transfer's begin
        with pytest.raises(TransferError, match="transfer 1 came after transfer 2 began"):
            await endpoint.end(1, 5)

    asyncio.run(scenario())


@ray.remote
class NetActor:
    """A stand-in rollout actor: a Net behind an endpoint, as ``RolloutActor`` hosts its engine."""

    def __init__(self, name: str, seed: int) -> None:
        self.net = Net()
        fill_random(self.net, seed)
        self.endpoint = endpoint_for(self.net, name)

    async def begin(self, transfer: int, manifest: Manifest) -> None:
        await self.endpoint.begin(transfer, manifest)

    async def bucket(self, transfer: int, index: int, header: BucketHeader, chunk: Any) -> None:
        await self.endpoint.bucket(transfer, index, header, chunk)

    async def end(self, transfer: int, index: int) -> LoadReport:
        return await self.endpoint.end(transfer, index)

    async def abort(self, transfer: int, index: int, reason: str) -> LoadReport:
        return await self.endpoint.abort(transfer, index, reason)

    async def state(self) -> dict[str, bytes]:
        return raw_state(self.net)


def test_every_actor_loads_bit_identical_weights_and_a_dead_one_fails_the_sync_by_name(ray_cluster: Any) -> None:
    trainer = Net()
    actors = [NetActor.options(num_cpus=0).remote(f"net-{i}", seed) for i, seed in enumerate((2, 3))]
    receivers = [RemoteReceiver(f"net-{i}", a) for i, a in enumerate(actors)]
    syncer = ParamSyncer(ModuleSource(trainer), ObjectStoreTransport(receivers), produce_bucket_mb=256 / 2**20)
    try:
        for version in (1, 2):
            fill_random(trainer, 10 + version)
            metrics = asyncio.run(syncer.sync(version))
            assert metrics["loaded_version/net-0"] == metrics["loaded_version/net-1"] == version
            assert all(ray.get(a.state.remote()) == raw_state(trainer) for a in actors)

        ray.kill(actors[1])
        wait_until_dead(actors[1])
        fill_random(trainer, 13)
        with pytest.raises(TransferError, match="actor 'net-1' died"):
            asyncio.run(syncer.sync(3))
        assert ray.get(actors[0].state.remote()) == raw_state(trainer)  # the live one still loaded it
    finally:
        for actor in actors:
            ray.kill(actor)
