"""tandem's vocabulary: what every other package speaks, and nothing else.

What it owns: the records that travel between roles (:mod:`core.records`), bounded channels
(:mod:`core.channel`), the version clock and staleness gate (:mod:`core.staleness`), the
exactly-once ledger (:mod:`core.ledger`), the run configuration (:mod:`core.config`), the run
history (:mod:`core.history`), the protocols at the seams to the compute (:mod:`core.protocols`,
:mod:`core.components`, :mod:`core.task`, :mod:`core.environment`), resource plans
(:mod:`core.resources`), the trace (:mod:`core.trace`) and the checkpoint format
(:mod:`core.checkpoint`).

What it may import: the standard library and the core dependencies (pydantic, PyYAML, structlog,
numpy). Never torch, Ray, sglang or megatron, and nothing of ours above it: ``engines``,
``state_machines``, ``param_sync``, ``algorithms``, ``tasks`` and ``pipeline`` import this package,
never the other way round (enforced by the import-linter contracts in ``pyproject.toml``).
"""
