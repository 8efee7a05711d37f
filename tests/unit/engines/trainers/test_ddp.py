"""Plain torch on several ranks: a trainer group of ``DDPRank`` s (``engines.trainers.ddp``) takes the
one-process step, and shares its checkpoints with the one-process trainer.

What every group does whatever its ranks (a failing or killed rank named, no process left behind,
checkpoints across group sizes) is tested once, on FSDP2 ranks, in ``test_fsdp.py``.

The equality tests run in float64 with one sample per micro-batch: both engines then compute
the same per-sample gradients bit for bit and only the order of summing them differs, so a
weighting or reduction error shows far above the noise. (In float32, Adam's normalisation
turns ~1e-7 rounding on near-zero gradients into ~1e-4 weight differences after two steps.)
The 1e-9 bound on weights holds on any x86-64 CPU: Adam's step lr * g / (|g| + eps) has slope at
most lr / eps = 1e6 in g, and float64 rounding of gradients of size <= 1 is ~1e-16, so two CPUs'
roundings move a weight by at most ~1e-10 per step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch
from test_fsdp import max_weight_diff, per_token_advantages, spec
from test_torch_train import make_batch, plan

from tandem.algorithms import PolicyObjective
from tandem.algorithms.objective import LossMeanOver
from tandem.core.config import AlgorithmConfig
from tandem.core.records import Trajectory
from tandem.engines.trainers.group import TrainerGroup, balance
from tandem.engines.trainers.torch_train import TorchTrainEngine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EXACT = {"lr": 1e-2, "dtype": torch.float64, "max_tokens_per_micro_batch": 1}


def test_balance_gives_each_part_a_near_equal_cost() -> None:
    costs = [40, 7, 31, 12, 12, 25, 3, 18]
    shares = balance(costs, 3)
    assert sorted(i for share in shares for i in share) == list(range(len(costs)))
    # Longest first, each to the least loaded part: 148 tokens as 52/50/46 (ideal 49.3).
    assert [sum(costs[i] for i in share) for share in shares] == [52, 50, 46]
    assert balance([5], 2) == [[0], []]  # fewer samples than ranks: a rank idles


@pytest.fixture(scope="module")
def shared_two_ranks(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TrainerGroup, Path]]:
    group = TrainerGroup.local(spec(model_dir, engine="ddp", dtype="float64", lr=1e-2, max_tokens_per_micro_batch=1), 2)
    untrained = tmp_path_factory.mktemp("untrained")
    try:
        asyncio.run(group.save_state(untrained))
        yield group, untrained
    finally:
        group.close()


@pytest.fixture
async def two_ranks(shared_two_ranks: tuple[TrainerGroup, Path]) -> AsyncIterator[TrainerGroup]:
    """The module's two DDP ranks, restored to the untrained model."""
    group, untrained = shared_two_ranks
    await group.load_state(untrained)
    yield group


@pytest.mark.parametrize(
    ("aggregation", "mean_over", "batches"),
    [
        ("token-mean", "tokens", [make_batch(0), make_batch(1)]),
        ("seq-mean-token-mean", "sequences", [make_batch(0), make_batch(1)]),
        # One sample per step: rank 1 has no gradient and must not add zeros to AdamW's state.
        ("token-mean", "tokens", [make_batch(0, groups=1, n=1), make_batch(1, groups=1, n=1)]),
        ("token-mean", "tokens", [per_token_advantages(make_batch(0)), per_token_advantages(make_batch(1))]),
    ],
    ids=["token-mean", "sequence-mean", "rank-1-idle", "per-token-advantages"],
)
async def test_two_ranks_take_the_one_process_steps(
    model_dir: Path, two_ranks: TrainerGroup, aggregation: str, mean_over: LossMeanOver, batches: list[list[Trajectory]]
) -> None:
    objective = PolicyObjective(AlgorithmConfig(decoupled=False, aggregation=aggregation))
    assert objective.mean_over == mean_over
    async with TorchTrainEngine(str(model_dir), **EXACT) as one:
        for groups in batches:
            alone = await one.train_step(groups, objective)
            split = await two_ranks.train_step(groups, objective)
            assert split.keys() == alone.keys()
            for key in alone.keys() - {"micro_batches"}:  # the split into micro-batches differs
                assert split[key] == pytest.approx(alone[key], rel=1e-9, abs=1e-12), key
        assert two_ranks.version == one.version == 2
        assert max_weight_diff(one, two_ranks) < 1e-9


async def test_two_ranks_take_the_one_process_mini_batches(model_dir: Path, two_ranks: TrainerGroup) -> None:
    batch = make_batch(0, groups=4)
    objective = PolicyObjective(AlgorithmConfig(decoupled=False))
    async with TorchTrainEngine(str(model_dir), **EXACT) as one:
        alone = await one.train_step(batch, objective, plan(batch, 2))
        split = await two_ranks.train_step(batch, objective, plan(batch, 2))
        assert split.keys() == alone.keys()
        for key in alone.keys() - {"micro_batches"}:  # the split into micro-batches differs
            assert split[key] == pytest.approx(alone[key], rel=1e-9, abs=1e-12), key
        assert (split["optimizer_steps"], two_ranks.version, one.version) == (2.0, 1, 1)
        assert max_weight_diff(one, two_ranks) < 1e-9


async def test_one_process_and_two_ranks_resume_each_others_checkpoints(
    model_dir: Path, two_ranks: TrainerGroup, tmp_path: Path
) -> None:
    objective = PolicyObjective(AlgorithmConfig(decoupled=False))
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    async with TorchTrainEngine(str(model_dir), **EXACT) as one:
        await one.train_step(make_batch(0), objective)
        await one.save_state(tmp_path / "one")
        await two_ranks.load_state(tmp_path / "one")  # the one-process trainer's trainer.pt
        assert two_ranks.version == 1 and max_weight_diff(one, two_ranks) == 0
        for engine in (one, two_ranks):
            await engine.train_step(make_batch(1), objective)
        assert max_weight_diff(one, two_ranks) < 1e-9
        await two_ranks.save_state(tmp_path / "two")
        await one.load_state(tmp_path / "two")
        assert one.version == 2 and max_weight_diff(one, two_ranks) == 0
