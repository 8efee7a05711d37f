"""Run configuration: pydantic models loaded from YAML with dotted command-line overrides.

Every field is documented and used; unknown keys are errors (``extra="forbid"``); the rules
between sections are checked before anything starts, and every error names the field at fault.
Nothing here imports torch or ray, so a config can be validated anywhere.

The parts, each small enough to hold in mind:
- :mod:`~tandem.core.config.section`: the base of every section;
- :mod:`~tandem.core.config.run`: the flow's sections (run, staleness, flow, roles, train,
  rollout, validation, observability);
- :mod:`~tandem.core.config.workloads`: the task and its rewards, images, episodes;
- :mod:`~tandem.core.config.engines` (with :mod:`~tandem.core.config.lora`, its adapter section),
  :mod:`~tandem.core.config.algorithm`, :mod:`~tandem.core.config.cluster`,
  :mod:`~tandem.core.config.teacher`: those sections, each with the rules it imposes on the rest
  (a rollout placement's needs, the loss's inputs, a Ray cluster's limits, what distillation needs);
- :mod:`~tandem.core.config.schema`: ``TandemConfig``, the whole run, which runs those rules;
- :mod:`~tandem.core.config.loading`: YAML, overrides, errors that name the field;
- :mod:`~tandem.core.config.errors`: ``ConfigError`` and ``import_named``.

Import from here: the names below are the config's API wherever they live.

The names load on first use (PEP 562): a process that needs one small part (a reward worker
imports ``import_named`` and nothing else of the config) does not build every section's model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.core.lazy import lazy_names

if TYPE_CHECKING:
    from tandem.core.config.algorithm import AlgorithmConfig
    from tandem.core.config.cluster import POOL_ROLES, ClusterConfig, ParamSyncConfig
    from tandem.core.config.engines import (
        FAULT_ROLES,
        EnginesConfig,
        FakeEnginesConfig,
        FaultSpec,
        RolloutServersConfig,
        SecretSource,
        TorchEnginesConfig,
        VllmConfig,
        is_loopback,
    )
    from tandem.core.config.errors import ConfigError, import_named
    from tandem.core.config.loading import apply_overrides, load_config, validate_config
    from tandem.core.config.lora import LoraConfig
    from tandem.core.config.run import (
        DEFAULT_STAGES,
        ROLE_NAMES,
        FlowConfig,
        LatencySpec,
        ObservabilityConfig,
        RoleConfig,
        RolloutConfig,
        RunConfig,
        StalenessConfig,
        TrainConfig,
        ValidationConfig,
    )
    from tandem.core.config.schema import TandemConfig
    from tandem.core.config.teacher import TeacherConfig
    from tandem.core.config.workloads import AgenticConfig, DiffusionConfig, RewardFunctionConfig, TaskConfig

_HOMES = {
    "DEFAULT_STAGES": "tandem.core.config.run",
    "FAULT_ROLES": "tandem.core.config.engines",
    "POOL_ROLES": "tandem.core.config.cluster",
    "ROLE_NAMES": "tandem.core.config.run",
    "AgenticConfig": "tandem.core.config.workloads",
    "AlgorithmConfig": "tandem.core.config.algorithm",
    "ClusterConfig": "tandem.core.config.cluster",
    "ConfigError": "tandem.core.config.errors",
    "DiffusionConfig": "tandem.core.config.workloads",
    "EnginesConfig": "tandem.core.config.engines",
    "FakeEnginesConfig": "tandem.core.config.engines",
    "FaultSpec": "tandem.core.config.engines",
    "FlowConfig": "tandem.core.config.run",
    "LatencySpec": "tandem.core.config.run",
    "LoraConfig": "tandem.core.config.lora",
    "ObservabilityConfig": "tandem.core.config.run",
    "ParamSyncConfig": "tandem.core.config.cluster",
    "RewardFunctionConfig": "tandem.core.config.workloads",
    "RoleConfig": "tandem.core.config.run",
    "RolloutConfig": "tandem.core.config.run",
    "RolloutServersConfig": "tandem.core.config.engines",
    "RunConfig": "tandem.core.config.run",
    "SecretSource": "tandem.core.config.engines",
    "StalenessConfig": "tandem.core.config.run",
    "TandemConfig": "tandem.core.config.schema",
    "TaskConfig": "tandem.core.config.workloads",
    "TeacherConfig": "tandem.core.config.teacher",
    "TorchEnginesConfig": "tandem.core.config.engines",
    "TrainConfig": "tandem.core.config.run",
    "ValidationConfig": "tandem.core.config.run",
    "VllmConfig": "tandem.core.config.engines",
    "apply_overrides": "tandem.core.config.loading",
    "import_named": "tandem.core.config.errors",
    "is_loopback": "tandem.core.config.engines",
    "load_config": "tandem.core.config.loading",
    "validate_config": "tandem.core.config.loading",
}

__all__ = [
    "DEFAULT_STAGES",
    "FAULT_ROLES",
    "POOL_ROLES",
    "ROLE_NAMES",
    "AgenticConfig",
    "AlgorithmConfig",
    "ClusterConfig",
    "ConfigError",
    "DiffusionConfig",
    "EnginesConfig",
    "FakeEnginesConfig",
    "FaultSpec",
    "FlowConfig",
    "LatencySpec",
    "LoraConfig",
    "ObservabilityConfig",
    "ParamSyncConfig",
    "RewardFunctionConfig",
    "RoleConfig",
    "RolloutConfig",
    "RolloutServersConfig",
    "RunConfig",
    "SecretSource",
    "StalenessConfig",
    "TandemConfig",
    "TaskConfig",
    "TeacherConfig",
    "TorchEnginesConfig",
    "TrainConfig",
    "ValidationConfig",
    "VllmConfig",
    "apply_overrides",
    "import_named",
    "is_loopback",
    "load_config",
    "validate_config",
]

__getattr__, __dir__ = lazy_names(globals(), _HOMES)
