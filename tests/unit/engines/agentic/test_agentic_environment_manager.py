"""The environment manager on a real rollout engine (tiny model): the transcript, its masks, its
budgets, and per-token versions when the weights change mid-episode."""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from agentic_for_tests import ScriptedEnvironment, first_observation
from tiny_lm import encode

from tandem.core.environment import EnvironmentRunner
from tandem.core.protocols import RolloutRequest, SamplingParams
from tandem.core.records import FinishReason, PromptGroup, ResumePolicy, TaskItem, Trajectory
from tandem.core.trace import TraceRecorder
from tandem.engines.agentic import EnvironmentManager, EpisodePayload, WorkflowContext
from tandem.engines.shared.tokenizer import load_tokenizer
from tandem.engines.text.rollout import HFRolloutEngine
from tandem.engines.trainers.torch_train import TorchLogProbEngine
from tests.unit.engines.weights_for_tests import push_from_inside_a_step

TURN = 3  # tokens per model turn; the tiny model never stops early, so every turn has exactly these


def requests(seeds: Sequence[int], n: int = 1, first_id: int = 0) -> list[RolloutRequest]:
    groups = [PromptGroup(first_id + i, TaskItem(first_observation(s), meta={"seed": s}), n) for i, s in enumerate(seeds)]
    return [RolloutRequest(g, i, seed=1000 * g.prompt_id + i) for g in groups for i in range(n)]


async def play(workflow: EnvironmentManager, batch: list[RolloutRequest]) -> list[Trajectory]:
    return sorted([t async for t in workflow.rollout(batch)], key=lambda t: (t.prompt_id, t.index))


@pytest.fixture
async def engine(model_dir: Path) -> AsyncIterator[HFRolloutEngine]:
    async with HFRolloutEngine(str(model_dir), max_batch_size=16) as eng:
        yield eng


@pytest.fixture
def runner() -> EnvironmentRunner:
    runner = EnvironmentRunner(timeout_s=5.0)
    yield runner
    runner.shutdown()


def manager(
    engine: HFRolloutEngine, runner: EnvironmentRunner, model_dir: Path, context_tokens: int = 512, max_episodes: int = 8,
    **env: Any,
) -> EnvironmentManager:
    return EnvironmentManager(WorkflowContext(
        engine=engine, tokenizer=load_tokenizer(model_dir), sampling=SamplingParams(max_new_tokens=TURN),
        context_tokens=context_tokens, max_episodes=max_episodes, environments=runner,
        environment=functools.partial(ScriptedEnvironment, **env),
    ))


async def test_an_episode_is_its_turns_and_observations_with_only_the_turns_trained(
    engine: HFRolloutEngine, runner: EnvironmentRunner, model_dir: Path
) -> None:
    [episode] = await play(manager(engine, runner, model_dir, turns=3), requests([7]))
    payload = episode.payload
    assert isinstance(payload, EpisodePayload)
    tokens, mask = payload.response_ids, episode.loss_mask
    assert payload.prompt_ids == encode(first_observation(7))
    # turn, "b1=", turn, "b2=", turn: the last step's observation is not part of it (no turn follows)
    assert mask == [1] * TURN + [0] * 3 + [1] * TURN + [0] * 3 + [1] * TURN
    assert tokens[3:6] == encode("b1=") and tokens[9:12] == encode("b2=")
    turns = [tokens[0:3], tokens[6:9], tokens[12:15]]
    tokenizer = load_tokenizer(model_dir)
    assert payload.actions == [tokenizer.decode(t, skip_special_tokens=False) for t in turns]
    assert payload.env_rewards == [float("a" in action) for action in payload.actions]
    assert episode.finish_reason is FinishReason.STOP and payload.outcome == "terminated"
    # Environment tokens: log-prob 0, the version of the token before; every model token scored.
    assert [lp for lp, m in zip(episode.behaviour_logprobs, mask) if not m] == [0.0] * 6
    assert len(episode.versions) == len(tokens) == episode.num_actions and episode.num_trained == 9
    assert episode.metrics == {
        "turns": 3.0, "env_step_s": pytest.approx(episode.metrics["env_step_s"]), "success": float(payload.env_return > 0),
        "truncated": 0.0, "malformed_actions": 0.0, "version_span": 0.0,
        "env_turn": 3.0,  # the number the environment put in its last step's info
    }
    # Each turn was sampled with the whole episode so far as its context: the trainer, reading
    # the transcript at once, gives the model tokens the behaviour log-probs they were drawn with.
    async with TorchLogProbEngine(str(model_dir)) as scorer:
        [scored] = await scorer.logprobs([episode])
    trained = [(b, s) for b, s, m in zip(episode.behaviour_logprobs, scored, mask) if m]
    assert max(abs(b - s) for b, s in trained) < 1e-4


async def test_a_turn_limit_truncates_the_episode(engine: HFRolloutEngine, runner: EnvironmentRunner, model_dir: Path) -> None:
    [episode] = await play(manager(engine, runner, model_dir, turns=5, max_turns=2), requests([3]))
    assert episode.finish_reason is FinishReason.TRUNCATED and episode.payload.outcome == "turn_limit"
    assert episode.metrics["turns"] == 2.0 and episode.metrics["truncated"] == 1.0 and episode.metrics["success"] == 0.0


async def test_an_episode_that_would_overflow_the_context_ends_truncated(
    engine: HFRolloutEngine, runner: EnvironmentRunner, model_dir: Path
) -> None:
    prompt = len(encode(first_observation(4)))  # 4 tokens
    # Room for the prompt and one turn, not for the observation and a second turn.
    [one_turn] = await play(manager(engine, runner, model_dir, prompt + TURN + 3 + TURN - 1, turns=3), requests([4]))
    assert one_turn.finish_reason is FinishReason.TRUNCATED and one_turn.payload.outcome == "context"
    assert one_turn.loss_mask == [1] * TURN  # the observation that would not leave room for a turn is left out
    assert one_turn.metrics["truncated"] == 1.0
    # Exactly room for two turns: the episode plays them, then stops before a third.
    [two_turns] = await play(manager(engine, runner, model_dir, prompt + 2 * TURN + 3, turns=3), requests([4]))
    assert two_turns.loss_mask == [1] * TURN + [0] * 3 + [1] * TURN and two_turns.payload.outcome == "context"
    # No room for even one turn: an empty episode, not an error.
    [none] = await play(manager(engine, runner, model_dir, prompt + TURN - 1, turns=3), requests([4]))
    assert none.num_actions == 0 and none.finish_reason is FinishReason.TRUNCATED and none.failure is None


async def test_a_groups_samples_play_one_seed_and_an_episode_depends_on_its_request_alone(
    engine: HFRolloutEngine, runner: EnvironmentRunner, model_dir: Path
) -> None:
    workflow = manager(engine, runner, model_dir, turns=3)
    group = await play(workflow, requests([5], n=4))
    assert {tuple(t.payload.prompt_ids) for t in group} == {tuple(encode(first_observation(5)))}
    assert len({tuple(t.payload.response_ids) for t in group}) == 4  # the sampling differs
    # Played again, alone or beside other episodes, each episode is the same: its turns' seeds
    # come from its request, not from the batch it shared.
    crowd = await play(workflow, requests([5], n=4) + requests([6, 8], n=3, first_id=1))
    alone = await play(workflow, requests([5], n=4)[2:3])
    assert [t.payload.response_ids for t in crowd[:4]] == [t.payload.response_ids for t in group]
    assert alone[0].payload.response_ids == group[2].payload.response_ids
    # The turns of one episode draw from different seeds: with one seed for every turn, the
    # same context position would be sampled from the same random draw each turn.
    turns = [t.payload.response_ids[i : i + TURN] for t in group for i in (0, 6, 12)]
    assert len({tuple(turn) for turn in turns}) > 4


def push_at_next_prefill(engine: HFRolloutEngine, weights: dict[str, torch.Tensor]) -> tuple[asyncio.Event, list[Any]]:
    """Once the returned event is set, push ``weights`` as version 1 from inside the engine's next
    prefill: the rows it samples a turn's first token for get the rest of the turn from version 1."""
    armed = asyncio.Event()
    pushes: list[Any] = []

    def hook(_: object, args: tuple[Any, ...], kwargs: dict[str, Any], output: object) -> None:
        if armed.is_set() and not pushes and kwargs["input_ids"].shape[1] > 1:
            pushes.append(push_from_inside_a_step(engine.target, weights, version=1))

    engine.model.register_forward_hook(hook, with_kwargs=True)
    return armed, pushes


@pytest.mark.parametrize("policy", [ResumePolicy.RECOMPUTE, ResumePolicy.KEEP_CACHE])
async def test_per_token_versions_stay_exact_across_a_weight_update_mid_episode(
    model_dir: Path, v1_model_dir: Path, v1_weights: dict[str, torch.Tensor], runner: EnvironmentRunner, policy: ResumePolicy
) -> None:
    async with HFRolloutEngine(str(model_dir), max_batch_size=3, resume_policy=policy) as engine:
        # Three episodes at a time, 4 turns each: the update lands once three have finished, in
        # the first turn of a later one, while others are between turns or not started yet.
        armed, pushed = push_at_next_prefill(engine, v1_weights)
        workflow = manager(engine, runner, model_dir, max_episodes=3, turns=4)
        episodes = []
        async for episode in workflow.rollout(requests([1, 2, 3, 4, 5, 6, 7, 8])):
            episodes.append(episode)
            if len(episodes) == 3:
                armed.set()
        await asyncio.to_thread(pushed[0].join)
    episodes.sort(key=lambda t: t.prompt_id)
    async with TorchLogProbEngine(str(model_dir)) as v0, TorchLogProbEngine(str(v1_model_dir)) as v1:
        old, new = await v0.logprobs(episodes), await v1.logprobs(episodes)
    spans = set()
    mid_turn = 0
    for episode, by_v0, by_v1 in zip(episodes, old, new):
        versions, mask = episode.versions, episode.loss_mask
        assert versions == sorted(versions) and episode.start_version == versions[0]
        # A turn the update interrupted: its version changes between two of its model tokens.
        interrupted = {i for i in range(1, len(versions)) if versions[i] != versions[i - 1] and mask[i - 1]}
        turn_of = [sum(1 for j in range(1, i + 1) if mask[j] and not mask[j - 1]) for i in range(len(mask))]
        interrupted_turns = {turn_of[i] for i in interrupted}
        for i, trained in enumerate(mask):
            if not trained:  # an observation: the version of the token before it, log-prob 0
                assert versions[i] == versions[i - 1] and episode.behaviour_logprobs[i] == 0.0
                continue
            if versions[i] == 1 and turn_of[i] in interrupted_turns and policy is ResumePolicy.KEEP_CACHE:
                continue  # sampled by new weights over the old weights' cache: no policy's log-prob, as flagged
            # A model token's behaviour log-prob is the one its version's weights give it on the
            # whole episode so far: exact whether the update landed between turns or mid-turn
            # (re-encoded there under RECOMPUTE), and for every turn begun after it under either
            # policy (each turn re-encodes the whole episode: no cache outlives a turn).
            reference = by_v0 if versions[i] == 0 else by_v1
            assert abs(episode.behaviour_logprobs[i] - reference[i]) < 1e-4, (episode.prompt_id, i, versions)
        spans.add((versions[0], versions[-1]))
        changed_mid_turn = bool(interrupted)
        assert episode.resumed is (policy if changed_mid_turn else None)
        mid_turn += changed_mid_turn
        assert episode.metrics["version_span"] == versions[-1] - versions[0]
    assert spans == {(0, 0), (0, 1), (1, 1)}  # finished before, spanning the update, started after
    assert mid_turn >= 1  # the prefill that carried the update began a turn the new weights finished


async def test_environment_calls_are_spans_on_one_track_per_running_episode(
    engine: HFRolloutEngine, runner: EnvironmentRunner, model_dir: Path
) -> None:
    workflow = manager(engine, runner, model_dir, turns=2)
    trace = TraceRecorder(origin_s=asyncio.get_running_loop().time(), max_events=10_000)
    workflow.use_trace(trace)
    episodes = await play(workflow, requests([1, 2, 3], n=2))
    steps = [e for e in trace.events if e["name"] == "environment step"]
    assert len(steps) == sum(int(e.metrics["turns"]) for e in episodes) == 12
    assert sum(e["name"] == "environment reset" for e in trace.events) == 6
    by_track: dict[int, list[dict[str, Any]]] = {}
    for event in trace.events:
        by_track.setdefault(event["tid"], []).append(event)
    for events in by_track.values():  # a track's spans never overlap: the timeline draws them cleanly
        events.sort(key=lambda e: e["ts"])
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in itertools.pairwise(events))
