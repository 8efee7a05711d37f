"""Builds the component bundle a config asks for; heavy backends are imported only when named."""

from __future__ import annotations

import importlib.util

from core.components import Components
from core.config import ConfigError, TandemConfig

__all__ = ["build_components"]


def build_components(config: TandemConfig) -> Components:
    if config.cluster.backend == "ray":
        if importlib.util.find_spec("ray") is None:
            raise ConfigError("cluster.backend=ray needs Ray: pip install 'tandem[ray]' (make installs it)")
        from engines.ray_components import build_ray_components

        return build_ray_components(config)
    kind = config.engines.type
    if kind == "fake":
        from engines.fake import build_fake_components

        return build_fake_components(config)
    if kind == "torch":
        from engines.torch_components import build_torch_components

        return build_torch_components(config)
    raise ValueError(f"engines.type {kind!r} has no builder")
