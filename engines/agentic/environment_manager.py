"""The environment manager: the built-in workflow (``environment``) that plays a task's environment.

Each request is one episode in a fresh environment from the task (``EnvironmentTask.environment``),
reset with the item's ``meta["seed"]`` (shared by every sample of a group), driven off the event
loop by the run's :class:`~core.environment.EnvironmentRunner` (threads or a process per episode,
each call under its timeout). Many episodes run at once (``agentic.max_episodes``); their turns
meet in the rollout engine's continuous batch.

The token sequence is the task's transcript format (``tasks/frozenlake/transcript.py`` writes
it out): the first prompt is the first observation encoded with the tokenizer's special tokens;
a model turn is one completion of at most ``rollout.max_new_tokens`` tokens, normally ending on
the end-of-turn (eos) token; the environment receives the turn's text without that token and
its next observation is appended, encoded without special tokens, as the next turn's prompt.
A model with a chat template reads each observation as a user turn through that template
instead (``EpisodeEngine.message``), so an episode is the conversation the template would render.
The observation the last step returns is not appended (no turn follows it).

The trajectory: model tokens trained, observation tokens masked out (``TrajectoryBuilder``);
``EpisodePayload`` with each turn's text and step reward; the finish reason ``STOP`` when the
environment terminated the episode, ``TRUNCATED`` at its turn limit or when the next turn would
not fit the context budget (an overflow is a truncation, never an error). ``Trajectory.metrics``:

- ``turns``: model turns; ``env_step_s``: mean seconds per environment step (the call as the
  loop waited for it);
- ``success``: 1.0 when the environment terminated the episode with a positive return;
- ``truncated``: 1.0 when it was cut short (turn limit or context budget);
- ``malformed_actions``: steps whose ``info`` has an ``error`` (an action the environment
  could not parse);
- ``version_span``: newest minus oldest policy version among its tokens (0 when one version
  played the whole episode);
- ``env_<key>`` for every number in the last step's ``info``: an environment's own per-episode
  facts (the calculator's ``tool_calls``).

Each environment call (building it, ``reset``, each ``step``) is a span on the episode's trace
track when the run traces. An environment that raises, hangs or breaks its protocol fails the
episode (:class:`~core.environment.EpisodeFailure`, handled by :class:`AgentWorkflow`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from tandem.core.environment import EnvironmentFactory, EnvironmentRunner, EpisodeFailure
from tandem.core.records import FinishReason, TaskItem, Trajectory
from tandem.engines.agentic.workflow import AgentWorkflow, EpisodeEngine, WorkflowContext

__all__ = ["EnvironmentManager", "episode_seed"]

_T = TypeVar("_T")


def episode_seed(item: TaskItem) -> int:
    """The environment seed of an item's episodes (``meta["seed"]``); a missing or non-integer
    seed fails the episode as the task's malformed output."""
    seed = (item.meta or {}).get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise EpisodeFailure("malformed", "reset", f"the item has no integer meta['seed'] (got {seed!r})")
    return seed


class EnvironmentManager(AgentWorkflow):
    """Plays each request's episode in the task's environment (see the module docstring)."""

    def __init__(self, context: WorkflowContext) -> None:
        super().__init__(context)
        if context.environments is None or context.environment is None:
            raise ValueError("the environment manager needs the task's environment and an environment runner")
        self.environments: EnvironmentRunner = context.environments
        self.environment: EnvironmentFactory = context.environment

    async def run(self, engine: EpisodeEngine, item: TaskItem) -> Trajectory:
        seed = episode_seed(item)
        turn_tokens = engine.sampling.max_new_tokens
        actions: list[str] = []
        env_rewards: list[float] = []
        step_seconds: list[float] = []
        malformed = 0
        info: dict[str, object] = {}
        outcome, finish = "context", FinishReason.TRUNCATED  # unless the environment ends it first
        loop = asyncio.get_running_loop()
        opening = loop.time()
        async with self.environments.open(self.environment) as session:
            engine.span("environment open", opening, loop.time())
            observation, _ = await _timed(engine, "environment reset", session.reset(seed))
            episode = engine.trajectory(engine.message(observation))
            while len(episode) + turn_tokens <= engine.context_tokens:
                turn = await engine.generate(episode.context)
                episode.add_completion(turn)
                actions.append(turn.text)
                result, seconds = await _timed(engine, "environment step", session.step(turn.text), turn=len(actions))
                step_seconds.append(seconds)
                env_rewards.append(result.reward)
                malformed += "error" in result.info
                info = result.info
                if result.terminated or result.truncated:
                    outcome = "terminated" if result.terminated else "turn_limit"
                    finish = FinishReason.STOP if result.terminated else FinishReason.TRUNCATED
                    break
                observation_ids = engine.message(result.observation, after=turn)
                if len(episode) + len(observation_ids) + turn_tokens > engine.context_tokens:
                    break  # no room for another turn: truncated by the context budget
                episode.add_tokens(observation_ids)
        versions = episode.versions
        metrics = {
            "turns": float(len(actions)),
            "env_step_s": sum(step_seconds) / len(step_seconds) if step_seconds else 0.0,
            "success": float(outcome == "terminated" and sum(env_rewards) > 0),
            "truncated": float(finish is FinishReason.TRUNCATED),
            "malformed_actions": float(malformed),
            "version_span": float(max(versions) - min(versions)) if versions else 0.0,
            **{f"env_{key}": float(value) for key, value in info.items() if _is_number(value)},
        }
        return episode.build(finish, actions=actions, env_rewards=env_rewards, outcome=outcome, info=info, metrics=metrics)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


async def _timed(engine: EpisodeEngine, name: str, call: Awaitable[_T], **args: object) -> tuple[_T, float]:
    """Await an environment call; its result and seconds, and a trace span (also when it fails)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        result = await call
        return result, loop.time() - started
    finally:
        engine.span(name, started, loop.time(), **args)
