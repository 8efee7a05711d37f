"""The text workload's engines: single-turn completions from a causal LM.

- :mod:`~tandem.engines.text.rollout`: the embedded rollout engine (transformers, KV cache,
  continuous batching; weights through a ``param_sync.ModuleTarget``); the episode workload
  drives the same engine turn by turn;
- :mod:`~tandem.engines.text.workflow`: a prompt group's requests and the trajectories built
  from their completions;
- :mod:`~tandem.engines.text.build`: the bundle ``pipeline.builders.WORKLOADS`` names for tasks
  of kind ``text`` on the torch backend (rollout by placement: embedded, servers, vLLM).

Nothing is imported here: the modules pull in torch and transformers.
"""
