"""tandem's public API: the flow, its config, and the result it returns."""

from pipeline.config import ConfigError, TandemConfig, load_config, validate_config
from pipeline.flow import AsyncTrainingFlow, FlowResult

__all__ = ["AsyncTrainingFlow", "ConfigError", "FlowResult", "TandemConfig", "load_config", "validate_config"]
