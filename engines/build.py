"""The text workload's bundle, by where generation runs: the composition root of the placements.

``engines.rollout`` picks a placement: ``embedded`` (the torch engine in this process),
``vllm`` (vLLM in this process), ``server`` / ``sglang`` (``tandem serve`` or sglang processes
behind the router) or ``vllm_server`` (vLLM servers behind the router). Each placement's builder
composes the text workload's parts (``engines.text.build``) with its own engine and weight sync;
this module only chooses, so that no placement imports another and the text workload imports
none of them (the acyclic contract in pyproject.toml). The episode workload builds on the same
choice (``engines.agentic.build``).
"""

from __future__ import annotations

from tandem.core.components import Components, TaskSetup
from tandem.core.config import TandemConfig, TorchEnginesConfig
from tandem.engines.text.build import build_torch_components

__all__ = ["build_text_components"]


def build_text_components(config: TandemConfig, setup: TaskSetup) -> Components:
    """The text bundle for a config whose ``engines.type`` is ``torch`` (``pipeline.builders.WORKLOADS``).
    The placements' modules are imported only when chosen: vLLM and aiohttp are heavy."""
    spec = config.engines
    assert isinstance(spec, TorchEnginesConfig)
    if spec.rollout == "vllm_server":
        from tandem.engines.vllm.build import build_vllm_server_components

        return build_vllm_server_components(config, setup)
    if spec.rollout in ("server", "sglang"):
        from tandem.engines.server.build import build_server_components

        return build_server_components(config, setup)
    if spec.rollout == "vllm":
        from tandem.engines.vllm.build import vllm_rollout

        return build_torch_components(config, setup, vllm_rollout)
    return build_torch_components(config, setup)
