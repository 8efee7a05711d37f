"""tandem: an asynchronous RL post-training engine for generative models.

Installed, tandem is this one package. Its parts keep their own folders in the repository
(``pipeline/``, ``state_machines/``, ``param_sync/``, ``engines/``, ``algorithms/``, ``tasks/``,
``core/``, ``configs/``); ``pyproject.toml`` maps each to ``tandem.<part>``, so a user's own
``tasks.py`` or ``pipeline/`` can never shadow ours.

What a user writes against is listed in ``__all__``. The names load on first use (PEP 562), so
importing one part (``tandem.core.records`` in a reward worker, ``tandem.engines.vllm.worker`` in
a vLLM process) does not import the flow; none of them imports torch or ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.core.lazy import lazy_names

if TYPE_CHECKING:
    from tandem.core.config import ConfigError, TandemConfig, load_config
    from tandem.core.environment import Environment, StepResult
    from tandem.core.records import FinishReason, Trajectory, TrajectoryGroup
    from tandem.core.task import RewardFunction, Task
    from tandem.engines.agentic import AgentWorkflow
    from tandem.pipeline import AsyncTrainingFlow, FlowResult
    from tandem.state_machines.base import Stage, StateMachine

_HOMES = {
    "AgentWorkflow": "tandem.engines.agentic",
    "AsyncTrainingFlow": "tandem.pipeline",
    "ConfigError": "tandem.core.config",
    "Environment": "tandem.core.environment",
    "FinishReason": "tandem.core.records",
    "FlowResult": "tandem.pipeline",
    "RewardFunction": "tandem.core.task",
    "Stage": "tandem.state_machines.base",
    "StateMachine": "tandem.state_machines.base",
    "StepResult": "tandem.core.environment",
    "TandemConfig": "tandem.core.config",
    "Task": "tandem.core.task",
    "Trajectory": "tandem.core.records",
    "TrajectoryGroup": "tandem.core.records",
    "load_config": "tandem.core.config",
}

__all__ = [
    "AgentWorkflow",
    "AsyncTrainingFlow",
    "ConfigError",
    "Environment",
    "FinishReason",
    "FlowResult",
    "RewardFunction",
    "Stage",
    "StateMachine",
    "StepResult",
    "TandemConfig",
    "Task",
    "Trajectory",
    "TrajectoryGroup",
    "load_config",
]

__getattr__, __dir__ = lazy_names(globals(), _HOMES)
