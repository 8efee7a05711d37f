"""The image workload on Ray: its rollout and train engines as Ray actors, driven by the same flow.

What it owns: the two actor classes that host the diffusion engines
(the shared ``RolloutActor`` and ``TrainerActor`` over the image engines' factories) and the builder that places
them. Everything else is the text workload's Ray backend, reused as it is
(``engines.ray.build``): the cluster connection and placement plan, the proxies the
flow awaits (a rollout call's groups split between rollout actors and their streams merged,
the trainer, the reward), weight sync through the object store or a gloo group, and the
reward actor (``engines.ray.actors.RewardActor``), which is the served judge here: one
process hosting the task's reward, shared by every caller (the reward and validate roles).

The actors differ from the text ones only in the engine they build and in the final export;
the weight-sync endpoints and methods are the same, so ``RayWeightSync`` drives them unchanged.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import ray
import structlog
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tandem.core.components import Components, TaskSetup
from tandem.core.config import TandemConfig
from tandem.core.resources import ActorPlacement
from tandem.engines.diffusion.build import check_image_config, image_rollout_engine, image_trainer_with_export, image_workflow
from tandem.engines.ray.actors import RewardActor, RolloutActor, TrainerActor
from tandem.engines.ray.build import (
    ActorRef,
    RayReward,
    RayRolloutEngine,
    RayTrainEngine,
    RayWeightSync,
    cluster_plan,
    connect,
)

__all__ = ["build_ray_image_components"]

log = structlog.get_logger("tandem.ray")
_GLOO_TIMEOUT = datetime.timedelta(minutes=2)


def _threads(config: TandemConfig, placement: ActorPlacement) -> int:
    spec = check_image_config(config)
    chosen = spec.generation_threads if placement.role == "generate" else spec.train_threads
    return chosen or len(placement.slots)


def build_ray_image_components(config: TandemConfig, setup: TaskSetup) -> Components:
    """Start (or join) the cluster, place the image workload's actors, and hand back their proxies.

    One rollout actor per ``generate`` slot, one trainer over the ``train`` slots (logp shares
    it), the reward actor beside them; roles sharing slots take turns under one lock. ``close()``
    kills every actor started here, removes the placement group, and stops a cluster it started.
    """
    check_image_config(config)
    started_ray = connect(config)
    handles: list[Any] = []
    group = None

    def close() -> None:
        for handle in handles:
            ray.kill(handle, no_restart=True)
        if group is not None:
            remove_placement_group(group)
        if started_ray:
            ray.shutdown()

    try:
        plan = cluster_plan(config)
        if "ref_logp" in plan.roles:
            raise ValueError("the image workload has no ref_logp actor: its KL is exact (algorithm.kl_estimator=exact)")
        slots = plan.used_slots
        group = placement_group([{plan.device: 1.0} for _ in slots], strategy="PACK")
        restarts = config.cluster.max_actor_restarts
        rollout_actors: list[ActorRef] = []
        trainer: ActorRef | None = None
        for placement in plan.actors():
            amount = {"num_gpus": placement.share, "num_cpus": 0} if plan.device == "GPU" else {"num_cpus": placement.share}
            options = {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, slots.index(placement.slot)), **amount}
            if placement.role == "generate":
                handle = RolloutActor.options(max_restarts=restarts, **options).remote(
                    config, placement.name, _threads(config, placement), image_rollout_engine
                )
                rollout_actors.append(ActorRef("generate", placement.name, handle, restartable=restarts > 0))
            else:
                handle = TrainerActor.options(**options).remote(config, _threads(config, placement), image_trainer_with_export)
                trainer = ActorRef("train", placement.name, handle)
            handles.append(handle)
        # The reward reserves no slot: its functions run in its own worker processes (or inline in it).
        reward_handle = RewardActor.options(num_cpus=0, max_restarts=restarts).remote(setup.reward)
        handles.append(reward_handle)
    except BaseException:
        close()
        raise
    assert trainer is not None
    rollout = RayRolloutEngine(rollout_actors)
    weight_sync = RayWeightSync(trainer, rollout, config.cluster.weight_transport)
    rollout.resync = weight_sync.reload
    log.info("ray image engines placed", device=plan.device, slots={role: list(s) for role, s in plan.roles.items()})

    async def checkpoint(folder: Path) -> None:
        await trainer.call(trainer.handle.save_checkpoint.remote(str(folder)))

    return Components(
        prompts=setup.items,
        held_out=setup.task.held_out,
        workflow=image_workflow(config, rollout),
        trainer=RayTrainEngine(trainer),
        reward=RayReward(ActorRef("reward", "reward", reward_handle, restartable=restarts > 0)),
        weight_sync=weight_sync,
        close_callbacks=[close],
        save_checkpoint=checkpoint,
    )
