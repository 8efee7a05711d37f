"""The calculator task's reward: 1.0 for an episode whose final answer is right, else 0.0.

``response`` is the episode as the episode workload renders it (``engines.agentic.EpisodePayload``,
read by attribute: a task imports no engine). The environment already judged the final answer
with the arithmetic verifier on everything written after the prompt (model turns and tool
answers), and paid that on the last step; an episode cut off before answering earned nothing.
"""

from __future__ import annotations

from typing import Any

__all__ = ["correct"]


def correct(response: Any, answer: str | None) -> float:
    """The environment's verdict: 1.0 for a right final answer, 0.0 otherwise."""
    return 1.0 if response.env_return >= 1.0 else 0.0
