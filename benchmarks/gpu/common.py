"""What every part of the GPU check shares: the scale it runs at, timing on the device, the card's peak.

A part is a module with ``run(scale: Scale) -> dict[str, Any]``: it builds its models from config
with random weights (no download), measures, and returns its figures as JSON-ready values. A part
that cannot run here (a library missing on the GPU host, a second GPU needed) raises
:class:`Skipped` with the reason, which the check reports in its table and JSON; any other
exception is reported as that part's error and the other parts still run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

__all__ = ["Scale", "Skipped", "bf16_peak_flops", "describe", "synchronize", "timed"]

T = TypeVar("T")


class Skipped(Exception):
    """A part (or a row of one) that cannot run on this host; the message says why."""


@dataclass(frozen=True)
class Scale:
    """Where and how big. ``tiny``: the CPU smoke mode the test suite runs (small shapes, a few
    steps, float32), so the script never rots between GPUs; otherwise the realistic sizes of the
    issue (Qwen2.5-0.5B-shaped text, an SD3-family transformer of a few hundred million
    parameters) in bfloat16 on ``device``."""

    device: torch.device
    tiny: bool
    workdir: Path
    """Scratch folder for the model folders a part saves (it is the part's to fill)."""

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.tiny else torch.bfloat16

    @property
    def dtype_name(self) -> str:
        return "float32" if self.tiny else "bfloat16"

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU), so wall time covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], T], device: torch.device) -> tuple[T, float]:
    """``fn()`` and its wall seconds, the device synchronized before and after."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - start


# Dense bf16 tensor-core peaks (no sparsity), from NVIDIA's datasheets: the SXM parts.
_BF16_PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "H800": 989.4, "A100": 312.0, "L40S": 362.05, "B200": 2250.0}


def bf16_peak_flops(device: torch.device) -> tuple[float | None, str]:
    """The card's dense bf16 peak in FLOP/s and its name; ``None`` where the card is not in the
    table (or on CPU), so model FLOPs utilisation is left out rather than guessed."""
    if device.type != "cuda":
        return None, "cpu"
    name = torch.cuda.get_device_name(device)
    for key, tflops in _BF16_PEAK_TFLOPS.items():
        if key in name:
            return tflops * 1e12, name
    return None, name


def describe(value: Any) -> str:
    """A figure as the check's table prints it."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
