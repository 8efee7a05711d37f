"""Import path for scripts run as ``python benchmarks/NAME.py``: the project, never this folder.

Python puts a script's own folder first on ``sys.path``, and ``benchmarks/param_sync.py`` shares
its name with the package it measures, so every benchmark imports this module first.
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))
