"""Import path for scripts run as ``python benchmarks/NAME.py``: the project comes first.

Python puts a script's own folder first on ``sys.path``, and ``benchmarks/param_sync.py`` shares
its name with the package it measures, so every benchmark imports this module first, which puts
the project root in front. This folder stays on the path: worker processes started with
``spawn`` re-run the script and must find this module again.
"""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
if sys.path[0] != ROOT:
    sys.path.insert(0, ROOT)
