"""The Ray actors that host the embedded torch engines, one engine per actor process.

Each actor builds its engine from the run's config with the same builders the in-process
backend uses (``engines.text.build``), so both backends compute identically; only the
process boundary differs. Methods are ``async``: an actor serves several calls at once (a
rollout actor streams many ``generate`` calls into one continuous batch), and the engines keep
their blocking compute on their own worker threads, never on the actor's event loop.

- :class:`RolloutActor`: a workload's rollout engine, built by the factory it is given (the text
  engine's ``engines.text.build.rollout_engine``, the image engine's
  ``engines.diffusion.build.image_rollout_engine``), plus the rollout end of weight sync
  (:class:`~param_sync.transports.object_store.ObjectStoreEndpoint`), whose methods run in the
  ``weights`` concurrency group: on an event loop and thread of their own, so a load never
  stalls the streaming of samples.
- :class:`TrainerActor`: the trained policy (built by its workload's factory: the text trainer's
  ``engines.text.build.trainer_with_export``, the image trainer's) and the trainer end of weight sync
  (``TorchWeightSync`` over an :class:`ObjectStoreTransport` to the rollout actors, or over a
  ``DistTransport`` broadcasting to them in a gloo group, where they serve it on a thread).
- :class:`TrainRankActor`: one rank of a trainer group (``engines.trainers.group``: FSDP2 or
  megatron-core), one per train slot; the flow drives the group from its own process, and rank 0
  sends the group's gathered weights to the rollout actors through the object store.
- :class:`ReferenceActor`: the frozen reference model; :class:`RewardActor`: the task's reward.

Trajectories cross as pickled records; an actor's changes to them stay on its side, and
everything the flow needs comes back as return values.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import ray

from tandem.core.config import TandemConfig
from tandem.core.protocols import LossObjective, Reward, RewardResult, SyncReport
from tandem.core.records import PromptGroup, Trajectory
from tandem.param_sync.bucket import BucketHeader, Manifest
from tandem.param_sync.receiver import LoadReport, Receiver
from tandem.param_sync.transports.object_store import (
    ObjectStoreEndpoint,
    ObjectStoreTransport,
    RemoteReceiver,
)

__all__ = [
    "ReferenceActor",
    "RewardActor",
    "RolloutActor",
    "RolloutEngineFactory",
    "TrainRankActor",
    "TrainerActor",
    "TrainerFactory",
    "init_gloo",
]

# Builds a rollout engine with a param_sync target from (config, threads), in the actor's process.
RolloutEngineFactory = Callable[[TandemConfig, int], Any]
# Builds the trained policy and its export (an async function of the folder) from (config, threads).
TrainerFactory = Callable[[TandemConfig, int], tuple[Any, Callable[[Path], Awaitable[None]]]]

_GLOO_TIMEOUT = datetime.timedelta(minutes=2)


# Weight-sync calls wait for their turn on the "weights" loop, so it must hold a whole
# transfer's calls at once: a bucket per call, far more than any model here has.
@ray.remote(concurrency_groups={"weights": 1024})
class RolloutActor:
    def __init__(self, config: TandemConfig, name: str, num_threads: int, make_engine: RolloutEngineFactory) -> None:
        _quiet()
        self.name = name
        self.engine = make_engine(config, num_threads)
        self.receiver = Receiver(self.engine.target, consume_bucket_mb=config.param_sync.consume_bucket_mb, engine=name)
        self.endpoint = ObjectStoreEndpoint(self.receiver)

    async def ready(self) -> tuple[int, int]:
        """(process id, loaded version): a new pid means the actor was restarted."""
        return os.getpid(), self.engine.version

    async def generate(self, requests: Sequence[Any]) -> AsyncIterator[Trajectory]:
        """The engine's own requests (``GenerationRequest`` for text, ``DenoiseRequest`` for images)."""
        async for trajectory in self.engine.generate(requests):
            yield trajectory

    async def join_dist(self, address: str, rank: int, world_size: int) -> None:
        """Join the trainer's gloo group as ``rank``; serve its broadcasts on a thread of its own."""
        from tandem.param_sync import serve_dist

        await asyncio.to_thread(init_gloo, address, rank, world_size)
        threading.Thread(target=serve_dist, args=(self.receiver,), name="dist-serve", daemon=True).start()

    @ray.method(concurrency_group="weights")
    async def begin(self, transfer: int, manifest: Manifest) -> None:
        await self.endpoint.begin(transfer, manifest)

    @ray.method(concurrency_group="weights")
    async def bucket(self, transfer: int, index: int, header: BucketHeader, chunk: np.ndarray) -> None:
        await self.endpoint.bucket(transfer, index, header, chunk)

    @ray.method(concurrency_group="weights")
    async def end(self, transfer: int, index: int) -> LoadReport:
        return await self.endpoint.end(transfer, index)

    @ray.method(concurrency_group="weights")
    async def abort(self, transfer: int, index: int, reason: str) -> LoadReport:
        return await self.endpoint.abort(transfer, index, reason)


@ray.remote
class TrainerActor:
    def __init__(self, config: TandemConfig, num_threads: int, make_trainer: TrainerFactory) -> None:
        _quiet()
        self.config = config
        self.engine, self._export = make_trainer(config, num_threads)
        self.weight_sync: Any = None

    async def ready(self) -> tuple[int, int]:
        return os.getpid(), self.engine.version

    async def connect(self, rollouts: list[tuple[str, Any]]) -> None:
        """Sync weights through the object store to these rollout actors, as (name, handle) pairs."""
        self._sync_over(ObjectStoreTransport([RemoteReceiver(name, handle) for name, handle in rollouts]))

    async def dist_address(self) -> str:
        """A rendezvous address on this actor's node for a gloo group it leads."""
        host = ray.util.get_node_ip_address()
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
        return f"tcp://{host}:{port}"

    async def connect_dist(self, address: str, world_size: int) -> None:
        """Lead a gloo group of ``world_size`` ranks (the rollout actors join it) and sync
        weights by broadcast; returns once every rank has joined."""
        from tandem.param_sync import DistTransport

        await asyncio.to_thread(init_gloo, address, 0, world_size)
        self._sync_over(DistTransport(src=0))

    def _sync_over(self, transport: Any) -> None:
        from tandem.engines.shared.weight_sync import TorchWeightSync, TrainerSyncSource
        from tandem.param_sync import ParamSyncer

        source = TrainerSyncSource(self.engine)
        syncer = ParamSyncer(source, transport, produce_bucket_mb=self.config.param_sync.produce_bucket_mb)
        self.weight_sync = TorchWeightSync(source, syncer)

    async def train_step(
        self, batch: Sequence[Trajectory], objective: LossObjective, mini_batches: Sequence[Sequence[int]] | None
    ) -> tuple[dict[str, float], int]:
        metrics = await self.engine.train_step(batch, objective, mini_batches)
        return metrics, self.engine.version

    async def logprobs(self, trajectories: Sequence[Trajectory]) -> list[list[float]]:
        return await self.engine.logprobs(trajectories)

    async def sync(self, version: int) -> SyncReport:
        return await self.weight_sync.sync(version)

    async def save_state(self, folder: str) -> None:
        await self.engine.save_state(Path(folder))

    async def load_state(self, folder: str) -> tuple[int, int]:
        await self.engine.load_state(Path(folder))
        return os.getpid(), self.engine.version

    async def save_checkpoint(self, folder: str) -> None:
        await self._export(Path(folder))


@ray.remote(concurrency_groups={"weights": 1})
class TrainRankActor:
    """One rank of a trainer group (``engines.trainers.group.RankServer``), computing on a worker
    thread of its own (one thread: a CUDA device and torch's thread budget are per thread). Rank 0
    also sends the group's staged weights to the rollout actors, in the ``weights`` group, while
    the ranks train on."""

    def __init__(self, config: TandemConfig, num_threads: int) -> None:
        from tandem.engines.shared.threads import budgeted_executor

        _quiet()
        self.config = config
        self.worker = budgeted_executor("train-rank", num_threads)
        self.server: Any = None
        self.weight_sync: Any = None

    async def ready(self) -> tuple[int, int]:
        return os.getpid(), self.server.version if self.server is not None else 0

    async def address(self) -> str:
        """A rendezvous address on this actor's node (rank 0's) for the group's process group."""
        from tandem.engines.trainers.group import free_address

        return free_address(ray.util.get_node_ip_address())

    async def start(self, spec: Any, rank: int, world_size: int, init_method: str) -> object:
        """Build the rank and join the group; ``Ready``, or ``Failed`` with the traceback."""
        from tandem.engines.trainers.group import start_rank

        def build() -> object:
            self.server, reply = start_rank(spec, rank=rank, world_size=world_size, init_method=init_method, local=False)
            return reply

        return await asyncio.wrap_future(self.worker.submit(build))

    async def handle(self, message: object) -> object:
        return await asyncio.wrap_future(self.worker.submit(self.server.handle, message))

    @ray.method(concurrency_group="weights")
    async def connect(self, rollouts: list[tuple[str, Any]]) -> None:
        """Rank 0: sync the staged weights through the object store to these rollout actors."""
        from tandem.engines.shared.weight_sync import TorchWeightSync, TrainerSyncSource
        from tandem.param_sync import ParamSyncer

        source = TrainerSyncSource(self.server)  # the staged weights, under the staging lock
        transport = ObjectStoreTransport([RemoteReceiver(name, handle) for name, handle in rollouts])
        syncer = ParamSyncer(source, transport, produce_bucket_mb=self.config.param_sync.produce_bucket_mb)
        self.weight_sync = TorchWeightSync(source, syncer)

    @ray.method(concurrency_group="weights")
    async def sync(self, version: int) -> SyncReport:
        return await self.weight_sync.sync(version)


def _quiet() -> None:
    """No per-load progress bars: they would reach the driver's console through Ray's log."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def init_gloo(address: str, rank: int, world_size: int) -> None:
    """Join a gloo group at ``address`` as ``rank`` (weight sync over torch.distributed)."""
    import torch.distributed as dist

    # A peer that died mid-broadcast fails the collective after this long, not gloo's 30 min.
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world_size, timeout=_GLOO_TIMEOUT)


@ray.remote
class ReferenceActor:
    def __init__(self, config: TandemConfig, num_threads: int) -> None:
        from tandem.engines.text.build import reference_engine

        _quiet()
        self.engine = reference_engine(config, num_threads)

    async def ready(self) -> tuple[int, int]:
        return os.getpid(), self.engine.version

    async def logprobs(self, trajectories: Sequence[Trajectory]) -> list[list[float]]:
        return await self.engine.logprobs(trajectories)

    async def save_state(self, folder: str) -> None:
        await self.engine.save_state(Path(folder))

    async def load_state(self, folder: str) -> None:
        await self.engine.load_state(Path(folder))


@ray.remote
class RewardActor:
    """Hosts the task's reward (built by the driver, pickled here before it started any worker)."""

    def __init__(self, reward: Reward) -> None:
        self.reward = reward

    async def ready(self) -> tuple[int, int]:
        return os.getpid(), 0

    async def score(self, trajectories: Sequence[Trajectory], groups: Sequence[PromptGroup]) -> list[RewardResult]:
        return await self.reward.score(trajectories, groups)
