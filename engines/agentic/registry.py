"""The rollout workflows a config can name: the built-in ones by name, any other as ``module:Class``.

``agentic.workflow`` picks one. A name in :data:`WORKFLOWS` is a built-in: ``environment`` (the
environment manager, the default for tasks of kind ``episode``) or ``single_turn`` (one
completion per request: the text path). Anything else must be ``module:attribute`` naming an
:class:`~engines.agentic.workflow.AgentWorkflow` subclass, or any callable that takes the
:class:`~engines.agentic.workflow.WorkflowContext` and returns a
:class:`~core.protocols.RolloutWorkflow`. Errors name the config field and what exists.
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.core.config import ConfigError, import_named
from tandem.core.protocols import RolloutWorkflow
from tandem.engines.agentic.workflow import WorkflowContext
from tandem.engines.text.workflow import SingleTurnWorkflow

__all__ = ["WORKFLOWS", "load_workflow", "single_turn"]


def single_turn(context: WorkflowContext) -> SingleTurnWorkflow:
    """The single-turn text workflow over the context's engine and sampling."""
    return SingleTurnWorkflow(context.engine, context.sampling)


# Built-in workflow name -> "module:attribute" of its class or factory.
WORKFLOWS: dict[str, str] = {
    "environment": "tandem.engines.agentic.environment_manager:EnvironmentManager",
    "single_turn": "tandem.engines.agentic.registry:single_turn",
}


def load_workflow(name: str, context: WorkflowContext) -> RolloutWorkflow:
    """The workflow ``name`` names, built with ``context``; ``ConfigError`` naming ``agentic.workflow``."""
    target = WORKFLOWS.get(name, name)
    if ":" not in target:
        raise ConfigError(
            f"agentic.workflow: no built-in workflow {name!r}; built-in: {sorted(WORKFLOWS)} (or give module:Class)"
        )
    factory: Callable[[WorkflowContext], object] = import_named(target, "agentic.workflow")
    if not callable(factory):
        raise ConfigError(f"agentic.workflow: {name!r} is not a class or a function")
    try:
        workflow = factory(context)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"agentic.workflow: {name!r} cannot be built: {err}") from None
    if not isinstance(workflow, RolloutWorkflow):
        raise ConfigError(
            f"agentic.workflow: {name!r} built a {type(workflow).__name__}, which has no rollout(requests) "
            "(subclass engines.agentic.AgentWorkflow and write run)"
        )
    return workflow
