"""Resource pools: slots per role from device_mapping or use_nodes_ratios, actors per slot,
and which roles share devices (and so take turns under one lock)."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.core.config import ConfigError, validate_config
from tandem.core.resources import colocated_groups, plan_resources
from tests.conftest import merge

STAGES = ["dataloader", "generate", "rollout", "logp", "reward", "train"]
RAY: dict[str, Any] = {
    "engines": {"type": "torch"},
    "task": {"name": "arithmetic"},
    "flow": {"stages": STAGES},
    "cluster": {"backend": "ray"},
}


def ray_config(**sections: Any) -> Any:
    return validate_config(merge(RAY, sections))


def test_by_default_train_and_generation_split_the_cluster_and_overlap() -> None:
    cfg = ray_config()
    plan = plan_resources(cfg, 4, "CPU")
    assert plan.roles == {"train": (0, 1), "generate": (2, 3)}
    assert [(a.name, a.slot, a.share, a.slots) for a in plan.actors()] == [
        ("train", 0, 1.0, (0, 1)),
        ("rollout-0", 2, 1.0, (2,)),
        ("rollout-1", 3, 1.0, (3,)),
    ]
    assert colocated_groups(cfg) == []


def test_ratios_hand_out_disjoint_ranges_and_refuse_a_cluster_too_small() -> None:
    cfg = ray_config(cluster={"use_nodes_ratios": {"train": 0.25, "generate": 0.75}})
    assert plan_resources(cfg, 4, "CPU").roles == {"train": (0,), "generate": (1, 2, 3)}
    with pytest.raises(ConfigError, match="generate would need slots 1..1 of a 1-slot cluster"):
        plan_resources(cfg, 1, "CPU")


def test_a_shared_device_mapping_colocates_the_roles_and_splits_each_bundle() -> None:
    cfg = ray_config(cluster={"device_mapping": {"train": [0, 1], "generate": [0, 1]}})
    plan = plan_resources(cfg, 2, "CPU")
    assert plan.used_slots == [0, 1]
    shares = {(a.name, a.slot): a.share for a in plan.actors()}
    assert shares == {("rollout-0", 0): 0.5, ("rollout-1", 1): 1.0, ("train", 0): 0.5}
    assert colocated_groups(cfg) == [{"generate", "train"}]


def test_sharing_is_transitive_and_merges_with_flow_colocate() -> None:
    cfg = ray_config(
        cluster={"device_mapping": {"train": [0], "generate": [1, 2], "ref_logp": [2]}},
        flow={"stages": [*STAGES[:4], "ref_logp", *STAGES[4:]], "colocate": [["reward", "ref_logp"]]},
        algorithm={"kl_coef": 0.1, "kl_estimator": "k3"},
    )
    assert colocated_groups(cfg) == [{"reward", "ref_logp", "generate"}]


def test_a_reference_without_a_pool_shares_the_trainers_slots() -> None:
    cfg = ray_config(
        flow={"stages": [*STAGES[:4], "ref_logp", *STAGES[4:]]}, algorithm={"kl_coef": 0.1, "kl_estimator": "k3"}
    )
    assert plan_resources(cfg, 2, "CPU").roles["ref_logp"] == (0,)
    assert colocated_groups(cfg) == [{"ref_logp", "train"}]


def test_the_local_backend_colocates_only_what_flow_colocate_says() -> None:
    cfg = validate_config({"flow": {"colocate": [["generate", "train"]]}})
    assert colocated_groups(cfg) == [{"generate", "train"}]


def test_a_slot_beyond_the_cluster_is_named() -> None:
    cfg = ray_config(cluster={"device_mapping": {"train": [0], "generate": [1, 5]}})
    with pytest.raises(ConfigError, match=r"device_mapping.generate names slot 5, but the cluster has 2 slots"):
        plan_resources(cfg, 2, "CPU")


def test_on_gpus_the_trainer_is_one_actor_on_one_device() -> None:
    cfg = ray_config(cluster={"device_mapping": {"train": [0, 1], "generate": [2]}})
    with pytest.raises(ConfigError, match="train is one actor on one GPU"):
        plan_resources(cfg, 4, "GPU")


@pytest.mark.parametrize(
    ("cluster", "message"),
    [
        ({"device_mapping": {"train": [0]}, "use_nodes_ratios": {"train": 1.0}}, "not both"),
        ({"device_mapping": {"train": [0]}}, "must name generate and train"),
        ({"device_mapping": {"train": [0], "generate": [1, 1]}}, "distinct slot indices"),
        ({"use_nodes_ratios": {"train": 0.6, "generate": 0.6}}, "add up to 1.2"),
        ({"device_mapping": {"rollout": [0]}}, "device_mapping.rollout"),
    ],
)
def test_bad_placements_fail_before_anything_starts(cluster: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ray_config(cluster=cluster)


def test_ray_needs_the_torch_engines_and_restarts_need_role_retries_and_the_object_store() -> None:
    with pytest.raises(ConfigError, match="needs engines.type=torch"):
        validate_config({"cluster": {"backend": "ray"}})
    with pytest.raises(ConfigError, match="set roles.generate.max_retries >= 1"):
        ray_config(cluster={"max_actor_restarts": 1})
    with pytest.raises(ConfigError, match="set roles.param_update.max_retries >= 1"):
        ray_config(cluster={"max_actor_restarts": 1}, roles={"generate": {"max_retries": 2}})
    retries = {r: {"max_retries": 2} for r in ("generate", "param_update")}
    ok = ray_config(cluster={"max_actor_restarts": 1}, roles=retries)
    assert ok.cluster.max_actor_restarts == 1
    with pytest.raises(ConfigError, match="set roles.validate.max_retries >= 1"):
        ray_config(cluster={"max_actor_restarts": 1}, roles=retries, validation={"every_versions": 10})
    with pytest.raises(ConfigError, match="a gloo group cannot take a restarted rank back"):
        ray_config(cluster={"max_actor_restarts": 1, "weight_transport": "dist"}, roles=retries)


def test_the_ray_backend_without_ray_installed_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from tandem.pipeline.builders import build_components

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ConfigError, match=r"cluster.backend=ray needs Ray: pip install 'tandem\[ray\]'"):
        build_components(ray_config())
