"""The workloads' sections: the task and its rewards, image sampling (diffusion) and episodes (agentic)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from tandem.core.config.section import Section

__all__ = ["AgenticConfig", "DiffusionConfig", "RewardFunctionConfig", "TaskConfig"]


class DiffusionConfig(Section):
    """The image workload (tasks of kind ``image``): Flow-GRPO's sampler and training (Liu et al. 2025)."""

    train_steps: int = Field(10, ge=1)
    """Denoising steps of a training sample; fewer than evaluation's is Flow-GRPO's denoising reduction."""
    eval_steps: int = Field(20, ge=1)
    """Denoising steps of a held-out evaluation sample (deterministic ODE sampling)."""
    noise_level: float = Field(0.7, gt=0.0)
    """``a`` in the SDE's ``sigma_t = a * sqrt(t / (1 - t))``: how much noise training samples explore with."""
    guidance_scale: float = Field(1.5, ge=0.0)
    """Classifier-free guidance ``w``, the same in sampling, evaluation and training (1 = no guidance)."""
    sde_window: int | None = Field(None, ge=1)
    """Flow-GRPO-Fast: SDE steps (the trained ones) on a window of this many consecutive steps per
    prompt group, ODE steps elsewhere; None = SDE on every step (plain Flow-GRPO)."""
    sde_window_latest_start: int | None = Field(None, ge=0)
    """Flow-GRPO-Fast: each group's window starts at a step drawn uniformly from ``[0, this]``;
    None = anywhere the window fits."""
    max_pairs_per_micro_batch: int = Field(256, ge=1)
    """(sample, step) pairs per forward/backward of the train engine (two transformer rows each under guidance)."""

    @model_validator(mode="after")
    def _window_fits(self) -> DiffusionConfig:
        if self.sde_window is not None and self.sde_window > self.train_steps:
            raise ValueError(f"diffusion.sde_window={self.sde_window} is longer than train_steps={self.train_steps}")
        if self.sde_window_latest_start is not None:
            if self.sde_window is None:
                raise ValueError("diffusion.sde_window_latest_start needs diffusion.sde_window")
            if self.sde_window_latest_start > self.train_steps - self.sde_window:
                raise ValueError(
                    f"diffusion.sde_window_latest_start must be <= train_steps - sde_window = "
                    f"{self.train_steps - self.sde_window}, got {self.sde_window_latest_start}"
                )
        return self


class AgenticConfig(Section):
    """Multi-turn episodes (tasks of kind ``episode``): the rollout workflow and the environments it plays."""

    workflow: str = "environment"
    """The rollout workflow: a built-in name (``environment``: the environment manager plays the
    task's environment; ``single_turn``: one completion per request) or ``module:Class``, a
    subclass of ``engines.agentic.AgentWorkflow`` (see ``engines/agentic/workflow.py``)."""
    max_episodes: int = Field(64, ge=1)
    """Episodes played at once (the rest wait their turn); also the environment worker threads."""
    env_timeout_s: float = Field(10.0, gt=0.0)
    """Longest an environment call (building it, ``reset``, a ``step``) may take; past it the
    episode fails as a timeout and its group is dropped with the reason."""
    isolation: Literal["thread", "process"] = "thread"
    """Where environments run: ``thread`` (worker threads of this process: cheap, for trusted
    environments) or ``process`` (a child process per episode, killed when it hangs: for
    crash- or hang-prone ones)."""
    max_context_tokens: int | None = Field(None, ge=2)
    """An episode's token budget, first prompt through last turn; an episode whose next turn
    would not fit ends as truncated. None: the model's context length."""

    @model_validator(mode="after")
    def _workflow_is_named(self) -> AgenticConfig:
        name, colon, attribute = self.workflow.partition(":")
        if not name or (colon and not attribute) or not all(part.isidentifier() for part in name.split(".")):
            raise ValueError(f"agentic.workflow must be a built-in name or 'module:Class', got {self.workflow!r}")
        return self


class RewardFunctionConfig(Section):
    """One reward function of the task's reward, by dotted path (see ``core.task``)."""

    fn: str
    """``module:function``: ``fn(response, answer, **context) -> float | RewardResult`` (or async)."""
    weight: float = 1.0
    """Its weight in the reward (the weighted sum of every function's value)."""
    name: str | None = None
    """Its name in metrics and ``Trajectory.rewards``; default the function's name."""
    runner: Literal["pool", "inline"] = "pool"
    """``pool``: in the reward worker processes under ``task.reward_timeout_s`` (a slow, hanging
    or crashing function fails only its samples); ``inline``: on the event loop (cheap checks)."""

    @model_validator(mode="after")
    def _dotted(self) -> RewardFunctionConfig:
        module, _, function = self.fn.partition(":")
        if not module or not function:
            raise ValueError(f"task.rewards: fn must be 'module:function', got {self.fn!r}")
        return self


class TaskConfig(Section):
    """The workload's data and judgement: a task plugin, optionally with other data or rewards."""

    name: str | None = None
    """A task folder under ``tasks/`` (``arithmetic``, ``synthetic``, ...) or ``module:object``
    naming a ``core.task.Task`` or a callable returning one. None: ``synthetic`` under the fake
    engines (which run any task); the model engines need a task named."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the task's factory (task-specific)."""
    data_path: Path | None = None
    """JSONL or Parquet file of rows to train on instead of the task's own items: ``{"prompt",
    "answer"}``, with ``prompt`` a string or a list of chat messages (TRL's conversational rows),
    or verl's RL rows (other columns reach rewards as ``meta``; see ``tasks.dataset``)."""
    data_format: Literal["auto", "plain", "verl"] = "auto"
    """The rows of ``data_path``: ``plain`` (the answer is the ``answer`` column), ``verl`` (it is
    ``reward_model.ground_truth``), ``auto`` (``verl`` when there is a ``reward_model`` column)."""
    system_prompt: str | None = None
    """A system message put first in every chat prompt that has none (string prompts are used as is)."""
    rewards: list[RewardFunctionConfig] = Field(default_factory=list)
    """Reward functions replacing the task's own; several are combined by their weights."""
    reward_timeout_s: float = Field(10.0, gt=0)
    """A pool reward call slower than this scores its samples as failed (reason recorded)."""
    reward_workers: int = Field(1, ge=1)
    """Worker processes of the reward pool."""


