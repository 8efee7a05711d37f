"""The base every config section derives from: unknown keys are errors, sections are frozen, and
each field's docstring is its description (``tandem config show`` and the docs read it)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["Section"]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
