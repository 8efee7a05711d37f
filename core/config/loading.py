"""YAML loading, dotted command-line overrides, and validation errors that name the field (with the
closest known field for a typo)."""

from __future__ import annotations

import copy
import difflib
import math
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from tandem.core.config.errors import ConfigError
from tandem.core.config.schema import TandemConfig
from tandem.core.paths import resolve_config

__all__ = ["apply_overrides", "load_config", "validate_config"]


def _parse_value(text: str) -> Any:
    """Read an override's value as YAML, so ``1e-5``, ``true``, ``[a, b]`` and ``null`` work."""
    value = yaml.safe_load(text) if text else ""
    if isinstance(value, str) and _looks_like_float(value):
        return float(value)  # YAML 1.1 reads "1e-5" as a string
    return value


def _looks_like_float(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``dotted.key=value`` overrides to a nested dict (a copy is returned)."""
    out = copy.deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like dotted.key=value")
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node = child
        node[parts[-1]] = _parse_value(raw)
    return out


def _models_at(loc: tuple[Any, ...]) -> list[type[BaseModel]]:
    """The config models a field path ends in (several for a union not yet resolved)."""
    models: list[type[BaseModel]] = [TandemConfig]
    for part in loc:
        if isinstance(part, int):  # an item of a list: the same model(s)
            continue
        inner: list[type[BaseModel]] = []
        for model in models:
            field = model.model_fields.get(str(part))
            if field is None:  # a discriminated union's tag: keep the member it names
                inner += [model] if any(
                    typing.get_args(f.annotation) == (part,) for f in model.model_fields.values()
                ) else []
                continue
            args = typing.get_args(field.annotation) or (field.annotation,)
            for arg in args:
                for candidate in typing.get_args(arg) or (arg,):
                    if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                        inner.append(candidate)
        models = inner
    return models


def _closest_field(loc: tuple[Any, ...]) -> str | None:
    """The known field closest to an unknown one at ``loc`` (a typo's likely intent), if any."""
    names = {name for model in _models_at(loc[:-1]) for name in model.model_fields}
    close = difflib.get_close_matches(str(loc[-1]), sorted(names), n=1, cutoff=0.6)
    return ".".join(str(p) for p in (*loc[:-1], close[0])) if close else None


def _format_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            closest = _closest_field(tuple(e["loc"]))
            msg = f"unknown field; did you mean {closest}?" if closest else "unknown field"
        elif e["type"] == "literal_error" and "expected" in e.get("ctx", {}):
            msg = f"must be one of {e['ctx']['expected']}"
        lines.append(f"  {where}: {msg} (got {e.get('input')!r})")
    return "\n".join(lines)


def validate_config(data: dict[str, Any], source: str = "<dict>") -> TandemConfig:
    """Validate a nested dict, turning pydantic's errors into one ``ConfigError`` naming fields."""
    try:
        return TandemConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err, source)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> TandemConfig:
    """Load a YAML config (a path, or the name of a shipped config such as ``"default"``) and apply
    dotted overrides; raise ``ConfigError`` on any problem."""
    path = resolve_config(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    data = apply_overrides(data, overrides or [])
    return validate_config(data, str(path))
