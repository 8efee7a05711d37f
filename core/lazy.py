"""Names of a package that load on first use (PEP 562), written once for every package that has them.

Why: ``tandem``, ``tandem.pipeline`` and ``tandem.core.config`` list what users import from
them, but a process that needs one part (a reward worker importing ``import_named``, ``tandem
--help``) must not pay for the rest. Each keeps a map from name to the module that defines it and
takes its ``__getattr__`` and ``__dir__`` from :func:`lazy_names`.

Invariant: a name is imported from its home at its first lookup and then stored in the package's
namespace, so later lookups never reach ``__getattr__``; a name not in the map is an
``AttributeError`` naming the package.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(namespace: dict[str, Any], homes: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of the package whose ``globals()`` is ``namespace``,
    loading each name of ``homes`` (name -> defining module) on first use."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        namespace[name] = value  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *namespace.get("__all__", ())})

    return __getattr__, __dir__
