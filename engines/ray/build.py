"""The Ray backend: the torch engines as Ray actors, behind the same protocol handles the flow
drives in-process.

What it owns: the connection to the cluster (it starts a local one when ``cluster.address`` is
None and none is running, and stops what it started), one placement group realising the
:class:`~core.resources.ResourcePlan` (a bundle per used device slot), the actors, and thin
async proxies (:class:`RayRolloutEngine`, :class:`RayTrainEngine`, :class:`RayLogProbEngine`,
:class:`RayReward`, :class:`RayWeightSync`). The state machines stay in the driver's event loop
and ``await`` the actors' ObjectRefs there: no blocking ``ray.get``, no polling.

Actor failure:
- any call on a dead actor raises :class:`ActorFailedError`, naming the role and the actor;
- rollout (and reward) actors are restarted by Ray up to ``cluster.max_actor_restarts`` times.
  A rollout call that lost its actor first waits for the restart, has the trainer load its
  current weights into every rollout actor (the new one starts at the model file's weights, and
  serving older weights than the flow's loaded version would break the staleness bound), then
  raises; the generate role's retry (``roles.generate.max_retries``) asks again for exactly the
  samples not yet delivered, so a lost sample is redone and a delivered one never twice. Past
  Ray's restart bound the actor stays dead and the error reaches the role's policy, which stops
  the flow naming ``generate`` and the actor;
- a weight sync that failed because a rollout actor died waits for the restart the same way
  before raising, so the param_update role's retry finds every actor alive;
- the trainer and the reference actor are never restarted (their state would be lost).
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import ray
import structlog
from ray.exceptions import RayActorError
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tandem.core.components import Components, TaskSetup
from tandem.core.config import ConfigError, TandemConfig, TorchEnginesConfig
from tandem.core.protocols import GenerationRequest, LossObjective, RewardResult, SyncReport
from tandem.core.records import PromptGroup, Trajectory
from tandem.core.resources import ActorPlacement, ResourcePlan, plan_resources
from tandem.engines.ray.actors import ReferenceActor, RewardActor, RolloutActor, TrainerActor, TrainRankActor

if TYPE_CHECKING:
    from tandem.engines.trainers.group import TrainerGroup

__all__ = [
    "ActorFailedError",
    "RayLogProbEngine",
    "RayReward",
    "RayRolloutEngine",
    "RayTrainEngine",
    "RayWeightSync",
    "build_ray_components",
]

log = structlog.get_logger("tandem.ray")
_T = TypeVar("_T")


class ActorFailedError(RuntimeError):
    """A call failed because its actor died; names the role and the actor."""

    def __init__(self, role: str, actor: str, cause: BaseException) -> None:
        super().__init__(f"{role} actor {actor!r} failed: {type(cause).__name__}: {str(cause).splitlines()[0]}")
        self.role = role
        self.actor = actor


@dataclass(slots=True, eq=False)
class ActorRef:
    """An actor the backend started: its role, name, handle, whether Ray restarts it, and
    (rollout) its load: requests handed to it and not yet delivered, and in all."""

    role: str
    name: str
    handle: Any  # ray.actor.ActorHandle
    restartable: bool = False
    in_flight: int = 0
    requests: int = 0  # rollout: requests handed to it over the run (retries included)

    async def call(self, ref: Awaitable[_T]) -> _T:
        """Await one of this actor's results; if the actor died, wait until Ray restarted it
        (when it may) and raise :class:`ActorFailedError`, for the role's policy to retry."""
        try:
            return await ref
        except RayActorError as exc:
            await self.back()
            raise ActorFailedError(self.role, self.name, exc) from exc

    async def back(self) -> int:
        """The loaded version once the actor answers again (Ray retries the call across a
        restart); :class:`ActorFailedError` if it is dead for good or never restarts."""
        ready = self.handle.ready.options(max_task_retries=-1) if self.restartable else self.handle.ready
        try:
            _, version = await ready.remote()
        except RayActorError as exc:
            raise ActorFailedError(self.role, self.name, exc) from exc
        return version


class RayRolloutEngine:
    """``RolloutEngine`` over one or more rollout actors; a call's prompt groups are split
    between them (each group to the actor with the fewest requests in flight) and their
    streams merged as samples finish."""

    def __init__(self, actors: list[ActorRef]) -> None:
        self.actors = actors
        self._version = 0
        self._recovering: dict[ActorRef, asyncio.Future[None]] = {}
        self.resync: Callable[[], Awaitable[None]] | None = None  # set by the builder

    @property
    def version(self) -> int:
        """The newest version a weight sync reported loaded into every actor."""
        return self._version

    def loaded(self, version: int) -> None:
        """A weight sync loaded ``version`` into every actor."""
        self._version = max(self._version, version)

    def generate(self, requests: Sequence[GenerationRequest]) -> AsyncIterator[Trajectory]:
        return self._generate(self._split(requests))

    def _split(self, requests: Sequence[GenerationRequest]) -> dict[ActorRef, list[GenerationRequest]]:
        groups: dict[int, list[GenerationRequest]] = {}
        for request in requests:
            groups.setdefault(request.prompt_id, []).append(request)
        parts: dict[ActorRef, list[GenerationRequest]] = {}
        for group in groups.values():
            actor = min(self.actors, key=lambda a: a.in_flight)
            actor.in_flight += len(group)
            actor.requests += len(group)
            parts.setdefault(actor, []).extend(group)
        return parts

    async def _generate(self, parts: dict[ActorRef, list[GenerationRequest]]) -> AsyncIterator[Trajectory]:
        streams = {actor: actor.handle.generate.remote(reqs) for actor, reqs in parts.items()}
        left = {actor: len(reqs) for actor, reqs in parts.items()}
        nexts = {asyncio.ensure_future(self._next(actor, stream)): actor for actor, stream in streams.items()}
        try:
            while nexts:
                done, _ = await asyncio.wait(nexts, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    actor = nexts.pop(task)
                    sample = task.result()  # raises ActorFailedError: the finally cancels the rest
                    if sample is None:
                        continue
                    actor.in_flight -= 1
                    left[actor] -= 1
                    nexts[asyncio.ensure_future(self._next(actor, streams[actor]))] = actor
                    yield sample
        finally:
            for task in nexts:
                task.cancel()
            for actor, stream in streams.items():
                actor.in_flight -= left[actor]
                if left[actor]:
                    ray.cancel(stream)  # the actor drops the requests nobody listens to any more

    async def _next(self, actor: ActorRef, stream: Any) -> Trajectory | None:
        try:
            ref = await stream.__anext__()
            return await ref
        except StopAsyncIteration:
            return None
        except RayActorError as exc:
            await self.recover(actor)
            raise ActorFailedError(actor.role, actor.name, exc) from exc

    async def recover(self, actor: ActorRef) -> None:
        """Wait until ``actor`` is back and serving weights no older than the other actors';
        concurrent callers share one recovery. Returns at once if it never went away; raises
        :class:`ActorFailedError` if it is gone for good."""
        task = self._recovering.get(actor)
        if task is None or task.done():
            task = self._recovering[actor] = asyncio.ensure_future(self._recover(actor))
        await asyncio.shield(task)

    async def _recover(self, actor: ActorRef) -> None:
        if await actor.back() < self._version:  # a restarted actor holds the model file's weights
            log.warning("rollout actor restarted; reloading weights", actor=actor.name, serving=self._version)
            assert self.resync is not None
            await self.resync()

    async def recover_all(self) -> None:
        await asyncio.gather(*(self.recover(a) for a in self.actors))


class RayTrainEngine:
    """``TrainEngine`` over the trainer actor. ``version`` is what its last step returned, so
    the logp role reads it without a round trip (logp and train share a lock: no step lands
    between the read and the scoring)."""

    def __init__(self, actor: ActorRef) -> None:
        self.actor = actor
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    async def logprobs(self, trajectories: Sequence[Trajectory]) -> list[list[float]]:
        return await self.actor.call(self.actor.handle.logprobs.remote(list(trajectories)))

    async def train_step(
        self, batch: Sequence[Trajectory], objective: LossObjective, mini_batches: Sequence[Sequence[int]] | None = None
    ) -> dict[str, float]:
        metrics, self._version = await self.actor.call(
            self.actor.handle.train_step.remote(list(batch), objective, mini_batches)
        )
        return metrics

    async def save_state(self, folder: Path) -> None:
        """Written by the trainer actor: ``folder`` must be on storage its node shares."""
        await self.actor.call(self.actor.handle.save_state.remote(str(folder)))

    async def load_state(self, folder: Path) -> None:
        _, self._version = await self.actor.call(self.actor.handle.load_state.remote(str(folder)))


class RayLogProbEngine:
    """``LogProbEngine`` over the reference actor (frozen: version 0)."""

    def __init__(self, actor: ActorRef) -> None:
        self.actor = actor

    @property
    def version(self) -> int:
        return 0

    async def logprobs(self, trajectories: Sequence[Trajectory]) -> list[list[float]]:
        return await self.actor.call(self.actor.handle.logprobs.remote(list(trajectories)))

    async def save_state(self, folder: Path) -> None:
        """Written by the reference actor: ``folder`` must be on storage its node shares."""
        await self.actor.call(self.actor.handle.save_state.remote(str(folder)))

    async def load_state(self, folder: Path) -> None:
        await self.actor.call(self.actor.handle.load_state.remote(str(folder)))


class RayReward:
    """``Reward`` over the reward actor."""

    def __init__(self, actor: ActorRef) -> None:
        self.actor = actor

    async def score(self, trajectories: Sequence[Trajectory], groups: Sequence[PromptGroup]) -> list[RewardResult]:
        return await self.actor.call(self.actor.handle.score.remote(list(trajectories), list(groups)))


class RayWeightSync:
    """``WeightSync``: the trainer actor gathers into its dual buffer and ships each bucket to
    every rollout actor, through the object store or by gloo broadcast (``transport``).

    A trainer group's rank 0 is the trainer actor here: ``stage`` (``TrainerGroup.stage``) first
    gathers the group's weights into rank 0's staging, which rank 0 then ships."""

    def __init__(
        self,
        trainer: ActorRef,
        rollout: RayRolloutEngine,
        transport: str,
        stage: Callable[[], Awaitable[int]] | None = None,
    ) -> None:
        self.trainer = trainer
        self.rollout = rollout
        self._stage = stage
        handle = trainer.handle
        if transport == "dist":
            # The address ref is passed on unresolved: Ray hands each call its value.
            address, world = handle.dist_address.remote(), len(rollout.actors) + 1
            joins = [a.handle.join_dist.remote(address, rank, world) for rank, a in enumerate(rollout.actors, 1)]
            self._connecting = [handle.connect_dist.remote(address, world), *joins]
        else:
            self._connecting = [handle.connect.remote([(a.name, a.handle) for a in rollout.actors])]

    async def _connected(self) -> None:
        for ref in self._connecting:
            await self.trainer.call(ref)

    async def sync(self, version: int) -> SyncReport:
        await self._connected()
        if self._stage is not None:
            await self._stage()
        try:
            report: SyncReport = await self.trainer.call(self.trainer.handle.sync.remote(version))
        except ActorFailedError:
            raise
        except Exception:
            # A rollout actor may have died mid-transfer: let it come back (and be reloaded)
            # before the role's retry asks again. The sync's own error is the one to report.
            await asyncio.gather(self.rollout.recover_all(), return_exceptions=True)
            raise
        self.rollout.loaded(report.version)
        return report

    async def reload(self) -> None:
        """Load the trainer's current weights into every rollout actor (after a restart)."""
        await self._connected()
        if self._stage is not None:
            await self._stage()
        report: SyncReport = await self.trainer.call(self.trainer.handle.sync.remote(0))
        self.rollout.loaded(report.version)


@dataclass(slots=True)
class _Cluster:
    """What this backend started, to be undone in reverse by ``close``."""

    started_ray: bool
    group: PlacementGroup | None = None
    actors: list[ActorRef] = field(default_factory=list)

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor.handle, no_restart=True)
        if self.group is not None:
            remove_placement_group(self.group)
        if self.started_ray:
            ray.shutdown()


def connect(config: TandemConfig) -> bool:
    """Join ``cluster.address``, or start a local cluster; True if this call initialised Ray
    (and so must shut it down). A driver that initialised Ray itself is used as it is."""
    if ray.is_initialized():
        return False
    cluster = config.cluster
    if cluster.address is not None:
        ray.init(address=cluster.address, include_dashboard=False)
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        ray.init(num_cpus=cluster.num_cpus or cores, include_dashboard=False)
    return True


def cluster_plan(config: TandemConfig) -> ResourcePlan:
    """The plan on the connected cluster: GPU slots where it has GPUs, else CPU slots."""
    resources = ray.cluster_resources()
    gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
    return plan_resources(config, gpus, "GPU") if gpus else plan_resources(config, cpus, "CPU")


def _threads(config: TandemConfig, placement: ActorPlacement) -> int:
    spec = config.engines
    assert isinstance(spec, TorchEnginesConfig)
    chosen = spec.generation_threads if placement.role == "generate" else spec.train_threads
    return chosen or len(placement.slots)


def _one_placement_per_rank(config: TandemConfig, placements: list[ActorPlacement]) -> list[ActorPlacement]:
    """A trainer group's train placement as one placement per slot (rank ``r`` in the ``r``-th train
    slot), every slot's bundle split evenly again among the actors now sitting on it."""
    spec = config.engines
    assert isinstance(spec, TorchEnginesConfig)
    placed: list[tuple[str, str, int, tuple[int, ...]]] = []
    for p in placements:
        if p.role != "train":
            placed.append((p.role, p.name, p.slot, p.slots))
            continue
        if spec.train_world_size != len(p.slots):
            raise ConfigError(
                f"engines.train_world_size={spec.train_world_size}: a trainer group on Ray has one rank per train "
                f"slot, and cluster gives train {len(p.slots)} ({list(p.slots)})"
            )
        placed += [(p.role, f"train-rank{rank}", slot, (slot,)) for rank, slot in enumerate(p.slots)]
    per_slot = Counter(slot for _, _, slot, _ in placed)
    return [ActorPlacement(role, name, slot, 1.0 / per_slot[slot], slots) for role, name, slot, slots in placed]


def _trainer_group(config: TandemConfig, ranks: list[ActorRef]) -> TrainerGroup:
    """Start the rank actors as one trainer group (waits until every rank has joined)."""
    from tandem.engines.text.build import resolve_model_path
    from tandem.engines.trainers.group import RankSpec, RayRanks, TrainerGroup

    spec = config.engines
    assert isinstance(spec, TorchEnginesConfig)
    ranks_spec = RankSpec.from_config(config, str(resolve_model_path(spec.model_path)), spec.train_threads or 1)
    return TrainerGroup(RayRanks([r.handle for r in ranks], ranks_spec), ranks_spec)


def build_ray_components(config: TandemConfig, setup: TaskSetup) -> Components:
    """Start (or join) the cluster, place the actors, and hand back their proxies.

    Nothing here waits on an actor: the first call to each waits for it to start (a model
    load), in the flow's loop. ``close()`` kills every actor this started, removes the
    placement group, and stops the cluster if this started it; it runs on success, error and
    Ctrl-C alike (the flow closes the components it built in a ``finally``).
    """
    from tandem.engines.text.build import (
        prompt_budget,
        prompt_encoder,
        rollout_engine,
        run_tokenizer,
        sampling_params,
        tokenized,
        tokenized_held_out,
        trainer_with_export,
    )
    from tandem.engines.text.workflow import SingleTurnWorkflow

    spec = config.engines
    assert isinstance(spec, TorchEnginesConfig)
    tokenizer = run_tokenizer(config)
    max_prompt_tokens = prompt_budget(config, tokenizer)  # before any actor starts: bad input fails fast
    encode = prompt_encoder(config, tokenizer, setup.items)
    cluster = _Cluster(started_ray=connect(config))
    try:
        plan = cluster_plan(config)
        slots = plan.used_slots
        cluster.group = placement_group([{plan.device: 1.0} for _ in slots], strategy="PACK")
        placements = plan.actors()
        if spec.trainer_group is not None:
            placements = _one_placement_per_rank(config, placements)
        restarts = config.cluster.max_actor_restarts
        actors: dict[str, list[ActorRef]] = {}
        for placement in placements:
            amount = {"num_gpus": placement.share, "num_cpus": 0} if plan.device == "GPU" else {"num_cpus": placement.share}
            options = {
                "scheduling_strategy": PlacementGroupSchedulingStrategy(cluster.group, slots.index(placement.slot)),
                **amount,
            }
            if placement.role == "train" and spec.trainer_group is not None:  # never restarted: state would be lost
                handle = TrainRankActor.options(**options).remote(config, spec.train_threads or 1)
            elif placement.role == "generate":
                handle = RolloutActor.options(max_restarts=restarts, **options).remote(
                    config, placement.name, _threads(config, placement), rollout_engine
                )
            elif placement.role == "train":
                handle = TrainerActor.options(**options).remote(config, _threads(config, placement), trainer_with_export)
            else:
                handle = ReferenceActor.options(**options).remote(config, _threads(config, placement))
            ref = ActorRef(placement.role, placement.name, handle, restartable=placement.role == "generate" and restarts > 0)
            actors.setdefault(placement.role, []).append(ref)
            cluster.actors.append(ref)
        # The reward reserves no slot: its functions run in its own worker processes.
        reward_actor = RewardActor.options(num_cpus=0, max_restarts=restarts).remote(setup.reward)
        reward = ActorRef("reward", "reward", reward_actor, restartable=restarts > 0)
        cluster.actors.append(reward)
        group = _trainer_group(config, actors["train"]) if spec.trainer_group is not None else None
    except BaseException:
        cluster.close()
        raise
    trainer = actors["train"][0]  # a trainer group's rank 0, which ships the group's weights
    rollout = RayRolloutEngine(actors["generate"])
    weight_sync = RayWeightSync(trainer, rollout, config.cluster.weight_transport, group.stage if group else None)
    rollout.resync = weight_sync.reload
    log.info(
        "ray engines placed",
        device=plan.device,
        slots={role: list(s) for role, s in plan.roles.items()},
        actors=[f"{p.name}@{p.slot}x{p.share:g}" for p in placements],
    )

    async def checkpoint(folder: Path) -> None:
        if group is None:
            await trainer.call(trainer.handle.save_checkpoint.remote(str(folder)))
            return
        await asyncio.to_thread(group.save_pretrained, folder)  # written by rank 0
        await asyncio.to_thread(tokenizer.save_pretrained, folder)

    return Components(
        prompts=tokenized(setup.items, encode),
        held_out=tokenized_held_out(setup.task, encode),
        workflow=SingleTurnWorkflow(rollout, sampling_params(config)),
        trainer=group if group is not None else RayTrainEngine(trainer),
        reward=RayReward(reward),
        weight_sync=weight_sync,
        reference=RayLogProbEngine(actors["ref_logp"][0]) if "ref_logp" in actors else None,
        close_callbacks=([group.close] if group is not None else []) + [cluster.close],
        save_checkpoint=checkpoint,
        max_prompt_tokens=max_prompt_tokens,
    )
