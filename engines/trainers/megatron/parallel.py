"""One process's place in a megatron-core job: torch.distributed plus megatron's parallel state, set up and torn down.

What it owns: the lifetime of the process-global state megatron-core reads — the default
``torch.distributed`` process group, megatron's model-parallel groups (``parallel_state``) and, on
CPU, the shims of ``engines.trainers.megatron.cpu_shims``. Everything megatron builds or runs in this
process happens inside :func:`model_parallel`.

Invariants:
- the world is ``tensor_parallel_size`` × data parallel (pipeline parallel 1): megatron's default
  rank order puts the ranks of one tensor-parallel group next to each other (ranks 0..T-1 are the
  first group);
- CPU uses gloo and the CPU shims; CUDA uses NCCL, one device per local rank, and megatron's own
  CUDA RNG tracker (that branch needs a GPU and is not exercised by the CPU tests);
- leaving the block (normally or by an exception) undoes every step that was taken, innermost
  first: shims, then megatron's groups, then the process group, so a process can set up again.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from tandem.engines.trainers.megatron.cpu_shims import cpu_shims

__all__ = ["model_parallel"]

# Bounds the rendezvous and every collective when a rank hangs without dying.
_TIMEOUT = timedelta(seconds=120)


@contextmanager
def model_parallel(
    *,
    rank: int,
    world_size: int,
    init_method: str,
    tensor_parallel_size: int,
    seed: int,
    device: torch.device,
) -> Iterator[None]:
    """Join the job as ``rank`` of ``world_size`` and set up megatron's groups for the block.

    ``init_method`` is a ``torch.distributed`` rendezvous URL every rank shares (``file://`` or
    ``tcp://``); ``seed`` seeds megatron's RNG streams (the tensor-parallel stream differs per rank).
    """
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process; megatron needs its own world")
    if world_size % tensor_parallel_size:
        raise ValueError(f"world_size {world_size} is not a multiple of tensor_parallel_size {tensor_parallel_size}")
    with ExitStack() as undo:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=_TIMEOUT,
        )
        undo.callback(dist.destroy_process_group)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size)
        undo.callback(parallel_state.destroy_model_parallel)
        if device.type == "cpu":
            undo.enter_context(cpu_shims(seed))
        else:
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
        yield
