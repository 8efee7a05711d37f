"""Finding a task by name: a folder under ``tasks/`` or any importable ``module:object``.

A built-in task is the package ``tasks.<name>``, which exposes ``make_task(**options) -> Task``;
adding one is adding a folder, nothing else changes. A user's task is ``module:object`` where
the object is a :class:`~core.task.Task` or a callable returning one (given the config's
``task.options`` as keyword arguments). Errors name what was looked for and what exists.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tandem.core.config import ConfigError, import_named
from tandem.core.task import Task

__all__ = ["available_tasks", "load_task"]

TASKS_DIR = Path(__file__).resolve().parent


def available_tasks() -> list[str]:
    """The built-in task names: the packages under ``tasks/``."""
    return sorted(m.name for m in pkgutil.iter_modules([str(TASKS_DIR)]) if m.ispkg)


def load_task(name: str, options: Mapping[str, Any] | None = None) -> Task:
    """The task ``name`` names, built with ``options``; ``ConfigError`` naming ``task.name`` if
    it cannot be found or is not a task."""
    options = dict(options or {})
    if ":" in name:
        target = import_named(name, "task.name")
    else:
        if name not in available_tasks():
            raise ConfigError(f"task.name: no task {name!r}; built-in: {available_tasks()} (or give module:object)")
        module = importlib.import_module(f"tandem.tasks.{name}")
        target = getattr(module, "make_task", None)
        if target is None:
            raise ConfigError(f"task.name: tasks/{name} has no make_task(**options)")
    if isinstance(target, Task) and not isinstance(target, type):
        if options:
            raise ConfigError(f"task.options: {name!r} is a ready task object and takes no options, got {sorted(options)}")
        return target
    if not callable(target):
        raise ConfigError(f"task.name: {name!r} is neither a Task nor a callable returning one")
    try:
        task = target(**options)
    except TypeError as err:
        raise ConfigError(f"task.options for {name!r}: {err}") from None
    if not isinstance(task, Task):
        raise ConfigError(f"task.name: {name!r} returned {type(task).__name__}, which is not a Task (see core.task.Task)")
    return task
