"""Addition with a calculator tool: a multi-turn, tool-use environment over the arithmetic task.

The public face of the task: the task plugin (``make_task``, found by ``task.name: calculator``;
reward ``tasks.calculator.reward:correct``), :class:`CalculatorEnvironment` (``core.environment``'s
protocol), the turn parser and the turn limit, and ``MODEL_DIR``, the shipped model (the arithmetic
model fine-tuned to call the tool by ``tasks.calculator.pretrain``). The problems, the prompt
format and the verifier are the arithmetic task's (``tasks.arithmetic``). Imports neither torch
nor transformers.
"""

from __future__ import annotations

from tandem.tasks.calculator.environment import MAX_TURN_CHARS, MAX_TURNS, TOOL_ERROR, CalculatorEnvironment, parse_turn
from tandem.tasks.calculator.task import HELD_OUT_SEEDS, MODEL_DIR, TRAIN_SEEDS, CalculatorTask, make_task

__all__ = [
    "HELD_OUT_SEEDS",
    "MAX_TURNS",
    "MAX_TURN_CHARS",
    "MODEL_DIR",
    "TOOL_ERROR",
    "TRAIN_SEEDS",
    "CalculatorEnvironment",
    "CalculatorTask",
    "make_task",
    "parse_turn",
]
