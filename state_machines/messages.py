"""Typed messages between roles that are not plain records."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.core.records import PromptGroup, Trajectory

__all__ = ["Generation"]


@dataclass(slots=True)
class Generation:
    """One finished trajectory with the prompt group it belongs to (generate -> rollout)."""

    group: PromptGroup
    trajectory: Trajectory

    @property
    def prompt_id(self) -> int:
        return self.group.prompt_id
