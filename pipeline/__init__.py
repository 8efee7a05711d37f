"""tandem's public API: the flow, its config, and the result it returns.

The flow is imported on first use (module ``__getattr__``): the engines import records and
config from this package, and an eager import of the flow here would close an import cycle
(flow -> engines -> records -> pipeline) in any process that starts from an engine module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.config import ConfigError, TandemConfig, load_config, validate_config

if TYPE_CHECKING:
    from pipeline.flow import AsyncTrainingFlow, FlowResult

__all__ = ["AsyncTrainingFlow", "ConfigError", "FlowResult", "TandemConfig", "load_config", "validate_config"]


def __getattr__(name: str) -> Any:
    if name in ("AsyncTrainingFlow", "FlowResult"):
        from pipeline import flow

        return getattr(flow, name)
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
