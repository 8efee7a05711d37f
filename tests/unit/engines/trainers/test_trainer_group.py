"""Trainer groups: the config that asks for one, the staging buffer, a failed start, the driver's
optimizer steps against scripted ranks.

The engines' own behaviour in a group (steps equal to one process's, checkpoints across group
sizes, a killed rank) is in ``test_fsdp.py`` and ``test_megatron_engine.py``.
"""

from __future__ import annotations

import multiprocessing
import pickle
from collections.abc import Sequence
from dataclasses import replace
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch
from test_torch_train import make_batch, pg_loss, plan
from transformers import AutoModelForCausalLM

from tandem.core.config import ConfigError, validate_config
from tandem.core.protocols import PartialTrainStep
from tandem.engines.trainers.group import (
    Accumulate,
    Accumulated,
    Done,
    Failed,
    Publish,
    RankServer,
    RankSpec,
    Ready,
    Staging,
    Step,
    Stepped,
    TrainerGroup,
    TrainRankError,
    preloaded_modules,
)

CPU = torch.device("cpu")


def config(**engines: object) -> dict:
    stages = ["dataloader", "generate", "rollout", "logp", "reward", "train"]
    return {"task": {"name": "arithmetic"}, "flow": {"stages": stages}, "engines": {"type": "torch", **engines}}


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("engines", "message"),
    [
        ({"tensor_parallel_size": 2, "train_world_size": 2}, "engines.tensor_parallel_size > 1 needs engines.train=megatron"),
        ({"train": "megatron", "data_parallel": "fsdp2"}, "engines.data_parallel applies to engines.train=torch"),
        (
            {"train": "megatron", "train_world_size": 3, "tensor_parallel_size": 2},
            "engines.train_world_size=3 is not a multiple of engines.tensor_parallel_size=2",
        ),
    ],
)
def test_a_parallel_layout_that_cannot_be_built_is_refused_naming_the_field(engines: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate_config(config(**engines))


def test_the_config_names_the_rank_engine_of_a_group() -> None:
    assert validate_config(config()).engines.trainer_group is None  # TorchTrainEngine
    assert validate_config(config(train_world_size=2)).engines.trainer_group == "ddp"  # plain torch on several ranks
    assert validate_config(config(data_parallel="fsdp2")).engines.trainer_group == "fsdp2"
    megatron = validate_config(config(train="megatron", train_world_size=4, tensor_parallel_size=2))
    assert megatron.engines.trainer_group == "megatron"

    spec = RankSpec.from_config(megatron, "/models/m", num_threads=3)
    assert (spec.engine, spec.model_path, spec.num_threads, spec.tensor_parallel_size) == ("megatron", "/models/m", 3, 2)
    assert (spec.lr, spec.temperature, spec.seed) == (megatron.engines.lr, megatron.rollout.temperature, megatron.run.seed)


def test_a_lora_group_trains_at_the_adapters_rate_and_megatron_ranks_refuse_an_adapter() -> None:
    settings = object()  # peft's LoraConfig in a run; the spec only carries it to the ranks
    fsdp2 = validate_config(config(data_parallel="fsdp2", train_world_size=2, lora={"lr": 1e-3}))
    spec = RankSpec.from_config(fsdp2, "/models/m", num_threads=1, lora=settings)  # type: ignore[arg-type]
    assert (spec.engine, spec.lr, spec.lora) == ("fsdp2", 1e-3, settings)
    megatron = RankSpec.from_config(validate_config(config(train="megatron")), "/models/m", num_threads=1)
    with pytest.raises(ValueError, match=r"engines.lora: megatron ranks train no adapter .*engines.data_parallel=fsdp2"):
        RankServer(replace(megatron, lora=settings), rank=0, world_size=1, init_method="", local_rank=0, share_staging=False)


def test_on_ray_every_group_of_train_ranks_runs_as_rank_actors_over_the_object_store() -> None:
    ray = {"cluster": {"backend": "ray"}}
    for engines in ({"train_world_size": 2}, {"train_world_size": 2, "data_parallel": "fsdp2"}):
        assert validate_config({**config(**engines), **ray}).engines.trainer_group is not None
    with pytest.raises(ConfigError, match="weight_transport=dist: a trainer group"):
        validate_config({**config(train="megatron"), "cluster": {"backend": "ray", "weight_transport": "dist"}})


# ---------------------------------------------------------------- the staging buffer


def test_staging_lays_tensors_out_aligned_and_shares_them_across_processes() -> None:
    tensors = [("a", torch.arange(5, dtype=torch.float32)), ("b", torch.ones(2, 3, dtype=torch.bfloat16))]
    staging = Staging.allocate(tensors, shared=True)
    assert [offset % 64 for *_, offset in staging.layout] == [0, 0]
    views = staging.tensors()
    for name, tensor in tensors:
        views[name].copy_(tensor)
    # What a rank process sends its driver: the same memory, viewed alike on the other side.
    received = pickle.loads(ForkingPickler.dumps(staging))
    assert all(torch.equal(received.tensors()[name], tensor) for name, tensor in tensors)
    received.tensors()["a"].fill_(7.0)
    assert torch.equal(views["a"], torch.full((5,), 7.0))


# ---------------------------------------------------------------- the driver's optimizer steps


class ScriptedRanks:
    """Two ranks that answer the driver without a model: every accumulate succeeds but rank 1's
    ``fail_at``-th (counting from 0); they count their optimizer steps and versions as ranks do."""

    size = 2

    def __init__(self, fail_at: int) -> None:
        self.fail_at = fail_at
        self.accumulates = 0
        self.optimizer_steps = 0
        self.version = 0
        self.progress: list[float] = []

    def started(self) -> list[object]:
        return [Ready(0, "scripted.pt")] * self.size

    def exchange(self, messages: Sequence[object]) -> list[object]:
        head = messages[0]
        if isinstance(head, Accumulate):
            self.progress.append(head.progress)
            self.accumulates += 1
            if self.accumulates - 1 == self.fail_at:
                return [Accumulated({"loss": 1.0}, 1), Failed("ValueError: loss exploded on rank 1")]
            return [Accumulated({"loss": 1.0}, 1)] * self.size
        if isinstance(head, Step):
            self.optimizer_steps += head.proceed
            return [Stepped(2.0, self.optimizer_steps)] * self.size
        assert isinstance(head, Publish)
        self.version += 1
        return [Done(self.version)] * self.size

    def close(self, *, broken: bool) -> None:
        pass


def scripted_group(fail_at: int) -> tuple[TrainerGroup, ScriptedRanks]:
    spec = RankSpec(
        engine="ddp", model_path="scripted", device="cpu", dtype="float32", temperature=1.0, lr=1e-3,
        weight_decay=0.0, warmup_steps=4, max_grad_norm=1.0, max_tokens_per_micro_batch=64, num_threads=1,
    )  # fmt: skip
    ranks = ScriptedRanks(fail_at)
    return TrainerGroup(ranks, spec), ranks  # type: ignore[arg-type]


async def test_the_driver_takes_an_optimizer_step_per_mini_batch_then_publishes_one_version() -> None:
    group, ranks = scripted_group(fail_at=-1)
    batch = make_batch(groups=4)
    try:
        metrics = await group.train_step(batch, pg_loss, plan(batch, 2, epochs=2))
    finally:
        group.close()
    assert (group.version, ranks.optimizer_steps, ranks.progress) == (1, 4, [0.0, 0.25, 0.5, 0.75])
    assert (metrics["optimizer_steps"], metrics["optimizer_steps_total"]) == (4.0, 4.0)
    assert metrics["lr"] == pytest.approx(1e-3 * (1 + 2 + 3 + 4) / 4 / 4)  # warm-up over 4 optimizer steps


async def test_a_rank_failing_at_the_first_optimizer_step_leaves_the_group_usable_and_after_it_breaks_it() -> None:
    batch = make_batch(groups=4)
    group, _ = scripted_group(fail_at=0)
    try:
        with pytest.raises(TrainRankError, match="train rank 1 failed"):
            await group.train_step(batch, pg_loss, plan(batch, 2))
        await group.train_step(batch, pg_loss, plan(batch, 2))  # every rank dropped the gradient: it goes on
        assert group.version == 1
    finally:
        group.close()
    group, _ = scripted_group(fail_at=1)
    try:
        with pytest.raises(PartialTrainStep, match="after 1 of its 2 optimizer steps") as info:
            await group.train_step(batch, pg_loss, plan(batch, 2))
        assert isinstance(info.value.__cause__, TrainRankError) and info.value.__cause__.rank == 1
        with pytest.raises(RuntimeError, match="out of step since: train rank 1 failed"):  # no version's weights
            await group.train_step(batch, pg_loss)
        assert group.version == 0
    finally:
        group.close()


# ---------------------------------------------------------------- a group that cannot start


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_rank_that_cannot_start_is_named_and_no_process_is_left(tmp_path: Path) -> None:
    others = set(multiprocessing.active_children())
    spec = RankSpec(
        engine="fsdp2", model_path=str(tmp_path / "no-model"), device="cpu", dtype="float32", temperature=1.0, lr=1e-3,
        weight_decay=0.0, warmup_steps=0, max_grad_norm=1.0, max_tokens_per_micro_batch=64, num_threads=1,
    )  # fmt: skip
    with pytest.raises(TrainRankError, match=r"train rank \d (failed to start|died)") as info:
        TrainerGroup.local(spec, 2)
    assert "no-model" in str(info.value) or "died" in str(info.value)
    assert set(multiprocessing.active_children()) <= others


def test_the_fork_server_preloads_the_rank_engine_and_the_models_architecture(model_dir: Path, tmp_path: Path) -> None:
    spec = RankSpec(
        engine="fsdp2", model_path=str(model_dir), device="cpu", dtype="float32", temperature=1.0, lr=1e-3,
        weight_decay=0.0, warmup_steps=0, max_grad_norm=1.0, max_tokens_per_micro_batch=64, num_threads=1,
    )  # fmt: skip
    architecture = type(AutoModelForCausalLM.from_pretrained(model_dir)).__module__
    assert preloaded_modules(spec) == ["tandem.engines.trainers.fsdp", architecture]
    # A model it cannot read here is left to the ranks, which report why they cannot load it.
    assert preloaded_modules(replace(spec, model_path=str(tmp_path / "no-model"))) == ["tandem.engines.trainers.fsdp"]


# ---------------------------------------------------------------- on Ray: one actor per rank


def test_on_ray_each_rank_gets_an_actor_in_its_slot_and_every_bundle_stays_within_one_device() -> None:
    pytest.importorskip("ray")
    from collections import defaultdict

    from tandem.core.resources import plan_resources
    from tandem.engines.ray.build import _one_placement_per_rank

    cluster = {"backend": "ray", "device_mapping": {"train": [0, 1], "generate": [1]}}
    cfg = validate_config({**config(data_parallel="fsdp2", train_world_size=2), "cluster": cluster})
    placements = _one_placement_per_rank(cfg, plan_resources(cfg, 2, "CPU").actors())
    assert [(p.name, p.slot) for p in placements if p.role == "train"] == [("train-rank0", 0), ("train-rank1", 1)]
    reserved: dict[int, float] = defaultdict(float)
    for p in placements:
        reserved[p.slot] += p.share
    assert dict(reserved) == {0: 1.0, 1: 1.0}  # rank 1 shares slot 1 with the rollout actor, half each

    three = validate_config({**config(data_parallel="fsdp2", train_world_size=3), "cluster": cluster})
    with pytest.raises(ConfigError, match="train_world_size=3: a trainer group on Ray has one rank per train slot"):
        _one_placement_per_rank(three, plan_resources(three, 2, "CPU").actors())
