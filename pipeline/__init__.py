"""tandem's application layer and public API: the flow, its config, and the result it returns.

What it owns: :class:`AsyncTrainingFlow` (the stage graph under one supervisor), the builders
that pick engines and tasks from config, the CLI, the Prometheus metrics, logging and the run
report. What it may import: everything below it (``core`` and the parts: ``state_machines``,
``engines``, ``param_sync``, ``algorithms``, ``tasks``); nothing imports it but ``benchmarks``,
``tests`` and users.
"""

from __future__ import annotations

from tandem.core.config import ConfigError, TandemConfig, load_config, validate_config
from tandem.pipeline.flow import AsyncTrainingFlow, FlowResult

__all__ = ["AsyncTrainingFlow", "ConfigError", "FlowResult", "TandemConfig", "load_config", "validate_config"]
