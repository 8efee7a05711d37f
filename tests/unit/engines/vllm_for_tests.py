"""vLLM test helpers: the shipped worker extension with a switch that brings the CPU bug back.

vLLM imports the extension by name in its engine-core process, which inherits this test
session's ``sys.path``; hence a module of its own, importable as ``vllm_for_tests``.
"""

from __future__ import annotations

from engines.vllm.worker import TandemWorkerExtension

EXTENSION = "vllm_for_tests.SwitchableExtension"


class SwitchableExtension(TandemWorkerExtension):
    """:class:`TandemWorkerExtension`, plus ``tandem_test_stale_head(True)``: reloads then leave a
    tied output projection packed from the old embedding, as vLLM's CPU backend does unfixed."""

    def tandem_test_stale_head(self, stale: bool) -> None:
        self._tandem_stale_head = stale

    def refresh_output_projection(self) -> None:
        if not getattr(self, "_tandem_stale_head", False):
            super().refresh_output_projection()
