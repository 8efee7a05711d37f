"""Trainer groups: the config that asks for one, the staging buffer, a failed start.

The engines' own behaviour in a group (steps equal to one process's, checkpoints across group
sizes, a killed rank) is in ``test_fsdp.py`` and ``test_megatron_engine.py``.
"""

from __future__ import annotations

import multiprocessing
import pickle
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch

from tandem.core.config import ConfigError, validate_config
from tandem.engines.trainers.group import RankSpec, Staging, TrainerGroup, TrainRankError

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
