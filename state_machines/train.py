"""The train role: one version per training step, on exactly that step's groups.

It owns the algorithm: each group's advantages come from ``algorithms`` by the configured name
(``algorithm.advantage``: a group estimator over the rewards, or GAE over a critic's values; with
a teacher, per-token advantages from its log-probs, ``state_machines.teacher_logp.distill``),
rewards are shaped as configured first (DAPO's soft over-long penalty), decoupled PPO's proximal
log-probs come from where ``algorithm.proximal`` says (``recompute``: the trainer's at this very
step, rescored if the logp role scored them at an older version), the step's mini-batches are
planned (``algorithms.mini_batches``: ``train.mini_batches`` of whole groups, shuffled by
``run.seed`` and the step, for ``train.epochs``: one optimizer step each, all inside the one
version), and the engine is handed the configured policy objective
(``algorithms.PolicyObjective``) with that plan: engines compute log-probs and gradients and
know no algorithm.

Groups arrive in completion order and are judged on arrival (``state_machines.consumption``:
staleness at consumption, dynamic sampling), which may drop one, send it back to be generated
again or withhold it to the next step; the others are held by step, and step ``t`` runs once all
``prompts_per_step`` groups assigned to it are in (a drop refills the step, see the gate).
Before each step the staleness of every group is checked against the bound it was admitted
under; a violation stops the run (it would mean the gate is wrong). After the step the trained
version moves forward, which lets parameter sync and then admission move on, every
``run.save_steps`` a checkpoint is written before the next step can begin, and with a critic the
step's trajectories (with their GAE returns) go to the critic role to train on; after the last
step the role waits until the critic has trained on every step, so the final checkpoint holds a
critic that saw the whole run (whatever the machine's pace). On a clean stop,
a step once begun is finished and recorded first. Holding at most ``k + 1`` steps of groups, the
buffer is bounded by the in-flight cap.

Every trained trajectory's lag is recorded with its step (``StepRecord``): its staleness at
consumption, the version span of its tokens, its time in flight and queued, and with a critic
the staleness of its values.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Coroutine
from typing import Any

from tandem.algorithms import PolicyObjective, compute_advantages, plan_mini_batches
from tandem.algorithms.shaping import soft_overlong_penalty
from tandem.core.channel import SendChannel
from tandem.core.history import StepRecord
from tandem.core.records import FinishReason, Trajectory, TrajectoryGroup
from tandem.state_machines.base import FlowServices, State, StateMachine
from tandem.state_machines.consumption import Consumption, version_span
from tandem.state_machines.critic import CriticBatch
from tandem.state_machines.teacher_logp import distill, mean_reverse_kl

__all__ = ["TrainStateMachine"]


class TrainStateMachine(StateMachine):
    role = "train"

    def __init__(self, name: str, services: FlowServices, **channels: object) -> None:
        super().__init__(name, services, **channels)  # type: ignore[arg-type]
        algo = services.config.algorithm
        self.objective = PolicyObjective(algo, algo.proximal)
        self.consumption = Consumption(services, name, self.shaped_rewards)
        # The consumption policy is this role's: slots it gives back are refilled only under the
        # consumption bound (set before any role runs, so every admission sees it).
        services.gate.refill_bound = services.config.staleness.refill_bound
        # Set by the stage graph with a critic: the step batches it trains on, and its signal that
        # it has trained on every batch sent before the channel closed.
        self.critic_batches: SendChannel[CriticBatch] | None = None
        self.critic_caught_up: asyncio.Event | None = None

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
                held = await self.consumption.accept(group)
                if held is not None:
                    pending.setdefault(held, []).append(group)
            while step < self.config.run.max_steps and len(pending.get(step, ())) >= per_step:
                # Prompt order, not arrival order: the same batch always gives the same update.
                batch = sorted(pending.pop(step), key=lambda g: g.prompt_id)
                plan = self.mini_batches(step, batch)
                if await self._finish_on_clean_stop(self._train(step, batch, plan)):
                    await self._feed_critic(step, batch, plan)
                    step += 1
        await self._wait_for_critic()

    def mini_batches(self, step: int, batch: list[TrajectoryGroup]) -> list[list[int]]:
        """The optimizer steps of train step ``step``: indices into its trajectories (group by group,
        in ``batch``'s order), seeded by the run's seed and the step, so a resumed run trains alike."""
        train = self.config.train
        groups = [group.prompt_id for group in batch for _ in group.trajectories]
        return plan_mini_batches(groups, train.mini_batches, train.epochs, seed=self.config.run.seed, step=step)

    def shaped_rewards(self, group: TrajectoryGroup) -> list[float]:
        """The rewards the group's advantages are computed from: each trajectory's reward plus
        DAPO's soft over-long penalty when ``algorithm.overlong_buffer`` is set. Every
        trajectory must have a reward."""
        missing = [t.index for t in group.trajectories if t.reward is None]
        if missing:
            raise ValueError(f"prompt {group.prompt_id}: trajectories {missing} reached training without a reward")
        buffer = self.config.algorithm.overlong_buffer
        rewards = [float(t.reward) for t in group.trajectories]  # type: ignore[arg-type]
        if buffer is None:
            return rewards
        longest = self.config.rollout.max_new_tokens
        return [
            r + soft_overlong_penalty(t.num_actions, max_length=longest, cache_length=buffer)
            for r, t in zip(rewards, group.trajectories, strict=True)
        ]

    def advantages(self, batch: list[TrajectoryGroup]) -> list[Trajectory]:
        """Set every trajectory's advantage from its group's (shaped) rewards, then with a teacher
        its per-action advantages from the teacher's log-probs; or its per-action advantages and
        returns by GAE. Return the trajectories."""
        algo = self.config.algorithm
        rewards = [self.shaped_rewards(group) for group in batch]
        if algo.advantage == "gae":
            return self._gae(batch, [r for group in rewards for r in group])
        options = {"normalize_std": algo.normalize_std} if algo.advantage == "grpo" else {}
        for group, advantages in zip(batch, compute_advantages(algo.advantage, rewards, **options), strict=True):
            for trajectory, advantage in zip(group.trajectories, advantages.tolist(), strict=True):
                trajectory.advantage = advantage
        trajectories = [t for g in batch for t in g.trajectories]
        if self.config.teacher is not None:
            distill(trajectories, self.config.teacher.reward_weight)
        return trajectories

    def _gae(self, batch: list[TrajectoryGroup], scores: list[float]) -> list[Trajectory]:
        """GAE over the critic's values with the outcome reward on each trajectory's last trained
        action, whitened over the step's trained actions (verl's ``compute_gae_advantage_return``)."""
        import torch  # the critic's path only: group estimators run without torch

        from tandem.algorithms.gae import gae_advantages, outcome_token_rewards, whiten

        algo = self.config.algorithm
        trajectories = [t for g in batch for t in g.trajectories]
        missing = [(t.prompt_id, t.index) for t in trajectories if t.values is None]
        if missing:
            raise ValueError(f"trajectories {missing[:8]} reached training without the critic's values")
        width = max(1, max(t.num_actions for t in trajectories))
        values = torch.zeros(len(trajectories), width, dtype=torch.float64)
        mask = torch.zeros_like(values)
        for i, t in enumerate(trajectories):
            values[i, : t.num_actions] = torch.tensor(t.values, dtype=torch.float64)
            mask[i, : t.num_actions] = torch.tensor(t.loss_mask or [1] * t.num_actions, dtype=torch.float64)
        # A trajectory without trained actions has nowhere to put its reward: it scores 0.
        outcome = torch.tensor(scores, dtype=torch.float64) * (mask.sum(dim=-1) > 0)
        advantages, returns = gae_advantages(
            outcome_token_rewards(outcome, mask), values, mask, gamma=algo.gae_gamma, lam=algo.gae_lambda
        )
        advantages = whiten(advantages, mask)
        for i, t in enumerate(trajectories):
            t.token_advantages = advantages[i, : t.num_actions].tolist()
            t.returns = returns[i, : t.num_actions].tolist()
        return trajectories

    def overlong_filtered(self, trajectories: list[Trajectory]) -> tuple[list[Trajectory], int]:
        """DAPO's over-long filtering (``algorithm.overlong_filter``): the trajectories as the
        policy trains them, those cut at the length limit with every action masked out of the
        loss (copies: the critic still learns from them), and how many were. A step whose every
        trajectory was cut trains them as they are: nothing would be left to train."""
        if not self.config.algorithm.overlong_filter:
            return trajectories, 0
        cut = [t.finish_reason is FinishReason.LENGTH for t in trajectories]
        if all(cut):
            self.log.warning("every trajectory of the step hit the length limit: over-long filtering skipped")
            return trajectories, 0
        kept = [dataclasses.replace(t, loss_mask=[0] * t.num_actions) if c else t for t, c in zip(trajectories, cut, strict=True)]
        return kept, sum(cut)

    async def _step(self, batch: list[TrajectoryGroup], plan: list[list[int]]) -> dict[str, float]:
        """One train step, under the train lock (which the logp role shares): proximal log-probs
        brought to the trainer's version, advantages set, the objective minimised over ``plan``'s
        mini-batches."""
        trainer = self.services.components.trainer
        trajectories, filtered = self.overlong_filtered(self.advantages(batch))
        scored, rescored = await self.refresh_proximal(trajectories)
        metrics = await trainer.train_step(trajectories, self.objective, plan)
        extra: dict[str, float] = {}
        if self.uses_proximal:
            extra["prox_scored_in_step_fraction"] = scored / len(trajectories)
            extra["prox_rescored_fraction"] = rescored / len(trajectories)
        if self.config.algorithm.overlong_filter:
            extra["overlong_filtered_fraction"] = filtered / len(trajectories)
        if self.config.teacher is not None:
            extra["teacher_reverse_kl"] = mean_reverse_kl(trajectories)
        return {**metrics, **extra}

    @property
    def uses_proximal(self) -> bool:
        algo = self.config.algorithm
        return algo.decoupled and algo.proximal == "recompute" and "logp" in self.config.flow.stages

    async def refresh_proximal(self, trajectories: list[Trajectory]) -> tuple[int, int]:
        """Make every trajectory's proximal log-probs the trainer's at this step; return how many
        were scored here, and how many of those had been scored before at another version.

        Decoupled PPO's proximal policy is the policy at the start of the train step (AReaL). The
        logp role scores a group ahead of its step only once the trainer has reached the group's
        step, and passes earlier arrivals through unscored: those are scored here (the train lock
        keeps the weights still in between). A group scored ahead and then trained a step later
        (withheld to the next step) is scored again, the wasted forward pass the second count
        reports; a proximal version other than the trainer's is never silently trained. (With
        ``algorithm.proximal: loglinear`` or ``current`` the objective takes them from the step's
        own forward passes.)
        """
        if not self.uses_proximal:
            return 0, 0
        trainer = self.services.components.trainer
        version = trainer.version
        stale = [t for t in trajectories if t.prox_version != version or t.prox_logprobs is None]
        rescored = sum(t.prox_logprobs is not None for t in stale)
        if stale:
            for trajectory, logprobs in zip(stale, await trainer.logprobs(stale), strict=True):
                if len(logprobs) != trajectory.num_actions:
                    raise ValueError(
                        f"prompt {trajectory.prompt_id}: {len(logprobs)} log-probs for {trajectory.num_actions} actions"
                    )
                trajectory.prox_logprobs, trajectory.prox_version = logprobs, version
        if trainer.version != version:
            raise RuntimeError(f"the trainer moved from version {version} to {trainer.version} while scoring proximal log-probs")
        return len(stale), rescored

    async def _train(self, step: int, batch: list[TrajectoryGroup], plan: list[list[int]]) -> bool:
        """Train one step; False if the error policy dropped the batch (the step is refilled)."""
        services = self.services
        loop = asyncio.get_running_loop()
        staleness = [services.gate.check(step, g.oldest_version, g.prompt_id, g.group.admitted_k) for g in batch]
        started = loop.time()
        metrics = await self.work(batch, lambda: self._step(batch, plan))
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
        requested = {g.prompt_id: g.group.requested_s for g in batch}
        timed = [(requested[t.prompt_id], t.finished_s) for t in trajectories]
        timed = [(r, f) for r, f in timed if r is not None and f is not None]
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
                trajectory_staleness=[step - t.start_version for t in trajectories],
                version_span=[version_span(t) for t in trajectories],
                in_flight_s=[round(f - r, 6) for r, f in timed],
                queued_s=[round(started - f, 6) for _, f in timed],
                value_staleness=[step - t.value_version for t in trajectories if t.values is not None],
                consumption=self.consumption.pop(step),
            )
        )
        if services.checkpoints is not None:
            await services.checkpoints.after_step(version, services.ledger, services.gate.syncs)
        return True

    async def _feed_critic(self, step: int, batch: list[TrajectoryGroup], plan: list[list[int]]) -> None:
        """Hand a trained step's trajectories and its mini-batch plan to the critic role (waits
        while it is a step behind)."""
        if self.critic_batches is not None:
            await self.critic_batches.send(CriticBatch(step, [t for g in batch for t in g.trajectories], plan))

    async def _wait_for_critic(self) -> None:
        """End the critic's stream and wait until it has trained on the last step (at most two
        critic steps; a critic failure cancels this wait with the rest of the flow)."""
        if self.critic_batches is None or self.critic_caught_up is None:
            return
        self.critic_batches.close()
        self.set_state(State.WAITING_OUTPUT)
        await self.critic_caught_up.wait()

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
