"""tandem's application layer and public API: the flow, its config, and the result it returns.

What it owns: :class:`AsyncTrainingFlow` (the stage graph under one supervisor), the builders
that pick engines and tasks from config, the CLI, the Prometheus metrics, logging and the run
report. What it may import: everything below it (``core`` and the parts: ``state_machines``,
``engines``, ``param_sync``, ``algorithms``, ``tasks``); nothing imports it but ``benchmarks``,
``tests`` and users.

The names load on first use (PEP 562), as ``tandem``'s do: the ``tandem`` command lives in
``tandem.pipeline.cli``, and a process that only imports that module (``tandem --help``, or a
reward worker, which imports its parent's main module again) does not load the flow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.core.lazy import lazy_names

if TYPE_CHECKING:
    from tandem.core.config import ConfigError, TandemConfig, load_config, validate_config
    from tandem.pipeline.flow import AsyncTrainingFlow, FlowResult

_HOMES = {
    "AsyncTrainingFlow": "tandem.pipeline.flow",
    "ConfigError": "tandem.core.config",
    "FlowResult": "tandem.pipeline.flow",
    "TandemConfig": "tandem.core.config",
    "load_config": "tandem.core.config",
    "validate_config": "tandem.core.config",
}

__all__ = ["AsyncTrainingFlow", "ConfigError", "FlowResult", "TandemConfig", "load_config", "validate_config"]

__getattr__, __dir__ = lazy_names(globals(), _HOMES)
