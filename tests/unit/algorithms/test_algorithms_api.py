"""The public API of ``algorithms`` is what ``__all__`` says: no more, no less, and the package
itself imports no torch (its torch math is imported from its modules by name)."""

from __future__ import annotations

import subprocess
import sys
from types import ModuleType

import pytest

import tandem.algorithms
from tandem.algorithms import (
    advantages,
    batch,
    corrections,
    distill,
    flow_grpo,
    gae,
    kl,
    losses,
    metrics,
    mini_batches,
    objective,
    prox,
    shaping,
)

MODULES = [
    tandem.algorithms, advantages, batch, corrections, distill, flow_grpo, gae, kl, losses, metrics, mini_batches,
    objective, prox, shaping,
]  # fmt: skip


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_every_exported_name_exists_once(module: ModuleType) -> None:
    assert len(module.__all__) == len(set(module.__all__))
    for name in module.__all__:
        assert hasattr(module, name), f"{module.__name__}.{name}"


@pytest.mark.parametrize("module", MODULES[1:], ids=lambda m: m.__name__)
def test_every_public_definition_is_exported(module: ModuleType) -> None:
    for name, obj in vars(module).items():
        if not name.startswith("_") and getattr(obj, "__module__", None) == module.__name__:
            assert name in module.__all__, f"{module.__name__}.{name}"


def test_the_package_exports_its_torch_free_modules_whole() -> None:
    for module in (advantages, mini_batches, objective):
        assert set(module.__all__) <= set(tandem.algorithms.__all__), module.__name__


def test_the_package_imports_without_torch() -> None:
    code = "import tandem.algorithms, sys; assert 'torch' not in sys.modules"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_registries_name_the_designed_algorithms() -> None:
    assert set(losses.POLICY_LOSSES) == {"ppo", "vanilla", "tis", "topr", "cispo", "kimi15"}
    assert set(tandem.algorithms.ADVANTAGE_ESTIMATORS) == {"grpo", "rloo", "reinforce"}
    assert set(kl.KL_ESTIMATORS) == {"k1", "k2", "k3"}
