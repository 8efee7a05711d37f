"""mkdocs hook: the configuration reference, generated from the pydantic models at build time.

``docs/reference/config.md`` holds the marker ``<!-- config-reference -->``; this hook replaces it
with one section per config model, reached from ``TandemConfig`` by dotted path, and one table row
per field: its key, type, default and docstring (the models keep docstrings on their attributes,
``use_attribute_docstrings``). Generated, never written down, so it cannot drift from the code.
"""

from __future__ import annotations

import enum
import re
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from tandem.core.config import TandemConfig

MARKER = "<!-- config-reference -->"


def _models_in(annotation: Any) -> list[tuple[str, type[BaseModel]]]:
    """The config models an annotation holds, each with the path suffix it is reached by."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [("", annotation)]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is dict and len(args) == 2:
        return [(f".<name>{suffix}", model) for suffix, model in _models_in(args[1])]
    if origin in (list, tuple):
        return [(f"[]{suffix}", model) for arg in args for suffix, model in _models_in(arg)]
    return [pair for arg in args for pair in _models_in(arg)]


def _type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "None"
    if origin is typing.Literal:
        return " \\| ".join(repr(a.value if isinstance(a, enum.Enum) else a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def _default(field: Any) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "*required*"
    value = field.default if field.default_factory is None else field.default_factory()
    if isinstance(value, BaseModel):
        return "*see below*"
    if isinstance(value, enum.Enum):
        value = value.value
    return f"`{value!r}`" if not isinstance(value, Path) else f"`{str(value)!r}`"


def _cell(text: str | None) -> str:
    """One table cell: one line, Sphinx roles (``:class:`X```) as plain code, pipes escaped."""
    text = re.sub(r":\w+:(`[^`]+`)", r"\1", " ".join((text or "").split()))
    return text.replace("|", "\\|")


def _sections(model: type[BaseModel], path: str, seen: set[type[BaseModel]]) -> list[str]:
    """A model's table, then its nested models' (each model once: where it is first reached)."""
    if model in seen:
        return []
    seen.add(model)
    title = f"`{path}` ({model.__name__})" if path else "Top level"
    lines = [f"## {title}", "", _cell(model.__doc__), "",
             "| key | type | default | description |", "|---|---|---|---|"]
    nested: list[tuple[str, type[BaseModel]]] = []
    for name, field in model.model_fields.items():
        key = f"{path}.{name}" if path else name
        lines.append(f"| `{key}` | {_type_name(field.annotation)} | {_default(field)} | {_cell(field.description)} |")
        nested.extend((key + suffix, sub) for suffix, sub in _models_in(field.annotation))
    lines.append("")
    for sub_path, sub in nested:
        lines.extend(_sections(sub, sub_path, seen))
    return lines


def config_reference() -> str:
    """Markdown for every field reachable from :class:`TandemConfig`."""
    return "\n".join(_sections(TandemConfig, "", set()))


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """mkdocs' hook: fill the marker on the page that has it."""
    return markdown.replace(MARKER, config_reference()) if MARKER in markdown else markdown
