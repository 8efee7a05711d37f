"""Builds what a config asks for: the task, its reward, and the engines of its workload.

What it owns: the one place that joins a task to engines. A task names its trajectory kind;
``WORKLOADS`` maps (engine backend, kind) to the builder of that workload's component bundle,
imported only when named (so a fake run never imports torch). A new workload is a new entry
here and its own modules: the flow, the roles and other workloads do not change.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

from tandem.core.components import Components, PromptSource, TaskSetup
from tandem.core.config import ConfigError, TandemConfig, import_named
from tandem.core.records import Trajectory
from tandem.core.task import RewardFunction, Task, held_out_measure
from tandem.engines.rewards import TaskReward
from tandem.tasks.dataset import FileItems
from tandem.tasks.registry import load_task

__all__ = [
    "WORKLOADS",
    "build_components",
    "build_reward",
    "load_config_task",
    "reward_functions",
    "training_items",
    "with_task_model",
]

# (engines.type, task kind) -> "module:function" building the bundle from (config, TaskSetup).
# The backend is ``engines.type``, or ``ray`` for the torch engines as Ray actors.
WORKLOADS: dict[tuple[str, str], str] = {
    ("fake", "text"): "tandem.engines.fake:build_fake_components",
    ("torch", "text"): "tandem.engines.build:build_text_components",
    ("ray", "text"): "tandem.engines.ray.build:build_ray_components",
    ("torch", "image"): "tandem.engines.diffusion.build:build_image_components",
    ("ray", "image"): "tandem.engines.ray.image:build_ray_image_components",
    ("torch", "episode"): "tandem.engines.agentic.build:build_episode_components",
    ("ray", "episode"): "tandem.engines.agentic.build:build_ray_episode_components",
}

# How each kind's trajectories are shown to reward functions.
RENDERERS: dict[str, Callable[[Trajectory], Any]] = {
    "text": lambda trajectory: trajectory.payload.text,
    "image": lambda trajectory: trajectory.payload.image,  # numpy [C, H, W] (engines.diffusion.payload)
    "episode": lambda trajectory: trajectory.payload,  # engines.agentic.EpisodePayload: tokens, text, turns, env rewards
}


def load_config_task(config: TandemConfig) -> Task:
    """The task ``task.name`` names, built with ``task.options`` (``synthetic`` when unnamed)."""
    return load_task(config.task.name or "synthetic", config.task.options)


def reward_functions(config: TandemConfig, task: Task) -> list[RewardFunction]:
    """``task.rewards`` if the config names any, else the task's own."""
    if not config.task.rewards:
        return task.rewards()
    return [
        RewardFunction(r.name or r.fn.partition(":")[2], r.fn, r.weight, r.runner)
        for r in config.task.rewards
    ]


def build_reward(config: TandemConfig, task: Task, kind: str) -> TaskReward:
    """The task's weighted reward functions, rendering trajectories of ``kind``."""
    try:
        return TaskReward(
            reward_functions(config, task), RENDERERS[kind],
            timeout_s=config.task.reward_timeout_s, workers=config.task.reward_workers,
        )
    except ValueError as err:
        raise ConfigError(f"task.rewards: {err}") from None


def with_task_model(config: TandemConfig, task: Task) -> TandemConfig:
    """The config with ``engines.model_path`` filled from the task's shipped model when the
    config names none (engines read one path, whoever chose it)."""
    engines = config.engines
    if getattr(engines, "model_path", "unset") is not None or task.model_path is None:
        return config
    return config.model_copy(update={"engines": engines.model_copy(update={"model_path": task.model_path})})


def training_items(config: TandemConfig, task: Task) -> PromptSource:
    """The items to train on: ``task.data_path``'s rows if the config names a file, else the task's."""
    if config.task.data_path is None:
        return task.items
    return FileItems(config.task.data_path, data_format=config.task.data_format)


def build_components(config: TandemConfig) -> Components:
    """The component bundle the config describes (local engines, or Ray actors)."""
    backend = config.engines.type
    if config.cluster.backend == "ray":
        if importlib.util.find_spec("ray") is None:
            raise ConfigError("cluster.backend=ray needs Ray: pip install 'tandem[ray]' (make installs it)")
        backend = "ray"
    task = load_config_task(config)
    # The fake engines are a workload of their own: token trajectories for any task's items.
    kind = "text" if backend == "fake" else task.kind
    target = WORKLOADS.get((backend, kind))
    if target is None:
        raise ConfigError(
            f"task {task.name!r} produces {kind} trajectories, which engines.type={backend!r} does not run; "
            f"workloads: {sorted(WORKLOADS)}"
        )
    if not config.rollout.with_reward and kind != "image":
        raise ConfigError(f"rollout.with_reward=false: the {kind} workflows always stream (the image workload implements it)")
    config = with_task_model(config, task)
    items = training_items(config, task)
    reward = build_reward(config, task, kind)
    builder: Callable[[TandemConfig, TaskSetup], Components] = import_named(target, "engines.type")
    try:
        components = builder(config, TaskSetup(task, items, reward))
    except BaseException:
        reward.close()
        raise
    components.close_callbacks.append(reward.close)
    components.held_out_measure = held_out_measure(task, [f.name for f in reward_functions(config, task)])
    return components
