"""The torch-free config names exactly the losses and estimators the algorithms provide, and its
``algorithm`` section is the one settings type the losses read (no second config to copy into)."""

from __future__ import annotations

import typing

from tandem.algorithms import ADVANTAGE_ESTIMATORS, PROXIMAL_SOURCES
from tandem.algorithms.corrections import CORRECTION_LEVELS
from tandem.algorithms.kl import KL_ESTIMATORS
from tandem.algorithms.losses import AGGREGATIONS, BEHAVIOUR_WEIGHT_MODES, EXACT_KL, POLICY_LOSSES, LossSettings
from tandem.core.config import AlgorithmConfig


def literal_values(field: str) -> set[str]:
    annotation = AlgorithmConfig.model_fields[field].annotation
    args = typing.get_args(annotation)
    literal = next((a for a in args if typing.get_origin(a) is typing.Literal), annotation)
    return set(typing.get_args(literal))


def test_config_choices_match_the_registries() -> None:
    assert literal_values("loss") == set(POLICY_LOSSES)
    assert literal_values("advantage") == set(ADVANTAGE_ESTIMATORS) | {"gae"}  # gae: per action, from the critic
    assert literal_values("proximal") == set(PROXIMAL_SOURCES)
    assert literal_values("kl_estimator") == set(KL_ESTIMATORS) | {EXACT_KL}  # exact: the engine computes it
    assert literal_values("aggregation") == set(AGGREGATIONS)
    assert literal_values("behaviour_weight_mode") == set(BEHAVIOUR_WEIGHT_MODES)


def test_config_choices_match_the_corrections() -> None:
    assert literal_values("behaviour_weight_level") == set(CORRECTION_LEVELS)


def test_the_algorithm_section_has_every_setting_the_losses_read() -> None:
    read = typing.get_type_hints(LossSettings)
    missing = sorted(set(read) - set(AlgorithmConfig.model_fields))
    assert not missing, f"LossSettings reads {missing}, which the algorithm config does not have"
