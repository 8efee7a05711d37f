"""Agentic RL: multi-turn episodes through the same flow as single-turn text.

What it owns: the workflow API (``workflow``: subclass :class:`AgentWorkflow`, write
``async def run(self, engine, item)`` with ordinary Python over a per-episode
:class:`EpisodeEngine`, assemble the result with a :class:`TrajectoryBuilder`), the built-in
environment manager (``environment_manager``: plays a task's environment, many episodes at once),
the registry that resolves ``agentic.workflow`` (``registry``), the episode payload (``payload``)
and the builders of the episode workload's component bundle (``components``, imported by
``pipeline.builders`` only when a task of kind ``episode`` runs; it pulls in torch).

An episode is one trajectory: its model tokens trained with their behaviour log-probs and
per-token versions, the environment's tokens masked out of the loss. The flow, the staleness
gate, the ledger, weight sync and the trainer treat it as any token trajectory.

Importing this package pulls in neither torch nor transformers (reward workers unpickle
:class:`EpisodePayload`).
"""

from __future__ import annotations

from tandem.engines.agentic.environment_manager import EnvironmentManager, episode_seed
from tandem.engines.agentic.payload import EpisodePayload
from tandem.engines.agentic.registry import WORKFLOWS, load_workflow
from tandem.engines.agentic.workflow import (
    AgentWorkflow,
    Completion,
    EpisodeEngine,
    TrajectoryBuilder,
    WorkflowContext,
    turn_seed,
)

__all__ = [
    "WORKFLOWS",
    "AgentWorkflow",
    "Completion",
    "EnvironmentManager",
    "EpisodeEngine",
    "EpisodePayload",
    "TrajectoryBuilder",
    "WorkflowContext",
    "episode_seed",
    "load_workflow",
    "turn_seed",
]
