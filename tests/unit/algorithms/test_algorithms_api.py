"""The public API of ``algorithms`` is what ``__all__`` says: no more, no less."""

from __future__ import annotations

import algorithms
from algorithms import advantages, batch, kl, losses


def test_every_exported_name_exists_once() -> None:
    assert len(algorithms.__all__) == len(set(algorithms.__all__))
    for name in algorithms.__all__:
        assert hasattr(algorithms, name), name


def test_every_public_definition_is_exported() -> None:
    for module in (advantages, batch, kl, losses):
        for name, obj in vars(module).items():
            if not name.startswith("_") and getattr(obj, "__module__", None) == module.__name__:
                assert name in algorithms.__all__, f"{module.__name__}.{name}"


def test_registries_name_the_designed_algorithms() -> None:
    assert set(algorithms.POLICY_LOSSES) == {"ppo", "vanilla", "tis", "topr", "cispo", "kimi15"}
    assert set(algorithms.ADVANTAGE_ESTIMATORS) == {"grpo", "rloo", "reinforce"}
    assert set(algorithms.KL_ESTIMATORS) == {"k1", "k2", "k3"}
