"""The torch-free config names exactly the losses and estimators the algorithms provide."""

from __future__ import annotations

import typing

from algorithms import ADVANTAGE_ESTIMATORS, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
from engines.rl_trainer import loss_config
from core.config import AlgorithmConfig


def literal_values(field: str) -> set[str]:
    annotation = AlgorithmConfig.model_fields[field].annotation
    args = typing.get_args(annotation)
    literal = next((a for a in args if typing.get_origin(a) is typing.Literal), annotation)
    return set(typing.get_args(literal))


def test_config_choices_match_the_registries() -> None:
    assert literal_values("loss") == set(POLICY_LOSSES)
    assert literal_values("advantage") == set(ADVANTAGE_ESTIMATORS)
    assert literal_values("kl_estimator") == set(KL_ESTIMATORS)
    assert literal_values("aggregation") == set(AGGREGATIONS)


def test_every_config_section_builds_a_valid_loss_config() -> None:
    for name in sorted(literal_values("loss")):
        cfg = loss_config(AlgorithmConfig(loss=name, kl_estimator="k3", kl_coef=0.1))
        assert cfg.name == name and cfg.kl_estimator == "k3"
