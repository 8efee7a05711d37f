"""The shims that let megatron-core's GPT model run forward and backward on CPU: every one of them, here.

megatron-core (written against 0.16.1) assumes a CUDA device at three points of a ``GPTModel``
forward with the local layer spec; its backward reaches none. They were found by running a
forward and backward (tensor parallel 1 and 2, over gloo) with every ``torch.cuda.current_device()``
call logged:

1. **Global memory buffer.** ``parallel_state``'s ``GlobalMemoryBuffer.get_tensor`` allocates on
   ``torch.cuda.current_device()``; the local spec's ``DotProductAttention`` takes the input of its
   ``baddbmm`` (``beta=0``, so only the shape matters) from it. Replaced by :class:`CpuMemoryBuffer`,
   the same buffer allocating on the CPU.
2. **RNG tracker.** ``tensor_parallel.random``'s ``CudaRNGStatesTracker`` forks a CUDA generator
   state around the attention dropout, even at dropout 0. Replaced by :class:`CpuRNGStatesTracker`:
   the same named streams (data parallel, tensor parallel per rank, expert), over the CPU generator,
   seeded by megatron's own ``model_parallel_cuda_manual_seed``.
3. **Rotary embedding.** ``RotaryEmbedding.get_emb`` moves its inverse frequencies to
   ``torch.cuda.current_device()`` on first use. Replaced by a copy that leaves them where they are.

A fourth assumption is avoided rather than shimmed: given no attention mask, the local softmax builds
its causal mask on ``"cuda"``; ``engines.trainers.megatron.model`` always passes one.

Not covered (they need CUDA, and nothing on the CPU path calls them): activation recomputation (it
saves and restores CUDA RNG states directly), megatron's DDP wrapper and distributed optimizer, and
the pipeline schedules.

Invariants:
- the shims are process-global (as megatron's parallel state is) and exist only inside
  :func:`cpu_shims`; leaving it restores exactly the objects it replaced;
- entering :func:`cpu_shims` while it is already active changes nothing (idempotent);
- callers apply them only when the model runs on CPU (``engines.trainers.megatron.parallel`` decides).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel import random as megatron_random
from megatron.core.utils import GlobalMemoryBuffer

__all__ = ["CpuMemoryBuffer", "CpuRNGStatesTracker", "cpu_shims", "shims_active"]

_active = False


class CpuMemoryBuffer(GlobalMemoryBuffer):
    """megatron's global memory buffer, allocating on the CPU instead of the current CUDA device."""

    def get_tensor(
        self,
        tensor_shape: tuple[int, ...],
        dtype: torch.dtype,
        name: str,
        mem_alloc_context: Callable[[], Any] | None = None,
    ) -> torch.Tensor:
        required = math.prod(tensor_shape)
        buffer = self.buffer.get((name, dtype))
        if buffer is None or buffer.numel() < required:
            buffer = self.buffer[(name, dtype)] = torch.empty(required, dtype=dtype, requires_grad=False)
        return buffer[:required].view(*tensor_shape)


class CpuRNGStatesTracker(megatron_random.CudaRNGStatesTracker):
    """megatron's named RNG streams over the CPU generator.

    ``fork(name)`` runs its body on stream ``name`` and restores the stream it interrupted, as the
    CUDA tracker does, so dropout inside a tensor-parallel region draws from that rank's stream.
    """

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextmanager
    def fork(self, name: str = megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise ValueError(f"rng state {name} is not added")
        interrupted = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(interrupted)


def _get_emb_in_place(self: RotaryEmbedding, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    """``RotaryEmbedding.get_emb`` of megatron-core 0.16.1 without its move of ``inv_freq`` to CUDA."""
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if not self.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    return emb[:, None, None, :]


def shims_active() -> bool:
    """Whether :func:`cpu_shims` is in force in this process."""
    return _active


@contextmanager
def cpu_shims(seed: int) -> Iterator[None]:
    """Run megatron's GPT model on CPU inside this block; ``seed`` seeds the RNG streams.

    Needs megatron's parallel state initialised (``initialize_model_parallel`` creates the memory
    buffer replaced here, and the tensor-parallel stream's seed depends on the rank). A nested
    entry is a no-op; the outermost exit restores megatron's own buffer, tracker and method.
    """
    global _active
    if _active:
        yield
        return
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("cpu_shims needs megatron's parallel state: call initialize_model_parallel first")
    saved_buffer = parallel_state._GLOBAL_MEMORY_BUFFER
    saved_tracker = megatron_random._CUDA_RNG_STATE_TRACKER
    saved_tracker_initialized = megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED
    saved_get_emb = RotaryEmbedding.get_emb
    _active = True
    try:
        parallel_state._GLOBAL_MEMORY_BUFFER = CpuMemoryBuffer()
        megatron_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
        megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True  # so megatron seeds ours, not a new CUDA one
        RotaryEmbedding.get_emb = _get_emb_in_place  # type: ignore[method-assign]
        # megatron's seeding scheme, applied to our tracker (its torch.cuda.manual_seed call is a
        # lazy no-op without CUDA).
        megatron_random.model_parallel_cuda_manual_seed(seed)
        yield
    finally:
        RotaryEmbedding.get_emb = saved_get_emb  # type: ignore[method-assign]
        megatron_random._CUDA_RNG_STATE_TRACKER = saved_tracker
        megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved_tracker_initialized
        parallel_state._GLOBAL_MEMORY_BUFFER = saved_buffer
        _active = False
