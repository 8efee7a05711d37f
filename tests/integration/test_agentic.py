"""Agentic RL on the shipped FrozenLake agent (CPU): k = 0 is a hand-written synchronous
multi-turn loop, a workflow written here trains end to end, and the default job learns."""

from __future__ import annotations

import asyncio
from itertools import islice
from typing import Any

import pytest

from tandem.algorithms import PolicyObjective, compute_advantages
from tandem.core.components import Components
from tandem.core.config import TandemConfig, load_config
from tandem.core.protocols import GenerationRequest, RolloutEngine, SamplingParams
from tandem.core.records import FinishReason, PromptGroup, TaskItem, Trajectory, TrajectoryGroup
from tandem.engines.agentic import AgentWorkflow, EpisodeEngine, EpisodePayload, turn_seed
from tandem.pipeline import AsyncTrainingFlow
from tandem.pipeline.builders import build_components
from tandem.state_machines.generate import request_seed
from tandem.tasks.frozenlake import HELD_OUT_MAPS, HELD_OUT_SEEDS, MODEL_DIR, FrozenLakeEnvironment, parse_action
from tests.integration.test_torch_flow import Recording, grouped, weights

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(), reason="the shipped FrozenLake model is missing"),
]

CONFIG = "configs/agentic_frozenlake.yaml"
SMALL = [
    "run.max_steps=3",
    "run.seed=1",
    "train.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "engines.generation_threads=1",
    "engines.train_threads=1",
    "validation.every_versions=null",
    "observability.metrics_port=null",
    "observability.write_run_dir=false",
    "observability.trace=false",
]


async def play_by_hand(engine: RolloutEngine, tokenizer: Any, group: PromptGroup, index: int, seed: int) -> Trajectory:
    """One episode, the transcript format written out: reset, then turn by turn, each turn one
    generation request on the whole transcript so far, its observation appended unless it ended."""
    eot = tokenizer.eos_token_id
    environment = FrozenLakeEnvironment()
    prompt = tokenizer(environment.reset(group.item.meta["seed"]))["input_ids"]
    response: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    mask: list[int] = []
    rewards: list[float] = []
    actions: list[str] = []
    for turn in range(environment.max_turns):
        request = GenerationRequest(group.prompt_id, index, prompt + response, SamplingParams(2, 1.0), turn_seed(seed, turn))
        [sampled] = [t async for t in engine.generate([request])]
        ids = sampled.payload.response_ids
        response += ids
        logprobs += sampled.behaviour_logprobs
        versions += sampled.versions
        mask += [1] * len(ids)
        actions.append(tokenizer.decode(ids[:-1] if ids[-1] == eot else ids, skip_special_tokens=False))
        result = environment.step(actions[-1])
        rewards.append(result.reward)
        if result.terminated or result.truncated:
            break
        observation = tokenizer(result.observation, add_special_tokens=False)["input_ids"]
        response += observation
        logprobs += [0.0] * len(observation)
        versions += [versions[-1]] * len(observation)
        mask += [0] * len(observation)
    return Trajectory(
        prompt_id=group.prompt_id, index=index, behaviour_logprobs=logprobs, versions=versions, start_version=versions[0],
        finish_reason=FinishReason.STOP if result.terminated else FinishReason.TRUNCATED,
        payload=EpisodePayload(prompt, response, actions=actions, env_rewards=rewards), loss_mask=mask,
    )


async def synchronous_multi_turn_loop(config: TandemConfig, components: Components) -> list[list[TrajectoryGroup]]:
    """generate every episode of a step -> proximal log-probs -> rewards -> advantages -> one
    train step -> load the new weights, ``max_steps`` times, written out without the flow."""
    engine = components.workflow.context.engine  # type: ignore[attr-defined]
    tokenizer = components.workflow.context.tokenizer  # type: ignore[attr-defined]
    per_step, n, seed = config.train.prompts_per_step, config.rollout.samples_per_prompt, config.run.seed
    source = components.prompts(seed)
    trained: list[list[TrajectoryGroup]] = []
    for step in range(config.run.max_steps):
        groups = [PromptGroup(step * per_step + i, item, n, step=step) for i, item in enumerate(islice(source, per_step))]
        episodes = await asyncio.gather(*(
            play_by_hand(engine, tokenizer, g, i, request_seed(seed, g.prompt_id, i)) for g in groups for i in range(n)
        ))
        batch = [TrajectoryGroup(g, list(episodes[j * n : (j + 1) * n])) for j, g in enumerate(groups)]
        flat = [t for g in batch for t in g.trajectories]
        for trajectory, lp in zip(flat, await components.trainer.logprobs(flat), strict=True):
            trajectory.prox_logprobs, trajectory.prox_version = lp, step
        results = await components.reward.score(flat, [g.group for g in batch for _ in g.trajectories])
        for trajectory, result in zip(flat, results, strict=True):
            trajectory.reward = result.reward
        advantages = compute_advantages("grpo", [[t.reward for t in g.trajectories] for g in batch], normalize_std=True)
        for group, values in zip(batch, advantages, strict=True):
            for trajectory, advantage in zip(group.trajectories, values.tolist(), strict=True):
                trajectory.advantage = advantage
        await components.trainer.train_step(flat, PolicyObjective(config.algorithm))
        await components.weight_sync.sync(step + 1)
        trained.append(batch)
    return trained


def test_k0_reproduces_a_hand_written_synchronous_multi_turn_loop() -> None:
    cfg = load_config(CONFIG, [*SMALL, "staleness.max_staleness=0"])
    flow_components = build_components(cfg)
    recorder = Recording(flow_components.trainer)
    initial = weights(flow_components.trainer)
    try:
        asyncio.run(AsyncTrainingFlow(cfg, flow_components).run())
        flow_weights = weights(flow_components.trainer)
    finally:
        flow_components.close()
    loop_components = build_components(cfg)
    try:
        baseline = asyncio.run(synchronous_multi_turn_loop(cfg, loop_components))
        loop_weights = weights(loop_components.trainer)
    finally:
        loop_components.close()

    assert len(recorder.batches) == len(baseline) == cfg.run.max_steps
    turns = set()
    for flow_batch, loop_batch in zip(recorder.batches, baseline, strict=True):
        flow_groups = grouped(flow_batch)
        assert [g[0].prompt_id for g in flow_groups] == [g.prompt_id for g in loop_batch]
        for fg, lg in zip(flow_groups, loop_batch, strict=True):
            assert [t.payload.prompt_ids for t in fg] == [t.payload.prompt_ids for t in lg.trajectories]
            assert [t.payload.response_ids for t in fg] == [t.payload.response_ids for t in lg.trajectories]
            assert [t.loss_mask for t in fg] == [t.loss_mask for t in lg.trajectories]
            assert [t.reward for t in fg] == [t.reward for t in lg.trajectories]
            assert {v for t in fg for v in t.versions} == {lg.step}
            turns |= {t.metrics["turns"] for t in fg}
    rewards = [t.reward for batch in baseline for g in batch for t in g.trajectories]
    assert 0 < sum(rewards) < len(rewards) and len(turns) > 3  # mixed outcomes, episodes of many lengths
    update = max((flow_weights[k] - initial[k]).abs().max().item() for k in initial)
    assert update > 1e-5  # it trained
    # Same tokens and rewards; the weights differ by float rounding only (log-probs scored in
    # other micro-batches), far below the update a different schedule would make.
    difference = max((flow_weights[k] - loop_weights[k]).abs().max().item() for k in flow_weights)
    assert difference < 0.1 * update, (difference, update)


class RetryingPlayer(AgentWorkflow):
    """A workflow written here: FrozenLake played in-process (it costs microseconds a step), a
    malformed action sampled again (up to twice, the discarded samples left out of the transcript),
    and a metric of its own."""

    async def run(self, engine: EpisodeEngine, item: TaskItem) -> Trajectory:
        environment = self.context.environment()  # type: ignore[misc]
        episode = engine.trajectory(engine.encode(environment.reset(item.meta["seed"]), first=True))
        rewards: list[float] = []
        retries = 0
        while True:
            turn = await engine.generate(episode.context)
            while parse_action(turn.text) is None and retries < 2:
                retries += 1
                turn = await engine.generate(episode.context)
            episode.add_completion(turn)
            result = environment.step(turn.text)
            rewards.append(result.reward)
            if result.terminated or result.truncated:
                finish = FinishReason.STOP if result.terminated else FinishReason.TRUNCATED
                return episode.build(finish, env_rewards=rewards, metrics={"retries": float(retries)})
            episode.add_tokens(engine.encode(result.observation))


def test_a_workflow_written_in_a_test_module_trains_end_to_end() -> None:
    cfg = load_config(CONFIG, [*SMALL, "run.max_steps=2", f"agentic.workflow={__name__}:RetryingPlayer"])
    components = build_components(cfg)
    assert isinstance(components.workflow, RetryingPlayer)
    recorder = Recording(components.trainer)
    before = weights(components.trainer)
    try:
        result = asyncio.run(AsyncTrainingFlow(cfg, components).run())
        after = weights(components.trainer)
    finally:
        components.close()
    assert result.total_steps == 2 and result.ledger["balanced"] and result.ledger["trained"] == 8
    trained = [t for batch in recorder.batches for t in batch]
    assert all(set(t.metrics) == {"retries"} for t in trained)
    assert result.steps[-1].rollout_metrics.keys() == {"retries"}  # its metric reached the step record
    for t in trained:  # each turn (action + <eot>) trained, each observation (25 tokens) masked
        assert t.loss_mask == ([1, 1] + [0] * 25) * (len(t.loss_mask) // 27) + [1, 1]
        assert t.reward == t.payload.env_return
    assert max((after[k] - before[k]).abs().max().item() for k in before) > 0


def held_out_success(model_path: Any, maps: int = HELD_OUT_MAPS) -> float:
    """Sampled (temperature 1, sampling seed 0) success on the first ``maps`` held-out maps, all
    of them by default: layouts training never plays."""
    from transformers import AutoModelForCausalLM

    from tandem.engines.shared.tokenizer import load_tokenizer
    from tandem.tasks.frozenlake.play import play, summarize

    model = AutoModelForCausalLM.from_pretrained(model_path)
    return summarize(play(model, load_tokenizer(model_path), list(HELD_OUT_SEEDS[:maps]), sampling_seed=0)).success


# "A reduced budget" is the default job whole (30 steps, lr 4.5e-4, run seed 0) with only its held-out
# evaluations turned off: they would add about a minute. Held-out success must rise by at least this
# much on all 1,000 held-out maps, from 0.322. Measured over run seeds 0 to 4: +0.065, +0.065, +0.069,
# +0.046, +0.043, and +0.064 for seed 0 again (+0.027 to +0.058 over seeds 0 to 2 with the former
# lr 3e-4). Fewer maps do not do: on the first 400 the shipped agent's sampled success is 0.360, 0.328
# or 0.298 by sampling seed (one estimate's sd is about 0.024, as large as the rise), and the 3e-4
# runs above read -0.013 to +0.035 there. The bar sat two standard deviations of a 1,000-map estimate
# (0.015) under seed 0's rise, and under the lowest of the five. Since turns reuse the episode's KV
# cache (the same sampling up to float rounding, which moves a run as another seed would): +0.056 and
# +0.051 for seeds 0 and 1, inside the five's range; the bar stays.
THRESHOLD = 0.03


def test_the_default_agentic_job_on_a_reduced_budget_raises_held_out_success(tmp_path: Any) -> None:
    cfg = load_config(CONFIG, [
        f"run.output_dir={tmp_path}",
        "run.name=short",
        "validation.every_versions=null",
        "observability.metrics_port=null",
        "observability.trace=false",
    ])
    result = asyncio.run(AsyncTrainingFlow(cfg).run())
    assert len(result.steps) == cfg.run.max_steps and result.ledger["balanced"] and max(result.staleness_counts) <= 1
    metrics = result.steps[-1].rollout_metrics
    assert {"turns", "env_step_s", "success", "truncated", "malformed_actions", "version_span"} <= metrics.keys()
    before = held_out_success(MODEL_DIR)
    after = held_out_success(tmp_path / "short" / "checkpoint")
    assert after >= before + THRESHOLD, (before, after)
