"""The synchronous RL loop written out by hand: the reference a k = 0 flow must reproduce.

generate a batch -> proximal log-probs -> rewards -> one train step -> load the new weights,
step after step, on the same components, prompts and sampling seeds as the flow uses.
"""

from __future__ import annotations

from itertools import islice

from core.protocols import GenerationRequest
from core.components import Components
from core.config import TandemConfig
from core.records import PromptGroup, RolloutGroup
from state_machines.generate import request_seed


async def synchronous_baseline(config: TandemConfig, components: Components) -> list[list[RolloutGroup]]:
    """Run ``max_steps`` synchronous steps; return the groups trained at each step."""
    per_step, n, seed = config.train.prompts_per_step, config.rollout.samples_per_prompt, config.run.seed
    source = components.prompts(seed)
    trained: list[list[RolloutGroup]] = []
    for step in range(config.run.max_steps):
        groups = [
            PromptGroup(step * per_step + i, p.prompt, p.prompt_ids, n, answer=p.answer, step=step)
            for i, p in enumerate(islice(source, per_step))
        ]
        requests = [
            GenerationRequest(g.prompt_id, i, g.prompt_ids, components.sampling, seed=request_seed(seed, g.prompt_id, i))
            for g in groups
            for i in range(n)
        ]
        samples = {(s.prompt_id, s.index): s async for s in components.rollout.generate(requests)}
        batch = [RolloutGroup(g, [samples[(g.prompt_id, i)] for i in range(n)]) for g in groups]
        flat = [s for g in batch for s in g.samples]
        if "logp" in config.flow.stages:
            for sample, lp in zip(flat, await components.trainer.logprobs(flat), strict=True):
                sample.prox_logprobs, sample.prox_version = lp, step
        results = await components.reward.score(flat, [g.group.answer for g in batch for _ in g.samples])
        for sample, result in zip(flat, results, strict=True):
            sample.reward = result.reward
        await components.trainer.train_step(batch)
        await components.weight_sync.sync(step + 1)
        trained.append(batch)
    return trained
