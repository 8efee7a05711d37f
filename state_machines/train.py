"""The train role: one optimizer step per training step, on exactly that step's groups.

It owns the algorithm: each group's advantages come from ``algorithms`` by the configured name
(``algorithm.advantage``), decoupled PPO's proximal log-probs are the trainer's at this very step
(rescored if the logp role scored them at an older version), and the engine is handed the
configured policy objective (``algorithms.PolicyObjective`` over ``algorithm``): engines compute
log-probs and gradients and know no algorithm.

Groups arrive in completion order; they are held by step, and step ``t`` runs once all
``prompts_per_step`` groups assigned to it are in (a drop refills the step, see the gate).
Before each step the staleness of every group is checked against the bound, a violation
stops the run (it would mean the gate is wrong). After the step the trained version moves
forward, which lets parameter sync and then admission move on, and every ``run.save_steps``
a checkpoint is written before the next step can begin. On a clean stop, a step once begun is
finished and recorded first. Holding at most ``k + 1`` steps of groups, the buffer is bounded
by the in-flight cap.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from algorithms import PolicyObjective, compute_advantages
from core.history import StepRecord
from core.records import Trajectory, TrajectoryGroup
from state_machines.base import FlowServices, StateMachine

__all__ = ["TrainStateMachine"]


class TrainStateMachine(StateMachine):
    role = "train"

    def __init__(self, name: str, services: FlowServices, **channels: object) -> None:
        super().__init__(name, services, **channels)  # type: ignore[arg-type]
        self.objective = PolicyObjective(services.config.algorithm)

    async def main(self) -> None:
        services = self.services
        per_step = self.config.train.prompts_per_step
        step = services.clock.trained
        pending: dict[int, list[TrajectoryGroup]] = {}
        while step < self.config.run.max_steps:
            items = await self.receive()
            if items is None:
                raise RuntimeError(
                    f"the stream ended before step {step} had its {per_step} groups "
                    f"({len(pending.get(step, []))} arrived)"
                )
            for group in items:
                pending.setdefault(group.step, []).append(group)
            while step < self.config.run.max_steps and len(pending.get(step, ())) >= per_step:
                # Prompt order, not arrival order: the same batch always gives the same update.
                batch = sorted(pending.pop(step), key=lambda g: g.prompt_id)
                if await self._finish_on_clean_stop(self._train(step, batch)):
                    step += 1

    def advantages(self, batch: list[TrajectoryGroup]) -> list[Trajectory]:
        """Set every trajectory's advantage from its group's rewards; return the trajectories."""
        algo = self.config.algorithm
        rewards = []
        for group in batch:
            missing = [t.index for t in group.trajectories if t.reward is None]
            if missing:
                raise ValueError(f"prompt {group.prompt_id}: trajectories {missing} reached training without a reward")
            rewards.append([t.reward for t in group.trajectories])
        options = {"normalize_std": algo.normalize_std} if algo.advantage == "grpo" else {}
        for group, advantages in zip(batch, compute_advantages(algo.advantage, rewards, **options), strict=True):
            for trajectory, advantage in zip(group.trajectories, advantages.tolist(), strict=True):
                trajectory.advantage = advantage
        return [t for g in batch for t in g.trajectories]

    async def _step(self, batch: list[TrajectoryGroup]) -> dict[str, float]:
        """One optimizer step, under the train lock (which the logp role shares): proximal
        log-probs brought to the trainer's version, advantages set, the objective minimised."""
        trainer = self.services.components.trainer
        trajectories = self.advantages(batch)
        rescored = await self.refresh_proximal(trajectories)
        metrics = await trainer.train_step(trajectories, self.objective)
        return {**metrics, "prox_rescored_fraction": rescored / len(trajectories)} if self.uses_proximal else metrics

    @property
    def uses_proximal(self) -> bool:
        return self.config.algorithm.decoupled and "logp" in self.config.flow.stages

    async def refresh_proximal(self, trajectories: list[Trajectory]) -> int:
        """Make every trajectory's proximal log-probs the trainer's at this step; return how many
        were rescored.

        Decoupled PPO's proximal policy is the policy at the start of the train step (AReaL). The
        logp role scores a group when it arrives, with whatever version the trainer had then, so
        with k >= 1 a group scored at version t - 1 may be trained at version t: those are scored
        again here (the train lock keeps the weights still in between), and a proximal version
        other than the trainer's is an error, never silently trained.
        """
        if not self.uses_proximal:
            return 0
        trainer = self.services.components.trainer
        version = trainer.version
        stale = [t for t in trajectories if t.prox_version != version or t.prox_logprobs is None]
        if stale:
            for trajectory, logprobs in zip(stale, await trainer.logprobs(stale), strict=True):
                if len(logprobs) != trajectory.num_actions:
                    raise ValueError(
                        f"prompt {trajectory.prompt_id}: {len(logprobs)} log-probs for {trajectory.num_actions} actions"
                    )
                trajectory.prox_logprobs, trajectory.prox_version = logprobs, version
        if trainer.version != version:
            raise RuntimeError(f"the trainer moved from version {version} to {trainer.version} while scoring proximal log-probs")
        return len(stale)

    async def _train(self, step: int, batch: list[TrajectoryGroup]) -> bool:
        """Train one step; False if the error policy dropped the batch (the step is refilled)."""
        services = self.services
        loop = asyncio.get_running_loop()
        staleness = [services.gate.check(step, g.oldest_version, g.prompt_id, g.group.admitted_k) for g in batch]
        started = loop.time()
        metrics = await self.work(batch, lambda: self._step(batch))
        if metrics is None:
            return False
        for group in batch:
            services.ledger.mark_trained(group.prompt_id)
        version = step + 1
        await services.clock.advance_trained(version)
        await services.gate.complete(step, len(batch))
        self.version = version
        trajectories = [t for g in batch for t in g.trajectories]
        tokens = sum(t.num_actions for t in trajectories)
        self.items_done += len(trajectories)
        rewards = [t.reward for t in trajectories if t.reward is not None]
        services.history.add(
            StepRecord(
                step=step,
                time_s=loop.time(),
                step_time_s=loop.time() - started,
                groups=len(batch),
                samples=len(trajectories),
                tokens=tokens,
                reward_mean=sum(rewards) / len(rewards) if rewards else float("nan"),
                staleness=staleness,
                loaded_version=services.clock.loaded,
                staleness_bound=services.gate.k,
                prompt_ids=[g.prompt_id for g in batch],
                train_metrics=dict(metrics),
                rollout_metrics=rollout_metrics(trajectories),
            )
        )
        if services.checkpoints is not None:
            await services.checkpoints.after_step(version, services.ledger, services.gate.syncs)
        return True

    async def _finish_on_clean_stop(self, step: Coroutine[Any, Any, bool]) -> bool:
        """Run a train step; on a clean stop, finish it before passing the cancellation on.

        Once begun, a step runs to its end in the engine whatever the flow does; finishing its
        bookkeeping too (ledger, version, history) keeps the checkpoint written at a clean stop
        consistent: the trainer holds the clock's version, and the groups it trained count as
        trained. When a stage failed instead, nothing is checkpointed: the step is abandoned.
        """
        task = asyncio.ensure_future(step)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not self.services.stopping_cleanly:
                task.cancel()
            await asyncio.wait([task])
            if not task.cancelled() and task.exception() is not None:
                raise task.exception() from None  # type: ignore[misc]
            raise


def rollout_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """Each workload metric's mean over the trajectories that report it (turns, env seconds...)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for trajectory in trajectories:
        for key, value in (trajectory.metrics or {}).items():
            sums[key] = sums.get(key, 0.0) + value
            counts[key] = counts.get(key, 0) + 1
    return {key: sums[key] / counts[key] for key in sorted(sums)}
