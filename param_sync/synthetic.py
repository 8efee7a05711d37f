"""A synthetic model of a chosen size, and the machine's memcpy bandwidth: what the weight-sync
benchmarks measure with and against.

Shipped beside the real code (as a fake engine is) so that every benchmark, and Ray actors,
which import by module path, build the very same model.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import nn

from tandem.param_sync.bucket import MiB

__all__ = ["SyntheticModel", "memcpy_gb_per_s"]

WIDTH = 4096
ROWS = 1024  # one bf16 matrix: 8 MiB


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((ROWS, WIDTH), 0.5, dtype=torch.bfloat16))
        self.norm = nn.Parameter(torch.ones(WIDTH, dtype=torch.float32))


class SyntheticModel(nn.Module):
    """About ``size_mib`` MiB of weights as a transformer lays them out: 8 MiB bf16 matrices,
    fp32 norms and an int64 buffer; every page touched (filled), so no first-touch faults are
    timed."""

    def __init__(self, size_mib: int) -> None:
        super().__init__()
        per_layer = ROWS * WIDTH * 2 + WIDTH * 4
        self.layers = nn.ModuleList(_Layer() for _ in range(max(1, round(size_mib * MiB / per_layer))))
        self.register_buffer("position_ids", torch.arange(WIDTH, dtype=torch.int64))


def memcpy_gb_per_s(nbytes: int, *, piece_nbytes: int | None = None) -> float:
    """``np.copyto`` of ``nbytes`` between two touched buffers, best of 3 after a warm-up
    copy: the physical limit of one copy on this machine. ``piece_nbytes`` copies in pieces
    of that size instead of in one call (glibc picks its copy by size: see the param-sync
    benchmark)."""
    src = np.ones(nbytes, np.uint8)
    dst = np.ones(nbytes, np.uint8)
    step = piece_nbytes or nbytes

    def copy() -> None:
        for at in range(0, nbytes, step):
            np.copyto(dst[at : at + step], src[at : at + step])

    copy()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        copy()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9
