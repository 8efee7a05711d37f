"""Installed, tandem is one package: the wheel's only top-level name is ``tandem``, it carries the
shipped configs and models, and the CLI runs from an empty folder with no checkout in sight."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import package_dirs

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from a copy of the sources (pip builds in the source folder)."""
    src = tmp_path_factory.mktemp("src")
    for folder in package_dirs().values():
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    build = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)]
    subprocess.run(build, check=True, capture_output=True, timeout=300)
    (built,) = out.glob("tandem-*.whl")
    return built


def test_the_wheel_holds_only_tandem_with_every_module_configs_and_models(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names if ".dist-info/" not in name} == {"tandem"}
    modules = {f"{package.replace('.', '/')}/{path.relative_to(ROOT / folder)}" for package, folder in package_dirs().items()
               for path in (ROOT / folder).rglob("*.py") if "__pycache__" not in path.parts}
    assert modules - set(names) == set()
    configs = {f"tandem/configs/{path.name}" for path in (ROOT / "configs").glob("*.yaml")}
    assert configs and configs <= set(names)
    assert "tandem/configs/grafana/tandem.json" in names
    for model in ("arithmetic/model", "arithmetic/teacher", "calculator/model", "frozenlake/model"):
        assert {f"tandem/tasks/{model}/{f}" for f in ("config.json", "model.safetensors", "tokenizer.json")} <= set(names)
    assert "tandem/tasks/digits/model/transformer/diffusion_pytorch_model.safetensors" in names


@pytest.mark.slow
def test_the_installed_cli_runs_a_shipped_config_from_an_empty_folder(wheel: Path, tmp_path: Path) -> None:
    site, work = tmp_path / "site", tmp_path / "work"
    work.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(site)}  # the installed copy is found before the checkout's editable install
    where = subprocess.run([sys.executable, "-c", "import tandem.pipeline.cli as m; print(m.__file__)"],
                           cwd=work, env=env, capture_output=True, text=True, check=True, timeout=120)
    assert where.stdout.strip().startswith(str(site))
    tandem = site / "bin" / "tandem"
    helped = subprocess.run([str(tandem), "--help"], cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0, helped.stderr
    assert "sim_k1" in helped.stdout and str(site) in helped.stdout  # the shipped configs, listed from the install
    ran = subprocess.run([str(tandem), "run", "sim_k1", "run.max_steps=2", "--no-progress"],
                         cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    assert "done: 2 steps" in ran.stdout
