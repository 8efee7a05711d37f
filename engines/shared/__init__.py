"""Torch machinery every workload's engines share.

- :mod:`~tandem.engines.shared.threads`: thread budgets per role and the worker-thread base
  (:class:`~tandem.engines.shared.threads.ClosesOnAThread`) every engine that computes off the
  event loop builds on;
- :mod:`~tandem.engines.shared.microbatch`: token-budget micro-batches, collation and response
  log-probs;
- :mod:`~tandem.engines.shared.weight_sync`: the in-process weight sync from a trainer's dual
  buffer into a rollout engine;
- :mod:`~tandem.engines.shared.tokenizer`: loading a model folder's tokenizer;
- :mod:`~tandem.engines.shared.lora`: LoRA adapters with peft (targets, what trains and syncs, exports);
- :mod:`~tandem.engines.shared.probe`: the weight probe, each sync's proof that it landed.

Nothing is imported here: the modules pull in torch.
"""
