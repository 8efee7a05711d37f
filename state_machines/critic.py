"""The critic role: the value model of PPO with GAE, scoring and training beside the policy.

It owns the critic engine (``components.critic``, its own weights, optimizer and version) and
runs two loops that take turns on it:

- scoring, a chain stage (anywhere after rollout): every trajectory gets the critic's value of
  the state before each action, stamped with the critic version that computed it;
- training: after each policy step the train role sends that step's trajectories, carrying the
  GAE returns computed from these values, over the ``train -> critic`` channel (wired by the
  stage graph); the critic trains one version on each with PPO's clipped value loss
  (``algorithm.value_clip_eps``), on the policy step's own mini-batch plan (``train.mini_batches``
  and ``train.epochs``: as many optimizer steps), while the policy trains its next step.

So the critic runs asynchronously like the policy: its version counts the policy steps it has
trained on and advances independently (``tandem_policy_version{role="critic"}``, ``metrics.jsonl`` rows of kind
``critic``); how far the values a step trains with lag behind that step is recorded per
trajectory (``StepRecord.value_staleness``: the policy step minus the critic version, 0 when the
critic has trained on every earlier step). The channel holds one batch, so the critic's training
is at most two policy steps behind; when the train role has sent its last step it closes the
channel and waits for :attr:`CriticStateMachine.caught_up`, so a finished run's critic has trained
on every step. Scoring and training never overlap (one lock), so a version
stamp always names the weights that produced the values. The state shown is the last transition
of either loop.

Checkpoints: the critic's engine is saved with every checkpoint (``Checkpointer.track``), and a
resumed run restores it (weights, optimizer, version) before scoring anything.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from tandem.algorithms.objective import ValueObjective
from tandem.core.channel import EndOfStream, ReceiveChannel
from tandem.core.history import CriticRecord
from tandem.core.protocols import ValueEngine
from tandem.core.records import Trajectory, TrajectoryGroup
from tandem.state_machines.base import FlowServices, Stage

__all__ = ["CriticBatch", "CriticStateMachine"]


@dataclass(slots=True)
class CriticBatch:
    """One trained policy step's trajectories, each with its ``values`` and GAE ``returns``, and the
    step's mini-batch plan (indices into them, one optimizer step each) (train -> critic)."""

    step: int
    trajectories: list[Trajectory]
    mini_batches: list[list[int]]


class CriticStateMachine(Stage[TrajectoryGroup, TrajectoryGroup]):
    role = "critic"

    def __init__(self, name: str, services: FlowServices, **channels: object) -> None:
        super().__init__(name, services, **channels)  # type: ignore[arg-type]
        algo = services.config.algorithm
        self.objective = ValueObjective(algo.value_clip_eps, algo.aggregation)
        self.batches: ReceiveChannel[CriticBatch] | None = None  # set by the stage graph
        self._turns = asyncio.Lock()  # scoring and training take turns on the engine
        self.caught_up = asyncio.Event()  # set once every batch sent before the channel closed is trained

    @property
    def engine(self) -> ValueEngine:
        critic = self.services.components.critic
        if critic is None:
            raise RuntimeError("the critic stage runs but the components have no critic engine")
        return critic

    async def main(self) -> None:
        engine = self.engine
        if self.batches is None:
            raise RuntimeError("the critic stage has no train -> critic channel: build the flow with its stage graph")
        checkpoints = self.services.checkpoints
        if checkpoints is not None:
            if checkpoints.restored_from is not None:
                await engine.load_state(checkpoints.restored_from)
            checkpoints.track(engine)
        self.version = engine.version
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._train(self.batches))
            await super().main()  # scoring, until the stream ends

    async def process(self, items: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
        engine = self.engine
        trajectories = [t for g in items for t in g.trajectories]
        async with self._turns:
            version = engine.version
            scored = await engine.values(trajectories)
        if len(scored) != len(trajectories):
            raise ValueError(f"the critic returned values for {len(scored)} of {len(trajectories)} trajectories")
        for trajectory, values in zip(trajectories, scored, strict=True):
            if len(values) != trajectory.num_actions:
                raise ValueError(
                    f"prompt {trajectory.prompt_id} trajectory {trajectory.index}: {len(values)} values "
                    f"for {trajectory.num_actions} actions"
                )
            trajectory.values, trajectory.value_version = values, version
        return items

    async def _train(self, batches: ReceiveChannel[CriticBatch]) -> None:
        """One critic version per trained policy step, in order; a step the error policy drops is
        skipped (the critic keeps its weights and version)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                batch = await batches.receive()
            except EndOfStream:
                self.caught_up.set()
                return
            metrics = await self.work([], lambda: self._step(batch))  # noqa: B023 (called within this iteration)
            if metrics is None:
                continue
            self.version = self.engine.version
            self.services.history.add_critic(CriticRecord(self.version, batch.step, loop.time(), metrics))

    async def _step(self, batch: CriticBatch) -> dict[str, float]:
        missing = [t.index for t in batch.trajectories if t.values is None or t.returns is None]
        if missing:
            raise ValueError(f"step {batch.step}: trajectories {missing} reached the critic without values or returns")
        async with self._turns:
            return await self.engine.train_step(batch.trajectories, self.objective, batch.mini_batches)
