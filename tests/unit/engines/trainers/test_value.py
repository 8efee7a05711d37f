"""TorchValueEngine: a value model from the policy's checkpoint, aligned with the actions, that
learns its returns one version per call (an optimizer step per mini-batch of the policy step's
plan), and resumes from its checkpoint."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from tandem.algorithms.objective import ValueObjective
from tandem.core.protocols import ValueEngine
from tandem.core.records import FinishReason, Trajectory, token_trajectory
from tandem.engines.shared.microbatch import collate
from tandem.engines.trainers.critic import TorchValueEngine, ValueModel


def batch(seed: int = 0, count: int = 6) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        prompt = [rng.randrange(2, 20) for _ in range(rng.randint(2, 6))]
        response = [rng.randrange(2, 20) for _ in range(rng.randint(1, 8))]
        t = token_trajectory(i, 0, prompt, response, [-1.0] * len(response), [0] * len(response), FinishReason.STOP)
        t.returns = [float(i % 2)] * len(response)  # half the trajectories worth 1, half 0
        out.append(t)
    return out


def engine(model_dir: Path, max_tokens: int = 4096) -> TorchValueEngine:
    torch.manual_seed(0)
    return TorchValueEngine(str(model_dir), lr=1e-2, max_tokens_per_micro_batch=max_tokens)


def test_values_start_at_zero_one_per_action_and_the_engine_is_a_value_engine(model_dir: Path) -> None:
    critic = engine(model_dir)
    try:
        assert isinstance(critic, ValueEngine) and critic.version == 0
        samples = batch()
        values = asyncio.run(critic.values(samples))
        assert [len(v) for v in values] == [t.num_actions for t in samples]
        assert all(v == 0.0 for row in values for v in row)  # the head starts at zero
    finally:
        critic.close()


def test_a_value_is_read_where_the_policy_reads_the_actions_log_prob(model_dir: Path) -> None:
    # The value of action t is the state before it: it must not depend on action t itself.
    model = ValueModel(str(model_dir))
    torch.nn.init.normal_(model.head.weight)
    a = token_trajectory(0, 0, [3, 4], [5, 6, 7], [-1.0] * 3, [0] * 3, FinishReason.STOP)
    b = token_trajectory(1, 0, [3, 4], [5, 6, 9], [-1.0] * 3, [0] * 3, FinishReason.STOP)
    with torch.no_grad():
        values = model(collate([a, b], [0, 1], torch.device("cpu")))
    torch.testing.assert_close(values[0, :3], values[1, :3])  # only the last action differs: no value sees it
    c = token_trajectory(2, 0, [3, 4], [5, 8, 7], [-1.0] * 3, [0] * 3, FinishReason.STOP)
    with torch.no_grad():
        other = model(collate([a, c], [0, 1], torch.device("cpu")))
    assert other[0, 1] == pytest.approx(float(values[0, 1])) and other[1, 2] != pytest.approx(float(values[0, 2]))


@pytest.mark.parametrize("max_tokens", [4096, 16])
def test_train_steps_move_values_toward_the_returns_one_version_each(model_dir: Path, max_tokens: int) -> None:
    critic = engine(model_dir, max_tokens)
    samples = batch()

    async def scenario() -> tuple[float, float, dict[str, float]]:
        def error(values: list[list[float]]) -> float:
            return sum((r - v) ** 2 for t, row in zip(samples, values, strict=True) for r, v in zip(t.returns or [], row))

        before = error(await critic.values(samples))
        metrics: dict[str, float] = {}
        for _ in range(5):
            for t, values in zip(samples, await critic.values(samples), strict=True):
                t.values = values
            metrics = await critic.train_step(samples, ValueObjective(clip_eps=10.0))
        return before, error(await critic.values(samples)), metrics

    try:
        before, after, metrics = asyncio.run(scenario())
        assert after < before and critic.version == 5
        assert {"value_loss", "value_clip_fraction", "grad_norm"} <= set(metrics)
    finally:
        critic.close()


def test_the_critic_takes_an_optimizer_step_per_mini_batch_inside_one_version(model_dir: Path) -> None:
    # The policy step's plan, two mini-batches for two epochs: as two single-step versions per
    # epoch on the halves (the same operations in the same order: equal bits on any CPU).
    samples = batch()
    for t in samples:
        t.values = [0.0] * t.num_actions
    halves = [[0, 2, 5], [1, 3, 4]]
    together, apart = engine(model_dir), engine(model_dir)

    async def scenario() -> dict[str, float]:
        metrics = await together.train_step(samples, ValueObjective(clip_eps=10.0), halves * 2)
        for half in halves * 2:
            await apart.train_step([samples[i] for i in half], ValueObjective(clip_eps=10.0))
        return metrics

    try:
        metrics = asyncio.run(scenario())
        assert (together.version, apart.version) == (1, 4)
        assert (metrics["optimizer_steps"], metrics["optimizer_steps_total"]) == (4.0, 4.0)
        expected = dict(apart.model.named_parameters())
        assert all(torch.equal(p, expected[name]) for name, p in together.model.named_parameters())
    finally:
        together.close()
        apart.close()


def test_the_critic_refuses_a_batch_without_returns(model_dir: Path) -> None:
    critic = engine(model_dir)
    samples = batch()
    for t in samples:
        t.values = [0.0] * t.num_actions
    samples[0].returns = None
    try:
        with pytest.raises(ValueError, match="returns"):
            asyncio.run(critic.train_step(samples, ValueObjective(clip_eps=0.5)))
        assert critic.version == 0
    finally:
        critic.close()


def test_save_and_load_restore_weights_optimizer_and_version(model_dir: Path, tmp_path: Path) -> None:
    samples = batch()
    for t in samples:
        t.values = [0.0] * t.num_actions
    first, second = engine(model_dir), engine(model_dir)

    async def scenario() -> tuple[list[list[float]], list[list[float]]]:
        await first.train_step(samples, ValueObjective(clip_eps=10.0))
        await first.save_state(tmp_path)
        await second.load_state(tmp_path)
        return await first.values(samples), await second.values(samples)

    try:
        mine, restored = asyncio.run(scenario())
        assert second.version == first.version == 1
        assert restored == mine and any(v != 0.0 for row in mine for v in row)
    finally:
        first.close()
        second.close()
