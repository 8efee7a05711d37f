"""Typed messages between roles that are not plain records."""

from __future__ import annotations

from dataclasses import dataclass

from core.records import PromptGroup, Sample

__all__ = ["Generation"]


@dataclass(slots=True)
class Generation:
    """One finished sample with the prompt group it belongs to (generate -> rollout)."""

    group: PromptGroup
    sample: Sample

    @property
    def prompt_id(self) -> int:
        return self.group.prompt_id
