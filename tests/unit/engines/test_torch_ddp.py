"""TorchTrainEngine with ``world_size > 1``: ranks in processes take the one-process step, and fail by name.

The equality tests run in float64 with one sample per micro-batch: both engines then compute
the same per-sample gradients bit for bit and only the order of summing them differs, so a
weighting or reduction error shows far above the noise. (In float32, Adam's normalisation
turns ~1e-7 rounding on near-zero gradients into ~1e-4 weight differences after two steps.)
The 1e-9 bound on weights holds on any x86-64 CPU: Adam's step lr * g / (|g| + eps) has slope at
most lr / eps = 1e6 in g, and float64 rounding of gradients of size <= 1 is ~1e-16, so two CPUs'
roundings move a weight by at most ~1e-10 per step.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest
import torch
from test_torch_train import Objective, make_batch, pg, pg_loss

from tandem.algorithms import PolicyObjective
from tandem.algorithms.batch import LossInputs
from tandem.algorithms.objective import LossMeanOver
from tandem.core.config import AlgorithmConfig
from tandem.core.records import Trajectory
from tandem.engines.trainers.ddp import TrainRankError, balance
from tandem.engines.trainers.torch_train import TorchTrainEngine

pytestmark = pytest.mark.timeout(60)

EXACT = {"lr": 1e-2, "dtype": torch.float64, "max_tokens_per_micro_batch": 1}


def rank_processes(besides: Sequence[BaseProcess] = ()) -> list[BaseProcess]:
    """Live rank processes of this test process, but for ``besides`` (another engine's)."""
    return [
        p for p in multiprocessing.active_children() if p.name.startswith("tandem-train-rank") and p not in besides
    ]


def fails_off_the_driver(inputs: LossInputs, *, driver_pid: int) -> tuple[torch.Tensor, dict[str, float]]:
    """A picklable loss that raises in every process but the driver's (so on rank 1 only)."""
    if os.getpid() != driver_pid:
        raise ValueError("loss exploded on a rank process")
    return pg(inputs)


def weights(engine: TorchTrainEngine) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in engine.named_tensors_for_sync()}


def max_weight_diff(a: TorchTrainEngine, b: TorchTrainEngine) -> float:
    wa, wb = weights(a), weights(b)
    return max(float((wa[name] - wb[name]).abs().max()) for name in wa)


@pytest.fixture(scope="module")
def shared_two_ranks(model_dir: Path) -> Iterator[tuple[TorchTrainEngine, dict]]:
    engine = TorchTrainEngine(str(model_dir), world_size=2, **EXACT)
    yield engine, engine.state_dict()
    engine.close()


@pytest.fixture
def two_ranks(shared_two_ranks: tuple[TorchTrainEngine, dict]) -> TorchTrainEngine:
    """The module's 2-rank engine, every rank restored to the untrained model."""
    engine, initial = shared_two_ranks
    engine.load_state_dict(initial)
    return engine


def test_balance_gives_each_part_a_near_equal_cost() -> None:
    costs = [40, 7, 31, 12, 12, 25, 3, 18]
    shares = balance(costs, 3)
    assert sorted(i for share in shares for i in share) == list(range(len(costs)))
    # Longest first, each to the least loaded part: 148 tokens as 52/50/46 (ideal 49.3).
    assert [sum(costs[i] for i in share) for share in shares] == [52, 50, 46]
    assert balance([5], 2) == [[0], []]  # fewer samples than ranks: a rank idles


def test_world_size_is_checked_before_anything_starts(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        TorchTrainEngine(str(model_dir), lr=1e-2, world_size=0)
    with pytest.raises(NotImplementedError, match="CPU only"):
        TorchTrainEngine(str(model_dir), lr=1e-2, device="cuda", world_size=2)
    others = rank_processes()
    engine = TorchTrainEngine(str(model_dir), lr=1e-2)
    assert rank_processes(besides=others) == []  # world_size=1 (the default) starts none
    engine.close()


@pytest.mark.parametrize(
    ("aggregation", "mean_over", "batches"),
    [
        ("token-mean", "tokens", [make_batch(0), make_batch(1)]),
        ("seq-mean-token-mean", "sequences", [make_batch(0), make_batch(1)]),
        # One sample per step: rank 1 has no gradient and must not add zeros to AdamW's state.
        ("token-mean", "tokens", [make_batch(0, groups=1, n=1), make_batch(1, groups=1, n=1)]),
    ],
    ids=["token-mean", "sequence-mean", "rank-1-idle"],
)
async def test_two_ranks_take_the_one_process_steps(
    model_dir: Path,
    two_ranks: TorchTrainEngine,
    aggregation: str,
    mean_over: LossMeanOver,
    batches: list[list[Trajectory]],
) -> None:
    objective = PolicyObjective(AlgorithmConfig(decoupled=False, aggregation=aggregation))
    assert objective.mean_over == mean_over
    async with TorchTrainEngine(str(model_dir), **EXACT) as one:
        for groups in batches:
            alone = await one.train_step(groups, objective)
            split = await two_ranks.train_step(groups, objective)
            assert split.keys() == alone.keys()
            for key, value in alone.items():
                assert split[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
        assert two_ranks.version == one.version == 2
        assert max_weight_diff(one, two_ranks) < 1e-9


async def test_load_state_dict_restores_every_rank(model_dir: Path, two_ranks: TorchTrainEngine) -> None:
    await two_ranks.train_step(make_batch(0), pg_loss)
    state = two_ranks.state_dict()
    for seed in (1, 2):  # move both ranks away from the checkpoint
        await two_ranks.train_step(make_batch(seed), pg_loss)

    two_ranks.load_state_dict(state)
    async with TorchTrainEngine(str(model_dir), **EXACT) as one:
        one.load_state_dict(state)
        # Two steps: the second also depends on rank 1's restored Adam moments (through its weights).
        for seed in (3, 4):
            alone = await one.train_step(make_batch(seed), pg_loss)
            split = await two_ranks.train_step(make_batch(seed), pg_loss)
            assert split["loss"] == pytest.approx(alone["loss"], rel=1e-9)
            assert split["grad_norm"] == pytest.approx(alone["grad_norm"], rel=1e-9)
        assert two_ranks.version == one.version == 3
        assert max_weight_diff(one, two_ranks) < 1e-9


async def test_a_failing_rank_fails_the_step_by_name_and_the_engine_carries_on(
    model_dir: Path, two_ranks: TorchTrainEngine
) -> None:
    with pytest.raises(TypeError, match="picklable"):
        await two_ranks.train_step(make_batch(0), Objective(lambda inputs: pg(inputs)))
    failing = functools.partial(fails_off_the_driver, driver_pid=os.getpid())
    with pytest.raises(TrainRankError, match="(?s)train rank 1 failed.*loss exploded on a rank process") as info:
        await two_ranks.train_step(make_batch(0), Objective(failing))
    assert info.value.rank == 1 and two_ranks.version == 0

    # Every rank dropped the failed step's gradient: the next step is a clean first step.
    async with TorchTrainEngine(str(model_dir), **EXACT) as one:
        await one.train_step(make_batch(1), pg_loss)
        await two_ranks.train_step(make_batch(1), pg_loss)
        assert max_weight_diff(one, two_ranks) < 1e-9


async def test_a_killed_rank_fails_the_next_step_by_name(model_dir: Path) -> None:
    others = rank_processes()
    async with TorchTrainEngine(str(model_dir), lr=1e-2, world_size=2) as engine:
        await engine.train_step(make_batch(0), pg_loss)
        [rank1] = rank_processes(besides=others)
        rank1.kill()
        rank1.join()

        start = time.monotonic()
        with pytest.raises(TrainRankError, match="train rank 1 died") as info:
            await engine.train_step(make_batch(1), pg_loss)
        assert info.value.rank == 1 and time.monotonic() - start < 3.0
        with pytest.raises(RuntimeError, match="out of step since: train rank 1 died"):
            await engine.train_step(make_batch(1), pg_loss)
        assert engine.version == 1
        assert len(await engine.logprobs(make_batch(1)[:4])) == 4  # rank 0 still scores
    assert rank_processes(besides=others) == []


def test_close_ends_every_rank_process(model_dir: Path) -> None:
    others = rank_processes()
    engine = TorchTrainEngine(str(model_dir), lr=1e-2, world_size=3)
    ranks = rank_processes(besides=others)
    assert sorted(p.name for p in ranks) == ["tandem-train-rank1", "tandem-train-rank2"]
    assert all(p.daemon for p in ranks)  # and so ended by multiprocessing if the driver exits
    engine.close()
    assert rank_processes(besides=others) == []
    assert [p.exitcode for p in ranks] == [0, 0]  # they left on end-of-file, not by a kill


DRIVER = """
import sys
from tandem.engines.trainers.torch_train import TorchTrainEngine
if __name__ == "__main__":
    engine = TorchTrainEngine(sys.argv[1], lr=1e-2, world_size=2)
    import multiprocessing
    print(*(p.pid for p in multiprocessing.active_children()), flush=True)
    sys.stdin.read()  # until the test kills us
"""


def exited(pid: int) -> bool:
    """Gone, or a zombie nobody reaps (the rank's parent, the driver, is dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_rank_processes_exit_when_the_driver_is_killed(model_dir: Path, tmp_path: Path) -> None:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    driver = subprocess.Popen(
        [sys.executable, str(script), str(model_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True, cwd=Path(__file__).resolve().parents[3],
    )  # fmt: skip
    try:
        assert driver.stdout is not None
        [rank1] = [int(pid) for pid in driver.stdout.readline().split()]
        assert not exited(rank1)
        driver.send_signal(signal.SIGKILL)  # no atexit, no close(): only the pipe's end-of-file
        driver.wait()
        deadline = time.monotonic() + 10
        while not exited(rank1) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert exited(rank1)
    finally:
        driver.kill()
        driver.wait()
