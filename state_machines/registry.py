"""The registry of roles and the factory the flow builds its stages with.

Built-in roles are registered by name. A config's ``flow.custom_stages`` maps a stage name to
``module:Class`` of a :class:`~state_machines.base.StateMachine` subclass: a new name adds a
stage, a built-in name replaces that role.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from tandem.core.channel import ReceiveChannel, SendChannel
from tandem.core.config import import_named
from tandem.state_machines.base import FlowServices, StateMachine
from tandem.state_machines.critic import CriticStateMachine
from tandem.state_machines.dataloader import DataloaderStateMachine
from tandem.state_machines.generate import GenerateStateMachine
from tandem.state_machines.logp import LogPStateMachine
from tandem.state_machines.param_update import ParamUpdateStateMachine
from tandem.state_machines.ref_logp import RefLogPStateMachine
from tandem.state_machines.reward import RewardStateMachine
from tandem.state_machines.rollout import RolloutStateMachine
from tandem.state_machines.teacher_logp import TeacherLogPStateMachine
from tandem.state_machines.train import TrainStateMachine
from tandem.state_machines.validate import ValidateStateMachine

__all__ = ["ROLE_STATE_MACHINES", "create_role_state_machine", "resolve_stage_class"]

ROLE_STATE_MACHINES: dict[str, type[StateMachine]] = {
    cls.role: cls
    for cls in (
        DataloaderStateMachine,
        GenerateStateMachine,
        RolloutStateMachine,
        LogPStateMachine,
        RefLogPStateMachine,
        TeacherLogPStateMachine,
        CriticStateMachine,
        RewardStateMachine,
        TrainStateMachine,
        ParamUpdateStateMachine,
        ValidateStateMachine,
    )
}


def resolve_stage_class(name: str, custom_stages: Mapping[str, str]) -> type[StateMachine]:
    """The class that runs stage ``name``: a custom one if configured, else the built-in role."""
    target = custom_stages.get(name)
    if target is None:
        try:
            return ROLE_STATE_MACHINES[name]
        except KeyError:
            raise ValueError(f"no role named {name!r}; known roles: {sorted(ROLE_STATE_MACHINES)}") from None
    cls = import_named(target, f"flow.custom_stages.{name}")
    if not (isinstance(cls, type) and issubclass(cls, StateMachine)):
        raise ValueError(f"flow.custom_stages.{name}: {target!r} is not a StateMachine subclass")
    return cls


def create_role_state_machine(
    role_name: str,
    services: FlowServices,
    *,
    inbox: ReceiveChannel[Any] | None = None,
    outbox: SendChannel[Any] | None = None,
    lock: asyncio.Lock | None = None,
) -> StateMachine:
    """Build the state machine for ``role_name`` as the config says (built-in or custom)."""
    cls = resolve_stage_class(role_name, services.config.flow.custom_stages)
    return cls(role_name, services, inbox=inbox, outbox=outbox, lock=lock)
