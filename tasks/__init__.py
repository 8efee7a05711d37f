"""Workload data and judgement: one folder per task, each a plugin the flow never names.

What it owns: each task's item source, rewards, held-out evaluation and the small model shipped
for it (``tasks/<name>/``, found by name through :mod:`tasks.registry`), and the shared helpers
tasks build on (:mod:`tasks.dataset`: items from JSONL/Parquet files). What it may import:
``core`` (the vocabulary) and third-party libraries; never ``engines``, ``state_machines``,
``param_sync`` or ``pipeline``. A task's package imports nothing heavy (no torch) at import
time, so reward worker processes and the config layer stay light; its pretraining script may.
"""
