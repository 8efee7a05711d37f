"""Builds the episode workload's bundle: the text workload's engines, plus environments and a workflow.

Tasks of kind ``episode`` (``core.environment.EnvironmentTask``) train a token model, so the
engines, weight sync, data and thread budgets are the text workload's
(``engines.text.build``, or ``engines.ray.build`` with the engines as Ray actors);
what differs is the rollout workflow, resolved from ``agentic.workflow``
(``engines.agentic.registry``), and the :class:`~core.environment.EnvironmentRunner` that runs
the task's environments off the event loop (``agentic.isolation``, ``agentic.env_timeout_s``,
``agentic.max_episodes``).

Budgets: ``rollout.max_new_tokens`` is a model turn's; an episode's whole token budget is the
model's context, or ``agentic.max_context_tokens`` when smaller. A first prompt must leave room
for one turn (longer ones are dropped at admission, recorded).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tandem.core.components import Components, TaskSetup
from tandem.core.config import ConfigError, TandemConfig, TorchEnginesConfig
from tandem.core.environment import EnvironmentRunner, EnvironmentTask
from tandem.core.protocols import RolloutEngine
from tandem.engines.agentic.registry import load_workflow
from tandem.engines.agentic.workflow import WorkflowContext
from tandem.engines.build import build_text_components
from tandem.engines.text.build import prompt_budget, prompt_encoder, run_tokenizer, sampling_params

__all__ = ["build_episode_components", "build_ray_episode_components", "episode_budget"]


def episode_budget(config: TandemConfig, tokenizer: Any) -> tuple[int, int]:
    """(an episode's token budget, a first prompt's): the model's context or
    ``agentic.max_context_tokens`` if smaller, and that minus one turn (``rollout.max_new_tokens``)."""
    turn = config.rollout.max_new_tokens
    context = prompt_budget(config, tokenizer) + turn  # the model's context (checks the tokenizer fits it)
    limit = config.agentic.max_context_tokens
    if limit is not None:
        if limit <= turn:
            raise ConfigError(
                f"agentic.max_context_tokens={limit} leaves no room for a prompt before a turn of "
                f"rollout.max_new_tokens={turn}"
            )
        context = min(context, limit)
    return context, context - turn


def _environment_task(setup: TaskSetup, config: TandemConfig) -> EnvironmentTask | None:
    """The task's environment side; the environment manager cannot run without one."""
    task = setup.task
    if isinstance(task, EnvironmentTask):
        return task
    if config.agentic.workflow == "environment":
        raise ConfigError(
            f"agentic.workflow=environment: task {task.name!r} has no environment() (core.environment.EnvironmentTask); "
            "name a workflow of your own (module:Class)"
        )
    return None


def _with_workflow(config: TandemConfig, setup: TaskSetup, components: Components, engine: RolloutEngine) -> Components:
    """``components`` with the configured workflow over ``engine``, and its environment runner."""
    spec = config.engines
    assert isinstance(spec, TorchEnginesConfig)
    agentic = config.agentic
    task = _environment_task(setup, config)
    tokenizer = run_tokenizer(config)
    context_tokens, max_prompt_tokens = episode_budget(config, tokenizer)
    runner = EnvironmentRunner(agentic.env_timeout_s, agentic.isolation, max_workers=agentic.max_episodes)
    try:
        workflow = load_workflow(agentic.workflow, WorkflowContext(
            engine=engine, tokenizer=tokenizer, sampling=sampling_params(config), context_tokens=context_tokens,
            max_episodes=agentic.max_episodes, task=setup.task, environments=runner,
            environment=task.environment() if task is not None else None,
            prompts=prompt_encoder(config, tokenizer, setup.items),
        ))
    except BaseException:
        runner.shutdown()
        raise
    return replace(
        components, workflow=workflow, max_prompt_tokens=max_prompt_tokens,
        close_callbacks=[*components.close_callbacks, runner.shutdown],
    )


def build_episode_components(config: TandemConfig, setup: TaskSetup) -> Components:
    """The embedded bundle of the episode workload, for a config whose ``engines.type`` is ``torch``."""
    spec = config.engines
    assert isinstance(spec, TorchEnginesConfig)
    if spec.rollout not in ("embedded", "vllm"):
        raise ConfigError(
            f"engines.rollout={spec.rollout}: the episode workload drives a rollout engine in this process (embedded or vllm)"
        )
    _environment_task(setup, config)  # before any engine starts: a task without an environment fails fast
    components = build_text_components(config, setup)
    try:
        return _with_workflow(config, setup, components, components.workflow.engine)  # type: ignore[attr-defined]
    except BaseException:
        components.close()
        raise


def build_ray_episode_components(config: TandemConfig, setup: TaskSetup) -> Components:
    """The episode workload with the engines as Ray actors: the workflow and environments stay in
    this process and drive the rollout actors turn by turn."""
    from tandem.engines.ray.build import build_ray_components

    _environment_task(setup, config)
    components = build_ray_components(config, setup)
    try:
        return _with_workflow(config, setup, components, components.workflow.engine)  # type: ignore[attr-defined]
    except BaseException:
        components.close()
        raise
