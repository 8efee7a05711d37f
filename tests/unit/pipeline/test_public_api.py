"""The public API is what ``__all__`` says, and the core imports without torch or ray."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

PACKAGES = ["tandem", "tandem.pipeline", "tandem.state_machines", "tandem.algorithms"]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_name_in_all_is_importable_and_listed_once(package: str) -> None:
    module = importlib.import_module(package)
    names = getattr(module, "__all__", [])  # a package without __all__ exports nothing by contract
    assert len(names) == len(set(names)), f"{package}.__all__ lists a name twice"
    missing = [name for name in names if not hasattr(module, name)]
    assert not missing, f"{package}.__all__ names what it does not export: {missing}"


def test_the_core_imports_without_torch_or_ray() -> None:
    code = (
        "import tandem, tandem.pipeline, tandem.core.config, tandem.pipeline.flow, tandem.state_machines.registry, "
        "tandem.engines.fake; import sys; "
        "assert 'torch' not in sys.modules and 'ray' not in sys.modules, "
        "sorted(m for m in ('torch', 'ray') if m in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_the_top_level_lists_what_users_write_against() -> None:
    import tandem

    documented = {"AsyncTrainingFlow", "load_config", "Stage", "Task", "RewardFunction", "AgentWorkflow", "Environment"}
    assert documented <= set(tandem.__all__)
    assert sorted(tandem.__all__) == sorted(tandem._HOMES)  # each name has one home, and each home is listed


def test_importing_one_part_loads_only_what_it_uses() -> None:
    # What a reward worker imports: the module it runs and its parent's main module (the `tandem`
    # script), neither of which needs the flow or the config's models.
    code = (
        "import sys, tandem.core.records; assert 'tandem.pipeline' not in sys.modules, 'the flow was loaded'; "
        "import tandem.pipeline.cli; assert 'tandem.pipeline.flow' not in sys.modules, 'the CLI loaded the flow'; "
        "import tandem.engines.rewards; assert 'tandem.core.config.schema' not in sys.modules, 'the config was loaded'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
