"""Where tandem's shipped files are, in a checkout and in an installed package alike.

Each part of the repository (``core/``, ``tasks/``, ``configs/``, ...) is installed as
``tandem.<part>``, so the folder that holds the parts is the repository root in a checkout and
``site-packages/tandem`` in a wheel install; paths the shipped configs and docs use (such as
``tasks/arithmetic/model``) are relative to it. Nothing here depends on the working directory.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

__all__ = ["CONFIGS_DIR", "PACKAGE_ROOT", "resolve_config"]

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
CONFIGS_DIR = Path(str(files("tandem.configs")))



def resolve_config(name: str | Path) -> Path:
    """The path as given if it is a file, else the shipped ``configs/NAME[.yaml]`` when ``name`` is
    a bare name; a config found in neither place is returned as given, for the caller to name."""
    path = Path(name)
    text = str(name)
    shipped = CONFIGS_DIR / (text if text.endswith(".yaml") else f"{text}.yaml")
    if not path.is_file() and path.name == text and shipped.is_file():
        return shipped
    return path
