"""The synchronous RL loop written out by hand: the reference a k = 0 flow must reproduce.

generate a batch -> proximal log-probs -> rewards -> advantages -> one train step -> load the new
weights, step after step, on the same components, prompts and sampling seeds as the flow uses.
"""

from __future__ import annotations

from itertools import islice

from tandem.algorithms import PolicyObjective, compute_advantages
from tandem.core.components import Components
from tandem.core.config import TandemConfig
from tandem.core.protocols import RolloutRequest
from tandem.core.records import PromptGroup, TrajectoryGroup
from tandem.state_machines.generate import request_seed


async def synchronous_baseline(config: TandemConfig, components: Components) -> list[list[TrajectoryGroup]]:
    """Run ``max_steps`` synchronous steps; return the groups trained at each step."""
    per_step, n, seed = config.train.prompts_per_step, config.rollout.samples_per_prompt, config.run.seed
    algo = config.algorithm
    source = components.prompts(seed)
    trained: list[list[TrajectoryGroup]] = []
    for step in range(config.run.max_steps):
        groups = [PromptGroup(step * per_step + i, item, n, step=step) for i, item in enumerate(islice(source, per_step))]
        requests = [RolloutRequest(g, i, request_seed(seed, g.prompt_id, i)) for g in groups for i in range(n)]
        done = {(t.prompt_id, t.index): t async for t in components.workflow.rollout(requests)}
        batch = [TrajectoryGroup(g, [done[(g.prompt_id, i)] for i in range(n)]) for g in groups]
        flat = [t for g in batch for t in g.trajectories]
        if "logp" in config.flow.stages:
            for trajectory, lp in zip(flat, await components.trainer.logprobs(flat), strict=True):
                trajectory.prox_logprobs, trajectory.prox_version = lp, step
        results = await components.reward.score(flat, [g.group for g in batch for _ in g.trajectories])
        for trajectory, result in zip(flat, results, strict=True):
            trajectory.reward = result.reward
        rewards = [[t.reward for t in g.trajectories] for g in batch]
        options = {"normalize_std": algo.normalize_std} if algo.advantage == "grpo" else {}
        for group, advantages in zip(batch, compute_advantages(algo.advantage, rewards, **options), strict=True):
            for trajectory, advantage in zip(group.trajectories, advantages.tolist(), strict=True):
                trajectory.advantage = advantage
        await components.trainer.train_step(flat, PolicyObjective(algo))
        await components.weight_sync.sync(step + 1)
        trained.append(batch)
    return trained
