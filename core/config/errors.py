"""The config's error and the one way a plugin field's ``module:attr`` is imported."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ConfigError", "import_named"]


class ConfigError(ValueError):
    """An invalid config file or override; the message names the field and what is allowed."""


def import_named(path: str, field: str) -> Any:
    """The object ``path`` (``module:attribute``, the form every plugin field takes) names;
    :class:`ConfigError` naming ``field`` when the module or the attribute cannot be imported."""
    module_name, _, attribute = path.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"{field}: cannot import {path!r}: {err}") from None
