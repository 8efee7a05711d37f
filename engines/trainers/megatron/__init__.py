"""megatron-core backend (optional: ``pip install tandem[megatron]``); nothing outside this package imports it eagerly.

- ``cpu_shims``: the replacements megatron-core needs to run forward and backward on CPU;
- ``parallel``: torch.distributed plus megatron's parallel state for one process, set up and torn down;
- ``convert``: Hugging Face Llama/Qwen2 ↔ megatron ``GPTModel`` (config, model, weights, tensor-parallel shards);
- ``model``: per-token response log-probs from a ``GPTModel``, vocabulary-parallel;
- ``engine``: one rank of a trainer group (``engines.trainers.group``, ``engines.train: megatron``):
  the model, its optimizer, gradient reduction, gathered weights and checkpoints.

What runs on CPU: the ``GPTModel`` forward and backward (local layer spec) with tensor parallel
1–2 over gloo, data parallel through the trainer group (a torch AdamW on each rank's shards
after a flat gradient all-reduce). What needs CUDA: the Transformer Engine spec, megatron's DDP
wrapper and distributed optimizer (``engine`` uses them there), pipeline schedules and
activation recomputation.
"""
