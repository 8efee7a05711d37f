"""The compute behind the roles: engine backends and each workload's builder.

What it owns, by folder: ``text/``, ``agentic/`` (episodes) and ``diffusion/`` (images), each
workload's engines and builder; ``shared/``, the torch machinery they share (threads, micro-batches,
in-process weight sync, tokenizers); ``trainers/``, the engines that take gradient steps (plain
torch, DDP, the trainer-group rank framework, FSDP2, megatron-core, the critic); the placements
``ray/`` (Ray actors) and ``server/`` (``tandem serve``, its client and router, sglang); ``vllm/``
(vLLM in process and as servers); the fake engines (``fake``: controlled timing, no model) and the
task's weighted reward (``rewards``). Backends are imported only when a config names them; each
workload's ``build_*_components(config, setup)`` fills the flow's ``core.components.Components``.

What it may import: ``core`` (the protocols it implements), ``algorithms`` (the loss inputs
engines build), ``param_sync`` (weight sync), torch and the backends' libraries; never
``state_machines``, ``tasks`` or ``pipeline`` (a task reaches an engine only through the
builder's ``TaskSetup``).
"""
