"""``tandem config show``: a resolved config as YAML, each field with its one-line doc.

What a run will use, after the file, the overrides and every default: one ``key: value`` line per
field, nested sections indented, and the first line of the field's docstring as a comment (the
models keep their docs on their attributes, ``use_attribute_docstrings``). Keys are never in a
config (it names where to read them: ``engines.servers.api_key``), so none can print. The output
loads back as YAML (comments aside, it is the same config).
"""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

__all__ = ["render_config"]

_DOC_WIDTH = 100  # a comment longer than this is cut with an ellipsis


def render_config(config: BaseModel) -> str:
    """Every field of ``config`` (recursively), as commented YAML."""
    return "\n".join(_lines(config, indent=0)) + "\n"


def _lines(model: BaseModel, indent: int) -> list[str]:
    pad = "  " * indent
    out: list[str] = []
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        doc = _first_line(field.description)
        comment = f"  # {doc}" if doc else ""
        if isinstance(value, BaseModel):
            out.append(f"{pad}{name}:{comment}")
            out.extend(_lines(value, indent + 1))
        else:
            out.append(f"{pad}{name}: {_scalar(value)}{comment}")
    return out


def _scalar(value: Any) -> str:
    """One value as a YAML flow scalar (JSON is valid YAML): nested models as mappings."""
    return json.dumps(_plain(value))


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return {name: _plain(getattr(value, name)) for name in type(value).model_fields}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _first_line(doc: str | None) -> str:
    """The doc's first sentence-line, on one line, cut to :data:`_DOC_WIDTH`."""
    text = " ".join((doc or "").split())
    end = text.find(". ")
    first = text if end < 0 else text[: end + 1]
    return first if len(first) <= _DOC_WIDTH else first[: _DOC_WIDTH - 1] + "…"
