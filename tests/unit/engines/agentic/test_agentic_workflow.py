"""The workflow API: the trajectory builder's masks and versions, one trajectory per request,
episode failures confined to their group, the episode limit, and resolving workflows by name."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from tiny_lm import EOS_ID, decode, encode

from tandem.core.config import ConfigError, validate_config
from tandem.core.environment import EpisodeFailure
from tandem.core.protocols import GenerationRequest, RolloutRequest, RolloutWorkflow, SamplingParams
from tandem.core.records import FinishReason, PromptGroup, TaskItem, Trajectory, token_trajectory
from tandem.engines.agentic import (
    WORKFLOWS,
    AgentWorkflow,
    Completion,
    EnvironmentManager,
    EpisodeEngine,
    WorkflowContext,
    load_workflow,
    turn_seed,
)
from tandem.engines.text.workflow import SingleTurnWorkflow


class CharTokenizer:
    """The tiny model's character tokenizer, without loading it: ids per character, <eos> = 1."""

    eos_token_id = EOS_ID

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": encode(text)}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return decode(list(ids))


class ScriptedEngine:
    """A rollout engine that answers every prompt with the tokens of "ab" then <eos>, stamped
    with its current version; each call waits for ``gate`` (when given) so tests control timing,
    and the requests it saw are kept."""

    def __init__(self, version: int = 0) -> None:
        self.version = version
        self.requests: list[GenerationRequest] = []
        self.gate: asyncio.Event | None = None

    def generate(self, requests: Sequence[GenerationRequest]) -> AsyncIterator[Trajectory]:
        return self._stream(list(requests))

    async def _stream(self, requests: list[GenerationRequest]) -> AsyncIterator[Trajectory]:
        for request in requests:
            self.requests.append(request)
            if self.gate is not None:
                await self.gate.wait()
            ids = [*encode("ab"), EOS_ID]
            yield token_trajectory(request.prompt_id, request.index, request.prompt_ids, ids, [-0.5, -0.25, -0.125],
                                   [self.version] * 3, FinishReason.STOP)


def context(engine: ScriptedEngine, max_episodes: int = 8) -> WorkflowContext:
    return WorkflowContext(engine=engine, tokenizer=CharTokenizer(), sampling=SamplingParams(max_new_tokens=4),
                           context_tokens=256, max_episodes=max_episodes)


def requests(groups: int, n: int) -> list[RolloutRequest]:
    return [
        RolloutRequest(PromptGroup(g, TaskItem(f"{g}=", meta={"seed": g}), n), i, seed=100 * g + i)
        for g in range(groups) for i in range(n)
    ]


async def collect(workflow: RolloutWorkflow, batch: list[RolloutRequest]) -> list[Trajectory]:
    return sorted([t async for t in workflow.rollout(batch)], key=lambda t: (t.prompt_id, t.index))


class TwoTurns(AgentWorkflow):
    """A prompt, a turn, a tool's answer, a turn the workflow chooses not to train, the version bumped between."""

    async def run(self, engine: EpisodeEngine, item: TaskItem) -> Trajectory:
        episode = engine.trajectory(engine.encode(item.prompt, first=True))
        episode.add_tokens(encode("c"))  # before any turn: part of the prompt
        first = await engine.generate(episode.context)
        episode.add_completion(first)
        episode.add_tokens(encode("12"))
        self.context.engine.version += 1  # type: ignore[misc]  # a weight update between turns
        second = await engine.generate(episode.context, max_new_tokens=2)
        episode.add_completion(second, trained=False)
        return episode.build(FinishReason.STOP, actions=[first.text, second.text], env_rewards=[0.0, 1.0])


async def test_the_builder_masks_everything_but_trained_turns_and_keeps_versions_exact() -> None:
    engine = ScriptedEngine(version=3)
    [episode] = await collect(TwoTurns(context(engine)), requests(1, 1))
    assert episode.payload.prompt_ids == encode("0=c")  # tokens before the first turn extend the prompt
    turn = [*encode("ab"), EOS_ID]
    assert episode.payload.response_ids == turn + encode("12") + turn
    assert episode.loss_mask == [1, 1, 1, 0, 0, 0, 0, 0]  # the tool's answer and the untrained turn
    assert episode.behaviour_logprobs == [-0.5, -0.25, -0.125, 0.0, 0.0, -0.5, -0.25, -0.125]
    # The tool's tokens carry the version before them; the second turn the version that sampled it.
    assert episode.versions == [3, 3, 3, 3, 3, 4, 4, 4] and episode.start_version == 3
    assert episode.payload.actions == ["ab", "ab"]  # the text an environment gets: no <eos>
    assert episode.payload.env_return == 1.0 and episode.payload.text == "ab12ab"
    # Each call asked with the whole context so far, its own overrides and its own seed.
    first, second = engine.requests
    assert first.prompt_ids == encode("0=c") and second.prompt_ids == encode("0=c") + turn + encode("12")
    assert (first.params.max_new_tokens, second.params.max_new_tokens) == (4, 2)
    assert (first.seed, second.seed) == (turn_seed(0, 0), turn_seed(0, 1)) and first.seed != second.seed


def test_a_completion_older_than_the_tokens_before_it_is_refused() -> None:
    engine = ScriptedEngine()
    episode = EpisodeEngine(context(engine), requests(1, 1)[0], AgentWorkflow(context(engine)), 0).trajectory([1])
    episode.add_completion(Completion([5], [-0.1], [2], FinishReason.STOP, "a"))
    with pytest.raises(ValueError, match="version 1 after version 2"):
        episode.add_completion(Completion([5], [-0.1], [1], FinishReason.STOP, "a"))


class FailsOnGroupOne(AgentWorkflow):
    """Sample 0 of group 1 meets a broken environment after its turn, once its siblings are
    waiting for a turn that never comes. Every other episode plays one turn."""

    def __init__(self, ctx: WorkflowContext) -> None:
        super().__init__(ctx)
        self.siblings_waiting = asyncio.Semaphore(0)
        self.cancelled: list[tuple[int, int]] = []

    async def run(self, engine: EpisodeEngine, item: TaskItem) -> Trajectory:
        episode = engine.trajectory(engine.encode(item.prompt, first=True))
        request = engine.request
        if request.prompt_id == 1:
            if request.index == 0:
                episode.add_completion(await engine.generate(episode.context))
                for _ in range(2):
                    await self.siblings_waiting.acquire()
                raise EpisodeFailure("raised", "step", "ValueError: the tool broke")
            self.siblings_waiting.release()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.append((request.prompt_id, request.index))
                raise
        episode.add_completion(await engine.generate(episode.context))
        return episode.build(FinishReason.STOP)


async def test_a_failed_episode_fails_its_group_only_and_says_why() -> None:
    workflow = FailsOnGroupOne(context(ScriptedEngine()))
    done = await collect(workflow, requests(3, 3))
    assert [(t.prompt_id, t.index) for t in done] == [(g, i) for g in range(3) for i in range(3)]  # one per request
    failed = {(t.prompt_id, t.index): t.failure for t in done if t.failure is not None}
    assert failed == {
        (1, 0): "environment step raised: ValueError: the tool broke",
        (1, 1): "another episode of its group failed: environment step raised: ValueError: the tool broke",
        (1, 2): "another episode of its group failed: environment step raised: ValueError: the tool broke",
    }
    assert sorted(workflow.cancelled) == [(1, 1), (1, 2)]  # its siblings stopped playing
    for t in done:
        assert (t.num_actions == 0) if t.failure else (t.loss_mask == [1, 1, 1])


class Misbehaves(AgentWorkflow):
    async def run(self, engine: EpisodeEngine, item: TaskItem) -> Trajectory:
        if engine.request.index == 1:
            raise KeyError("a bug in the workflow")
        return engine.trajectory([1]).build(FinishReason.STOP)


async def test_a_bug_in_a_workflow_fails_the_call_and_stops_its_episodes() -> None:
    with pytest.raises(KeyError, match="a bug in the workflow"):
        await collect(Misbehaves(context(ScriptedEngine())), requests(2, 2))


class WrongIds(AgentWorkflow):
    async def run(self, engine: EpisodeEngine, item: TaskItem) -> Trajectory:
        trajectory = engine.trajectory([1]).build(FinishReason.STOP)
        trajectory.index += 1
        return trajectory


async def test_a_trajectory_for_another_request_is_an_error() -> None:
    with pytest.raises(ValueError, match="returned trajectory 0/1 for request 0/0"):
        await collect(WrongIds(context(ScriptedEngine())), requests(1, 1))


class Counting(AgentWorkflow):
    def __init__(self, ctx: WorkflowContext) -> None:
        super().__init__(ctx)
        self.running = 0
        self.most = 0

    async def run(self, engine: EpisodeEngine, item: TaskItem) -> Trajectory:
        self.running += 1
        self.most = max(self.most, self.running)
        episode = engine.trajectory([1])
        episode.add_completion(await engine.generate(episode.context))
        self.running -= 1
        return episode.build(FinishReason.STOP)


async def test_at_most_max_episodes_run_at_once_and_every_request_is_served() -> None:
    engine = ScriptedEngine()
    engine.gate = asyncio.Event()
    workflow = Counting(context(engine, max_episodes=3))
    task = asyncio.create_task(collect(workflow, requests(4, 2)))
    await asyncio.sleep(0.05)
    assert workflow.running == 3  # the rest wait for a free place
    engine.gate.set()
    assert len(await task) == 8 and workflow.most == 3


async def test_a_workflow_serves_runs_on_new_event_loops() -> None:
    workflow = Counting(context(ScriptedEngine(), max_episodes=2))
    assert len(await collect(workflow, requests(2, 2))) == 4
    # A second asyncio.run (a benchmark's next mode, a resumed run) gets fresh primitives.
    assert len(await asyncio.to_thread(asyncio.run, collect(workflow, requests(2, 2)))) == 4


def test_workflows_resolve_by_name_or_module_and_class() -> None:
    ctx = context(ScriptedEngine())
    assert set(WORKFLOWS) == {"environment", "single_turn"}
    assert isinstance(load_workflow("single_turn", ctx), SingleTurnWorkflow)
    assert isinstance(load_workflow(f"{__name__}:TwoTurns", ctx), TwoTurns)
    with pytest.raises(ConfigError, match="agentic.workflow: no built-in workflow 'enviroment'"):
        load_workflow("enviroment", ctx)
    with pytest.raises(ConfigError, match="agentic.workflow: cannot import"):
        load_workflow(f"{__name__}:Missing", ctx)
    with pytest.raises(ConfigError, match="agentic.workflow: 'environment' cannot be built: .*needs the task's environment"):
        load_workflow("environment", ctx)  # no environment in this context
    with pytest.raises(ConfigError, match="has no rollout"):
        load_workflow(f"{__name__}:not_a_workflow", ctx)
    assert issubclass(EnvironmentManager, AgentWorkflow)


def not_a_workflow(ctx: WorkflowContext) -> Any:
    return object()


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"workflow": "my module:Class"}, "agentic.workflow must be a built-in name or 'module:Class'"),
        ({"workflow": "module:"}, "agentic.workflow must be a built-in name or 'module:Class'"),
        ({"max_episodes": 0}, "agentic.max_episodes"),
        ({"env_timeout_s": 0}, "agentic.env_timeout_s"),
        ({"isolation": "docker"}, "agentic.isolation: must be one of"),
        ({"max_context_tokens": 1}, "agentic.max_context_tokens"),
        ({"max_episode": 4}, "unknown field; did you mean agentic.max_episodes"),
    ],
)
def test_an_invalid_agentic_section_fails_naming_the_field(section: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate_config({"agentic": section})
