"""The run's stage graph, declared in one place: what runs, what feeds what, who takes turns, who ends it.

What it owns: turning a config into a :class:`StageGraph` (pure data, no asyncio) and building
the state machines and channels it describes. ``AsyncTrainingFlow`` supervises what this builds
and reads nothing else of the config to do so.

- The **chain**: ``flow.stages`` in order, each pair joined by a bounded channel
  (``flow.channel_capacity``): items flow dataloader -> generate -> rollout -> ... -> train.
- The roles **beside** the chain, driven by the version clock instead of a channel:
  ``param_update`` always, ``validate`` when ``validation.every_versions`` is set.
- The **lock groups**: roles that share devices take turns under one fair lock (``flow.colocate``,
  roles whose Ray slots overlap); ``logp`` always takes turns with ``train``, since it reads the
  trainer's weights and a proximal score must never straddle an optimizer step.
- The **finishing role**: the run ends when it finishes (``train``, after ``run.max_steps``);
  every other role is then stopped, having nothing left that could be trained.
- The **critic's feedback**: with a ``critic`` stage, the train role sends each trained step's
  trajectories (with their GAE returns) back to it over one more channel, of capacity one, and
  the critic trains on them beside the chain.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from tandem.core.channel import ReceiveChannel, SendChannel, open_channel
from tandem.core.config import TandemConfig
from tandem.core.resources import colocated_groups
from tandem.state_machines.base import FlowServices, StateMachine
from tandem.state_machines.critic import CriticStateMachine
from tandem.state_machines.registry import create_role_state_machine
from tandem.state_machines.train import TrainStateMachine

__all__ = ["BuiltGraph", "StageGraph"]


@dataclass(frozen=True, slots=True)
class StageGraph:
    """What runs and how it is joined; see the module docstring."""

    chain: tuple[str, ...]
    beside: tuple[str, ...]
    lock_groups: tuple[frozenset[str], ...]
    finishing_role: str = "train"
    channel_capacity: int = 64

    @classmethod
    def from_config(cls, config: TandemConfig) -> StageGraph:
        chain = tuple(config.flow.stages)
        beside = ("param_update",) + (("validate",) if config.validation.every_versions is not None else ())
        groups = colocated_groups(config)
        if "logp" in chain and not any({"logp", "train"} <= g for g in groups):
            merged = {"logp", "train"}.union(*[g for g in groups if g & {"logp", "train"}])
            groups = [g for g in groups if not g & {"logp", "train"}] + [merged]
        return cls(chain, beside, tuple(frozenset(g) for g in groups), "train", config.flow.channel_capacity)

    @property
    def links(self) -> list[tuple[str, str]]:
        """(producer, consumer) of each channel, in chain order."""
        return list(zip(self.chain, self.chain[1:], strict=False))

    def build(self, services: FlowServices) -> BuiltGraph:
        """One state machine per role (chain first, then the roles beside it), the chain's
        channels, and one lock shared by each lock group's roles."""
        scorers = {"ref_logp": (services.components.reference, "reference model"),
                   "teacher_logp": (services.components.teacher, "teacher")}
        for stage, (engine, what) in scorers.items():
            if stage in self.chain and engine is None:
                raise ValueError(f"flow.stages has {stage} but the engines provide no {what}")
        locks: dict[str, asyncio.Lock] = {}
        for group in self.lock_groups:
            lock = asyncio.Lock()
            locks.update({role: lock for role in group})
        sends: dict[str, SendChannel[Any]] = {}
        receives: dict[str, ReceiveChannel[Any]] = {}
        for producer, consumer in self.links:
            sends[producer], receives[consumer] = open_channel(f"{producer}->{consumer}", self.channel_capacity)
        machines = [
            create_role_state_machine(
                name, services, inbox=receives.get(name), outbox=sends.get(name), lock=locks.get(name)
            )
            for name in (*self.chain, *self.beside)
        ]
        channels = [receives[consumer] for _, consumer in self.links]
        if "critic" in self.chain:
            by_name = {m.name: m for m in machines}
            train, critic = by_name["train"], by_name["critic"]
            if not isinstance(train, TrainStateMachine) or not isinstance(critic, CriticStateMachine):
                raise ValueError("a flow with a critic needs the train and critic roles (or subclasses of them)")
            train.critic_batches, critic.batches = open_channel("train->critic", 1)
            train.critic_caught_up = critic.caught_up
            channels.append(critic.batches)
        return BuiltGraph(machines, channels)


@dataclass(slots=True)
class BuiltGraph:
    """The running shape of a graph: its machines (chain order, then the roles beside) and the
    receiving ends of its channels (for their statistics)."""

    machines: list[StateMachine]
    channels: list[ReceiveChannel[Any]]
