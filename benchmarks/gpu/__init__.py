"""The parts of ``benchmarks/gpu_check.py``: one module per workload, each ``run(scale) -> dict``."""
