"""vLLM test helpers: the shipped worker extension with a switch that brings the CPU bug back.

vLLM imports the extension by name in its engine-core process, which inherits this test
session's ``sys.path``; hence a module of its own, importable as ``vllm_for_tests``.
"""

from __future__ import annotations

import os
import time

from tandem.engines.vllm.worker import TandemWorkerExtension

EXTENSION = "vllm_for_tests.SwitchableExtension"


class SwitchableExtension(TandemWorkerExtension):
    """:class:`TandemWorkerExtension`, plus two switches and a probe: ``tandem_test_stale_head(True)``:
    reloads then leave a tied output projection packed from the old embedding, as vLLM's CPU
    backend does unfixed; ``tandem_test_hang(s)``: the next load first sleeps ``s`` seconds (a hung
    update); ``tandem_test_threads()``: the cores the model's thread may run on, and the size of
    its OpenMP team."""

    def tandem_test_threads(self) -> dict[str, object]:
        import torch

        return {"cores": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads()}

    def tandem_test_stale_head(self, stale: bool) -> None:
        self._tandem_stale_head = stale

    def tandem_test_hang(self, seconds: float) -> None:
        self._tandem_hang_s = seconds

    def tandem_load_shm(self, segment: str, manifest: dict, headers: list[dict]) -> dict:  # type: ignore[type-arg]
        hang, self._tandem_hang_s = getattr(self, "_tandem_hang_s", 0.0), 0.0
        time.sleep(hang)
        return super().tandem_load_shm(segment, manifest, headers)

    def refresh_output_projection(self) -> None:
        if not getattr(self, "_tandem_stale_head", False):
            super().refresh_output_projection()
