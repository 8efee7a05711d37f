"""The compute behind the roles: engine backends and each workload's builder.

What it owns: the fake engines (``fake``: controlled timing, no model, a workload of their own);
the embedded torch engines (``hf_rollout``, ``torch_train``, ``torch_ddp``, ``torch_sync``,
``torch_microbatch``, ``threads``) and the text workflow over them (``text_workflow``); the
task's weighted reward (``rewards``); the Ray backend (``ray_actors``, ``ray_components``); and
the larger backends beside them (``megatron``, ``diffusion``, ``server``), imported only when a
config names them. Each workload's ``build_*_components(config, setup)`` fills the flow's
``core.components.Components``.

What it may import: ``core`` (the protocols it implements), ``algorithms`` (the loss inputs
engines build), ``param_sync`` (weight sync), torch and the backends' libraries; never
``state_machines``, ``tasks`` or ``pipeline`` (a task reaches an engine only through the
builder's ``TaskSetup``).
"""
