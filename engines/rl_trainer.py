"""The RL step on top of a torch train engine: group advantages, then the configured loss.

This is the ``TrainEngine`` the flow's train role drives: ``train_step(groups)`` computes each
group's advantages from its rewards (``algorithms.advantages``), stores them on the samples,
and runs one optimizer step with ``algorithms.compute_policy_loss`` under the configured
:class:`~algorithms.losses.LossConfig`. Everything else (log-probs, weights) is the engine's.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

from algorithms import LossConfig, compute_advantages, compute_policy_loss
from engines.torch_train import TorchTrainEngine
from core.config import AlgorithmConfig
from core.records import RolloutGroup, Sample

__all__ = ["RLTrainer", "loss_config"]


def loss_config(algo: AlgorithmConfig) -> LossConfig:
    """The pure-math loss config that an ``algorithm`` config section describes."""
    return LossConfig(
        name=algo.loss,
        clip_eps_low=algo.clip_eps_low,
        clip_eps_high=algo.clip_eps_high,
        dual_clip_c=algo.dual_clip_c,
        decoupled=algo.decoupled,
        behaviour_weight_cap=algo.behaviour_weight_cap,
        behaviour_weight_mode=algo.behaviour_weight_mode,
        tis_cap=algo.tis_cap,
        cispo_eps_high=algo.cispo_eps_high,
        kimi15_tau=algo.kimi15_tau,
        kl_estimator=algo.kl_estimator,
        kl_coef=algo.kl_coef,
        aggregation=algo.aggregation,
    )


class RLTrainer:
    """Implements the flow's ``TrainEngine`` protocol over a :class:`TorchTrainEngine`."""

    def __init__(self, engine: TorchTrainEngine, algo: AlgorithmConfig) -> None:
        self.engine = engine
        self._algo = algo
        self._loss_fn = functools.partial(compute_policy_loss, cfg=loss_config(algo))
        # Micro-batched gradients equal the whole-batch gradient only if each micro-batch's
        # loss is weighted the way the aggregation averages: by tokens or by sequences.
        self._mean_over = "tokens" if algo.aggregation == "token-mean" else "sequences"

    @property
    def version(self) -> int:
        return self.engine.version

    async def logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        return await self.engine.logprobs(samples)

    def _set_advantages(self, groups: Sequence[RolloutGroup]) -> None:
        rewards = []
        for group in groups:
            missing = [s.index for s in group.samples if s.reward is None]
            if missing:
                raise ValueError(f"prompt {group.prompt_id}: samples {missing} reached training without a reward")
            rewards.append([s.reward for s in group.samples])
        options = {"normalize_std": self._algo.normalize_std} if self._algo.advantage == "grpo" else {}
        for group, advantages in zip(groups, compute_advantages(self._algo.advantage, rewards, **options), strict=True):
            for sample, advantage in zip(group.samples, advantages.tolist(), strict=True):
                sample.advantage = advantage

    async def train_step(self, groups: Sequence[RolloutGroup]) -> dict[str, float]:
        self._set_advantages(groups)
        return await self.engine.train_step(groups, self._loss_fn, loss_mean_over=self._mean_over)

    async def save_state(self, folder: Path) -> None:
        await self.engine.save_state(folder)

    async def load_state(self, folder: Path) -> None:
        await self.engine.load_state(folder)
