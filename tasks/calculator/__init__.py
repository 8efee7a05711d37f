"""Addition with a calculator tool: a multi-turn, tool-use environment over the arithmetic task.

The public face of the task: :class:`CalculatorEnvironment` (``core.environment``'s protocol),
the turn parser and the turn limit. The problems, the prompt format and the verifier are the
arithmetic task's (``tasks.arithmetic``); no model ships here yet (see the environment's module
docstring for the format a model needs). Imports neither torch nor transformers.
"""

from __future__ import annotations

from tasks.calculator.environment import MAX_TURN_CHARS, MAX_TURNS, TOOL_ERROR, CalculatorEnvironment, parse_turn

__all__ = ["MAX_TURNS", "MAX_TURN_CHARS", "TOOL_ERROR", "CalculatorEnvironment", "parse_turn"]
