"""A megatron-core trainer group (``engines.trainers.megatron.engine`` ranks in spawned processes) trains as one
rank, and as HF, does.

The group equality tests run in float64 with one sample per micro-batch (as ``test_fsdp.py``'s):
two data-parallel ranks compute the one-rank step up to the order of summing per-sample
gradients; tensor parallel 2 also changes the arithmetic of each sample (vocabulary-parallel
softmax, split matmuls), so its tolerances are looser. Against the HF model (``TorchTrainEngine``) the two implementations
differ in float32 rounding of the log-softmax, which Adam's first steps amplify on near-zero
gradients: that comparison is of the step's metrics and of the log-probs after training.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is an optional extra: pip install tandem[megatron]")

import torch
from test_fsdp import max_weight_diff
from test_torch_train import make_batch, pg_loss, plan
from transformers import AutoModelForCausalLM

from tandem.engines.trainers.group import RankSpec, TrainerGroup
from tandem.engines.trainers.torch_train import TorchTrainEngine
from tandem.param_sync import unique_weights

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

EXACT = {"dtype": "float64", "lr": 1e-2, "max_tokens_per_micro_batch": 1}
LAYOUTS = {"one": (1, 1), "dp2": (2, 1), "tp2": (2, 2)}  # name: (ranks, tensor-parallel size)


def spec(model_dir: Path, **overrides: object) -> RankSpec:
    settings: dict = {
        "engine": "megatron", "model_path": str(model_dir), "device": "cpu", "dtype": "float32", "temperature": 1.0,
        "lr": 1e-2, "weight_decay": 0.0, "warmup_steps": 0, "max_grad_norm": 1.0, "max_tokens_per_micro_batch": 64,
        "num_threads": 1,
    }  # fmt: skip
    return RankSpec(**{**settings, **overrides})


def max_logprob_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True))


@pytest.fixture(scope="module")
def groups(model_dir: Path) -> Iterator[dict[str, TrainerGroup]]:
    made: dict[str, TrainerGroup] = {}
    try:
        for name, (ranks, tensor_parallel) in LAYOUTS.items():
            made[name] = TrainerGroup.local(spec(model_dir, **EXACT, tensor_parallel_size=tensor_parallel), ranks)
        yield made
    finally:
        for group in made.values():
            group.close()


@pytest.fixture(scope="module")
def untrained(tmp_path_factory: pytest.TempPathFactory, groups: dict[str, TrainerGroup]) -> Path:
    folder = tmp_path_factory.mktemp("untrained")
    asyncio.run(groups["tp2"].save_state(folder))  # any layout loads it
    return folder


@pytest.fixture
async def fresh(groups: dict[str, TrainerGroup], untrained: Path) -> AsyncIterator[dict[str, TrainerGroup]]:
    for group in groups.values():
        await group.load_state(untrained)
        assert group.version == 0
    yield groups


async def test_data_and_tensor_parallel_ranks_take_the_one_rank_steps(fresh: dict[str, TrainerGroup]) -> None:
    one = fresh["one"]
    for seed in (0, 1):
        batch = make_batch(seed)
        alone = await one.train_step(batch, pg_loss)
        for name, rel in (("dp2", 1e-9), ("tp2", 1e-6)):
            metrics = await fresh[name].train_step(batch, pg_loss)
            for key in ("loss", "pg_loss", "entropy", "grad_norm", "tokens"):
                assert metrics[key] == pytest.approx(alone[key], rel=rel), (name, key)
    # Tensor parallel rounds each sample's log-softmax differently (float32): Adam's first steps
    # turn that into weight differences on near-zero gradients; the policies still agree (to the
    # log-prob parity bar of megatron against HF, 1e-4; measured 8e-6).
    for name, tolerance in (("dp2", 1e-9), ("tp2", 1e-4)):
        assert fresh[name].version == 2
        assert max_weight_diff(one, fresh[name]) < tolerance, name
    probe = make_batch(5)
    assert max_logprob_diff(await fresh["tp2"].logprobs(probe), await one.logprobs(probe)) < 1e-4


async def test_data_and_tensor_parallel_ranks_take_the_one_rank_mini_batches(fresh: dict[str, TrainerGroup]) -> None:
    batch = make_batch(0, groups=4)
    alone = await fresh["one"].train_step(batch, pg_loss, plan(batch, 2))
    assert (alone["optimizer_steps"], fresh["one"].version) == (2.0, 1)
    for name, rel in (("dp2", 1e-9), ("tp2", 1e-6)):
        metrics = await fresh[name].train_step(batch, pg_loss, plan(batch, 2))
        for key in ("loss", "pg_loss", "entropy", "grad_norm", "lr", "tokens", "optimizer_steps", "optimizer_steps_total"):
            assert metrics[key] == pytest.approx(alone[key], rel=rel), (name, key)
        assert fresh[name].version == 1
    assert max_weight_diff(fresh["one"], fresh["dp2"]) < 1e-9
    assert max_weight_diff(fresh["one"], fresh["tp2"]) < 1e-4  # as above: tensor parallel rounds each sample alike


async def test_steps_follow_the_hf_model(model_dir: Path, fresh: dict[str, TrainerGroup]) -> None:
    group = fresh["tp2"]
    async with TorchTrainEngine(str(model_dir), lr=1e-2, dtype=torch.float64, max_tokens_per_micro_batch=1) as hf:
        for seed in (0, 1):
            expected = await hf.train_step(make_batch(seed), pg_loss)
            metrics = await group.train_step(make_batch(seed), pg_loss)
            for key in ("loss", "grad_norm", "entropy"):
                assert metrics[key] == pytest.approx(expected[key], rel=1e-5), key
        probe = make_batch(5)
        assert max_logprob_diff(await group.logprobs(probe), await hf.logprobs(probe)) < 1e-4


async def test_gathered_weights_equal_the_hf_state_dict_and_export_loads_back(
    model_dir: Path, fresh: dict[str, TrainerGroup], tmp_path: Path
) -> None:
    hf = unique_weights(AutoModelForCausalLM.from_pretrained(model_dir))
    group = fresh["tp2"]  # every weight all-gathered from two shards
    with group.weights_for_sync() as (version, gathered):
        assert version == 0
        assert gathered.keys() == hf.keys()  # in megatron's layer order
        # Loaded into float64, every weight (norms too) in the trained dtype: the same values, bit for bit.
        assert all(gathered[name].dtype == torch.float64 for name in hf)
        assert all(torch.equal(gathered[name], hf[name].double()) for name in hf)
    group.save_pretrained(tmp_path / "export")
    exported = unique_weights(AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float64))
    assert all(torch.equal(exported[name], hf[name].double()) for name in hf)


async def test_a_checkpoint_of_tensor_parallel_ranks_resumes_on_one_and_on_data_parallel_ranks(
    fresh: dict[str, TrainerGroup], tmp_path: Path
) -> None:
    writer = fresh["tp2"]
    await writer.train_step(make_batch(0), pg_loss)
    await writer.save_state(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["trainer_megatron.pt"]
    for name in ("one", "dp2"):
        await fresh[name].load_state(tmp_path)
        assert fresh[name].version == 1
    # Two steps each: the second also depends on the restored Adam moments (through the weights).
    for seed in (1, 2):
        continued = await writer.train_step(make_batch(seed), pg_loss)
        for name in ("one", "dp2"):
            resumed = await fresh[name].train_step(make_batch(seed), pg_loss)
            assert resumed["loss"] == pytest.approx(continued["loss"], rel=1e-6), name
            assert resumed["grad_norm"] == pytest.approx(continued["grad_norm"], rel=1e-6), name
    assert max_weight_diff(fresh["one"], writer) < 1e-6
    assert max_weight_diff(fresh["one"], fresh["dp2"]) < 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (megatron's DDP and distributed optimizer)")
async def test_on_cuda_in_bf16_the_distributed_optimizer_trains_and_log_probs_follow_hf(model_dir: Path, tmp_path: Path) -> None:
    cuda = {"device": "cuda", "dtype": "bfloat16", "lr": 1e-3}
    probe = make_batch(5)
    hf = TorchTrainEngine(str(model_dir), lr=1e-3, device="cuda", dtype=torch.bfloat16)
    async with hf, TrainerGroup.local(spec(model_dir, **cuda), 1) as group:
        assert max_logprob_diff(await group.logprobs(probe), await hf.logprobs(probe)) < 5e-2  # bf16 rounding
        before = dict(group.named_tensors_for_sync())
        before = {name: t.clone() for name, t in before.items()}
        for seed in (0, 1):
            expected = await hf.train_step(make_batch(seed), pg_loss)
            metrics = await group.train_step(make_batch(seed), pg_loss)
            assert metrics["loss"] == pytest.approx(expected["loss"], rel=2e-2)
        assert any(not torch.equal(before[n], t) for n, t in group.named_tensors_for_sync())
        await group.save_state(tmp_path)
        async with TrainerGroup.local(spec(model_dir, **cuda), 1) as resumed:
            await resumed.load_state(tmp_path)
            assert resumed.version == 2
            assert max_logprob_diff(await resumed.logprobs(probe), await group.logprobs(probe)) == 0.0
