"""Trainers: the engines that take gradient steps, on one rank or many.

- :mod:`~tandem.engines.trainers.torch_train`: the plain torch trainer and log-prob engine
  (token-budget micro-batches, AdamW);
- :mod:`~tandem.engines.trainers.critic`: the value model (PPO with GAE);
- :mod:`~tandem.engines.trainers.ddp`: data-parallel torch ranks;
- :mod:`~tandem.engines.trainers.group`: trainer groups, the rank framework FSDP2 and
  megatron-core ranks run in (local processes or Ray actors);
- :mod:`~tandem.engines.trainers.fsdp` and :mod:`~tandem.engines.trainers.megatron`: the
  ranks themselves.

Nothing is imported here: the modules pull in torch (and megatron-core where named).
"""
