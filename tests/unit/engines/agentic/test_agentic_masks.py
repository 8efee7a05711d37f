"""No environment token ever carries a gradient: checked on the loss's gradient in the real torch trainer."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from agentic_for_tests import ScriptedEnvironment, first_observation

from tandem.algorithms import PolicyObjective
from tandem.core.config import AlgorithmConfig
from tandem.core.environment import EnvironmentRunner
from tandem.core.protocols import RolloutRequest, SamplingParams
from tandem.core.records import PromptGroup, TaskItem, Trajectory
from tandem.engines.agentic import EnvironmentManager, WorkflowContext
from tandem.engines.shared.tokenizer import load_tokenizer
from tandem.engines.text.rollout import HFRolloutEngine
from tandem.engines.trainers.torch_train import TorchTrainEngine


async def episodes(model_dir: Path, seeds: list[int]) -> list[Trajectory]:
    runner = EnvironmentRunner(timeout_s=5.0)
    try:
        async with HFRolloutEngine(str(model_dir)) as engine:
            workflow = EnvironmentManager(WorkflowContext(
                engine=engine, tokenizer=load_tokenizer(model_dir), sampling=SamplingParams(max_new_tokens=3),
                context_tokens=512, max_episodes=8, environments=runner,
                environment=functools.partial(ScriptedEnvironment, turns=3),
            ))
            groups = [PromptGroup(i, TaskItem(first_observation(s), meta={"seed": s}), 1) for i, s in enumerate(seeds)]
            return [t async for t in workflow.rollout([RolloutRequest(g, 0, seed=g.prompt_id) for g in groups])]
    finally:
        runner.shutdown()


async def test_the_loss_gradient_is_zero_on_every_environment_token_and_not_on_the_models(model_dir: Path) -> None:
    played = await episodes(model_dir, [1, 2, 3])
    objective = PolicyObjective(AlgorithmConfig(decoupled=False))
    async with TorchTrainEngine(str(model_dir), lr=1e-6) as trainer:
        # d(loss)/d(logits) at each position, captured as the backward pass goes through the LM head.
        gradients: list[torch.Tensor] = []

        def keep_gradient(_: object, __: Any, logits: torch.Tensor) -> None:
            logits.register_hook(lambda grad: gradients.append(grad.detach().clone()))

        trainer.model.lm_head.register_forward_hook(keep_gradient)
        for sign, episode in zip([1.0, -1.0, 1.0], played):
            episode.advantage = sign
            gradients.clear()
            await trainer.train_step([episode], objective)  # one episode per step: one row, no padding
            [gradient] = gradients
            # The logits kept are those predicting response token 0 onwards (row i predicts token i).
            per_token = gradient[0, : episode.num_actions].abs().sum(-1)
            mask = torch.tensor(episode.loss_mask, dtype=torch.bool)
            assert (~mask).sum() == 6 and mask.sum() == 9  # two observations, three turns
            assert torch.all(per_token[~mask] == 0.0), per_token  # exactly zero: no gradient at all
            assert torch.all(per_token[mask] > 0.0), per_token
