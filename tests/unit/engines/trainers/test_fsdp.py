"""An FSDP2 trainer group (``engines.trainers.fsdp`` ranks in spawned processes) trains as one process does, and fails by name.

The equality tests run in float64 with one sample per micro-batch, as ``test_ddp.py``'s:
every rank then computes the same per-sample gradients bit for bit and only the order of
summing them differs, so a weighting, padding or reduction error shows far above the noise.
Ranks are processes of their own (gloo, one thread each); a group takes seconds to start, so
the groups are shared by the module and restored to the untrained state before each test.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import replace
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_torch_train import Objective, make_batch, pg, pg_loss, plan
from tiny_lm import save_tiny_model
from transformers import AutoModelForCausalLM

from tandem.algorithms import PolicyObjective
from tandem.algorithms.batch import LossInputs
from tandem.algorithms.objective import LossMeanOver
from tandem.core.config import AlgorithmConfig
from tandem.core.protocols import TrainEngine
from tandem.core.records import Trajectory
from tandem.engines.trainers import group as group_module
from tandem.engines.trainers.group import Gather, LocalRanks, RankSpec, Ready, TrainerGroup, TrainRankError
from tandem.engines.trainers.torch_train import TorchTrainEngine
from tandem.param_sync import unique_weights

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

EXACT = {"dtype": "float64", "lr": 1e-2, "max_tokens_per_micro_batch": 1}


def spec(model_dir: Path, **overrides: object) -> RankSpec:
    settings: dict = {
        "engine": "fsdp2", "model_path": str(model_dir), "device": "cpu", "dtype": "float32", "temperature": 1.0,
        "lr": 1e-2, "weight_decay": 0.0, "warmup_steps": 0, "max_grad_norm": 1.0, "max_tokens_per_micro_batch": 64,
        "num_threads": 1,
    }  # fmt: skip
    return RankSpec(**{**settings, **overrides})


def group_processes(besides: Sequence[BaseProcess] = ()) -> list[BaseProcess]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("tandem-train-rank") and p not in besides]


def weights(engine: TrainEngine) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in engine.named_tensors_for_sync()}  # type: ignore[attr-defined]


def max_weight_diff(a: TrainEngine, b: TrainEngine) -> float:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    return max(float((wa[name] - wb[name]).abs().max()) for name in wa)


def fails_on_rank_1(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """A picklable loss that raises on the group's rank 1 only (the driver never calls it)."""
    if dist.get_rank() == 1:
        raise ValueError("loss exploded on rank 1")
    return pg(inputs)


def per_token_advantages(batch: list[Trajectory]) -> list[Trajectory]:
    """The batch with a distinct advantage per token (as GAE gives) instead of one per sequence."""
    for s in batch:
        s.token_advantages = [(-1.0) ** (s.index + t) * (t + 1) / s.num_actions for t in range(s.num_actions)]
        s.advantage = None
    return batch


@pytest.fixture(scope="module")
def untrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the shared one-rank group checkpoints the untrained model as it starts (any group loads it)."""
    return tmp_path_factory.mktemp("untrained")


@pytest.fixture(scope="module")
def groups(model_dir: Path, untrained: Path) -> Iterator[dict[int, TrainerGroup]]:
    made: dict[int, TrainerGroup] = {}
    try:
        for n in (1, 2):
            made[n] = TrainerGroup.local(spec(model_dir, **EXACT), n)
        asyncio.run(made[1].save_state(untrained))  # before any test trains it
        yield made
    finally:
        for group in made.values():
            group.close()


@pytest.fixture
async def one_and_two(groups: dict[int, TrainerGroup], untrained: Path) -> AsyncIterator[tuple[TrainerGroup, TrainerGroup]]:
    for group in groups.values():
        await group.load_state(untrained)
    yield groups[1], groups[2]


@pytest.fixture
async def single_process(model_dir: Path) -> AsyncIterator[TorchTrainEngine]:
    async with TorchTrainEngine(str(model_dir), lr=1e-2, dtype=torch.float64, max_tokens_per_micro_batch=1) as engine:
        yield engine


async def test_a_group_is_a_train_engine(one_and_two: tuple[TrainerGroup, TrainerGroup]) -> None:
    assert all(isinstance(group, TrainEngine) for group in one_and_two)


@pytest.mark.parametrize(
    ("aggregation", "mean_over", "batches"),
    [
        ("token-mean", "tokens", [make_batch(0), make_batch(1)]),
        ("seq-mean-token-mean", "sequences", [make_batch(0), make_batch(1)]),
        # One sample per step: rank 1 has nothing and runs filler passes that must add nothing.
        ("token-mean", "tokens", [make_batch(0, groups=1, n=1), make_batch(1, groups=1, n=1)]),
        # Per-token advantages (GAE's): the one loss loop reads them on every trainer.
        ("token-mean", "tokens", [per_token_advantages(make_batch(0)), per_token_advantages(make_batch(1))]),
    ],
    ids=["token-mean", "sequence-mean", "rank-1-idle", "per-token-advantages"],
)
async def test_two_ranks_take_the_one_rank_and_the_one_process_steps(
    one_and_two: tuple[TrainerGroup, TrainerGroup],
    single_process: TorchTrainEngine,
    aggregation: str,
    mean_over: LossMeanOver,
    batches: list[list[Trajectory]],
) -> None:
    one, two = one_and_two
    objective = PolicyObjective(AlgorithmConfig(decoupled=False, aggregation=aggregation))
    assert objective.mean_over == mean_over
    for batch in batches:
        alone = await single_process.train_step(batch, objective)
        for group in (one, two):
            metrics = await group.train_step(batch, objective)
            assert metrics.keys() == alone.keys()
            for key in alone.keys() - {"micro_batches"}:  # the split into micro-batches differs
                assert metrics[key] == pytest.approx(alone[key], rel=1e-9, abs=1e-12), key
    assert one.version == two.version == single_process.version == 2
    assert max_weight_diff(one, two) < 1e-9
    assert max_weight_diff(single_process, two) < 1e-9


async def test_two_ranks_take_the_one_process_mini_batches(
    one_and_two: tuple[TrainerGroup, TrainerGroup], single_process: TorchTrainEngine
) -> None:
    # Two mini-batches of two groups each, one optimizer step each, inside one version: split
    # over two ranks, each optimizer step is the one-process step on its concatenated mini-batch.
    batch = make_batch(0, groups=4)
    objective = PolicyObjective(AlgorithmConfig(decoupled=False))
    alone = await single_process.train_step(batch, objective, plan(batch, 2))
    for group in one_and_two:
        metrics = await group.train_step(batch, objective, plan(batch, 2))
        assert metrics.keys() == alone.keys()
        for key in alone.keys() - {"micro_batches"}:  # the split into micro-batches differs
            assert metrics[key] == pytest.approx(alone[key], rel=1e-9, abs=1e-12), key
        assert (metrics["optimizer_steps"], metrics["optimizer_steps_total"], group.version) == (2.0, 2.0, 1)
    assert max_weight_diff(one_and_two[0], one_and_two[1]) < 1e-9
    assert max_weight_diff(single_process, one_and_two[1]) < 1e-9


async def test_log_probs_are_the_one_process_ones(
    one_and_two: tuple[TrainerGroup, TrainerGroup], single_process: TorchTrainEngine
) -> None:
    batch = make_batch(2)
    batch.append(replace(batch[0], behaviour_logprobs=[], versions=[]))  # nothing to score: stays empty
    expected, expected_entropy = await single_process.logprobs_and_entropy(batch)
    for group in one_and_two:
        logprobs, entropy = await group.logprobs_and_entropy(batch)
        assert [len(x) for x in logprobs] == [len(x) for x in expected] and logprobs[-1] == []
        assert max(abs(a - b) for x, y in zip(logprobs, expected, strict=True) for a, b in zip(x, y, strict=True)) < 1e-9
        assert max(abs(a - b) for x, y in zip(entropy, expected_entropy, strict=True) for a, b in zip(x, y, strict=True)) < 1e-9


async def test_a_checkpoint_of_two_ranks_resumes_on_one(
    one_and_two: tuple[TrainerGroup, TrainerGroup], tmp_path: Path
) -> None:
    one, two = one_and_two
    await two.train_step(make_batch(0), pg_loss)
    await two.save_state(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["trainer_fsdp2.pt"]
    await one.load_state(tmp_path)
    assert one.version == two.version == 1
    # Two steps: the second also depends on the restored Adam moments (through the weights).
    for seed in (1, 2):
        resumed = await one.train_step(make_batch(seed), pg_loss)
        continued = await two.train_step(make_batch(seed), pg_loss)
        assert resumed["loss"] == pytest.approx(continued["loss"], rel=1e-9)
        assert resumed["grad_norm"] == pytest.approx(continued["grad_norm"], rel=1e-9)
    assert one.version == two.version == 3
    assert max_weight_diff(one, two) < 1e-9


async def test_a_checkpoint_from_another_train_engine_is_refused_by_name(
    one_and_two: tuple[TrainerGroup, TrainerGroup], tmp_path: Path
) -> None:
    (tmp_path / "trainer.pt").write_bytes(b"")  # what TorchTrainEngine writes
    with pytest.raises(FileNotFoundError, match="no trainer_fsdp2.pt.*another train engine"):
        await one_and_two[0].load_state(tmp_path)


async def test_a_loss_failing_on_one_rank_fails_the_step_by_name_and_the_group_carries_on(
    one_and_two: tuple[TrainerGroup, TrainerGroup],
) -> None:
    one, two = one_and_two
    with pytest.raises(TrainRankError, match="(?s)train rank 1 failed.*loss exploded on rank 1") as info:
        await two.train_step(make_batch(0), Objective(fails_on_rank_1))
    assert info.value.rank == 1 and two.version == 0
    # Every rank dropped the failed step's gradient (rank 0 reduced nothing alone): the next
    # step is a clean first step.
    await one.train_step(make_batch(1), pg_loss)
    await two.train_step(make_batch(1), pg_loss)
    assert max_weight_diff(one, two) < 1e-9


def test_a_rank_still_silent_after_another_failed_is_named_hung_with_where_it_is(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 fails at once; rank 1 waits for it in the gather's collective (until gloo's timeout,
    minutes away). The driver does not wait that long: past the grace it names rank 1 as hung,
    quoting its stacks (written on SIGUSR1) and rank 0's failure."""
    monkeypatch.setattr(group_module, "ANSWER_AFTER_FAILURE_S", 1.0)  # rank 1 is in the gather within milliseconds
    others = group_processes()
    ranks = LocalRanks(spec(model_dir), 2)
    try:
        assert all(isinstance(reply, Ready) for reply in ranks.started())
        with pytest.raises(TrainRankError, match="train rank 1 did not answer within 1 s of rank 0's failure") as info:
            ranks.exchange(["not a message", Gather()])
        assert info.value.rank == 1
        assert " in _gather" in str(info.value)  # rank 1's stack: faulthandler's 'File "...", line N in _gather'
        assert "unexpected message 'not a message'" in str(info.value)  # rank 0's traceback
    finally:
        ranks.close(broken=True)
    assert group_processes(besides=others) == []


# ---------------------------------------------------------------- a tied model: weights out of the group


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tied"), seed=3, eos=False, tied=True)


def test_gathered_weights_equal_the_hf_state_dict_and_export_loads_back(tied_model_dir: Path, tmp_path: Path) -> None:
    hf = unique_weights(AutoModelForCausalLM.from_pretrained(tied_model_dir))
    assert "lm_head.weight" not in hf  # tied: the head travels as the embedding
    group = TrainerGroup.local(spec(tied_model_dir), 2)
    try:
        with group.weights_for_sync() as (version, gathered):
            assert version == 0
            assert gathered.keys() == hf.keys()  # gathered module by module: the root's first
            assert all(torch.equal(gathered[name], hf[name]) for name in hf)
        group.save_pretrained(tmp_path / "export")
        exported = unique_weights(AutoModelForCausalLM.from_pretrained(tmp_path / "export"))
        assert all(torch.equal(exported[name], hf[name]) for name in hf)
    finally:
        group.close()


async def test_a_killed_rank_fails_the_step_naming_it_and_one_rank_resumes_from_the_checkpoint(
    model_dir: Path, tmp_path: Path, groups: dict[int, TrainerGroup]
) -> None:
    others = group_processes()
    group = TrainerGroup.local(spec(model_dir, **EXACT), 2)
    try:
        await group.train_step(make_batch(0), pg_loss)
        await group.save_state(tmp_path)
        rank1 = next(p for p in group_processes(besides=others) if p.name == "tandem-train-rank1")
        rank1.kill()
        rank1.join()

        start = time.monotonic()
        with pytest.raises(TrainRankError, match="train rank 1 died") as info:
            await group.train_step(make_batch(1), pg_loss)
        assert info.value.rank == 1 and time.monotonic() - start < 5.0
        with pytest.raises(RuntimeError, match="out of step since: train rank 1 died"):
            await group.logprobs(make_batch(1))
        assert group.version == 1
    finally:
        group.close()
    assert group_processes(besides=others) == []  # the surviving rank was stopped too

    one, two = groups[1], groups[2]
    for resumed in (one, two):
        await resumed.load_state(tmp_path)
        assert resumed.version == 1
        await resumed.train_step(make_batch(1), pg_loss)
    assert max_weight_diff(one, two) < 1e-9
