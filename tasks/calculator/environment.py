"""Column addition with a calculator tool: the arithmetic task as a multi-turn, tool-use environment.

Owns the text protocol between the model and the tool. The model gets the arithmetic task's
prompt (``tasks.arithmetic.format_prompt``) and works through the columns; at the end of any turn
it may hand the column it is on to the calculator, which adds it. Each model turn is the decoded
text the model wrote before its end-of-turn token, and its **last line** decides what it is:

- a tool call, ``a+b+c=`` with ``a``, ``b``, ``c`` single digits (two digits of a column and the
  carry): the calculator answers with the sum written as the scratchpad writes it, two digits
  then a newline (``9+3+0=`` → ``12\\n``, ``5+1+1=`` → ``07\\n``); the episode goes on, reward 0;
- a final answer, ``=`` then digits (``=4712``): the episode terminates and the reward is the
  arithmetic verifier's (``tasks.arithmetic.verify``) on the whole response;
- anything else (an empty line, a sum of multi-digit numbers, stray text) is malformed: the tool
  answers ``?\\n``, the turn counts, reward 0, ``info["error"]`` says why, and the episode goes on
  (as a malformed FrozenLake action does).

Lines above the last are the model's own scratchpad and are not checked: the model *may* call
the tool, one column per turn, or write any columns itself. With the tool's answers spliced in,
a transcript reads character for character like the arithmetic scratchpad::

    4589+123=\\n           prompt
    9+3+0=    12\\n        model turn (tool call), the tool's answer
    8+2+1=    11\\n
    5+1+1=    07\\n
    4+0+0=    04\\n
    =4712                 model turn (final answer): reward 1.0

so the arithmetic model's format carries over: it plays this environment as it is in one turn
(its whole scratchpad and answer), and learns to use the tool by ending a turn after a column's
``=``. The response the verifier reads is everything after the prompt (model turns and tool
answers, concatenated); only its final line counts.

Invariants: ``reset(seed)`` gives the problem ``tasks.arithmetic.generate_problems(1, seed)[0]``;
an episode terminates on the first final answer and is truncated on the ``max_turns``-th turn
otherwise; only the terminating step can have a non-zero reward.
"""

from __future__ import annotations

import re

from tandem.core.environment import StepResult
from tandem.tasks.arithmetic import MAX_RESPONSE_CHARS, Problem, generate_problems, verify
from tandem.tasks.arithmetic.problems import MAX_DIGITS

__all__ = ["MAX_TURNS", "MAX_TURN_CHARS", "TOOL_ERROR", "CalculatorEnvironment", "parse_turn"]

# One tool call per column of the longest problem, the final answer, and three spare turns.
MAX_TURNS = MAX_DIGITS + 1 + 3
# A turn never needs more characters than the longest reference response (the one-turn solution):
# the per-turn generation budget, plus one token for the end of turn.
MAX_TURN_CHARS = MAX_RESPONSE_CHARS
TOOL_ERROR = "?\n"
_TOOL_CALL = re.compile(r"([0-9])\+([0-9])\+([0-9])=")
_FINAL_ANSWER = re.compile(r"=[0-9]+")


def parse_turn(turn_text: str) -> tuple[str, int | None]:
    """What a turn asks for: ``("tool_call", column sum)``, ``("final_answer", None)`` or
    ``("malformed", None)``, read from its last line."""
    last_line = turn_text.rsplit("\n", 1)[-1]
    if call := _TOOL_CALL.fullmatch(last_line):
        return "tool_call", sum(int(digit) for digit in call.groups())
    if _FINAL_ANSWER.fullmatch(last_line):
        return "final_answer", None
    return "malformed", None


class CalculatorEnvironment:
    """One addition problem per ``reset(seed)``, a calculator tool for its columns; implements
    ``core.environment.Environment``."""

    def __init__(self, max_turns: int = MAX_TURNS) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {max_turns}")
        self.max_turns = max_turns
        self.problem: Problem | None = None
        self.response = ""  # everything after the prompt so far: model turns and tool answers
        self.turns = 0
        self.tool_calls = 0
        self.ended = False

    def reset(self, seed: int) -> str:
        """A fresh episode on the problem of ``seed``; its prompt."""
        self.problem = generate_problems(1, seed)[0]
        self.response = ""
        self.turns = 0
        self.tool_calls = 0
        self.ended = False
        return self.problem["prompt"]

    def step(self, action_text: str) -> StepResult:
        """Answer one turn: the tool's result, the final verdict, or an error (see the module doc)."""
        if self.problem is None or self.ended:
            raise RuntimeError("step outside an episode: call reset first")
        self.turns += 1
        kind, column_sum = parse_turn(action_text)
        info: dict[str, object] = {"kind": kind}
        reward, terminated = 0.0, False
        if kind == "tool_call":
            self.tool_calls += 1
            observation = f"{column_sum:02d}\n"
        elif kind == "final_answer":
            observation = ""
            terminated = True
            reward = verify(self.response + action_text, self.problem["answer"])
        else:
            observation = TOOL_ERROR
            info["error"] = "the last line must be a column 'a+b+c=' of three single digits, or the answer '=N'"
        self.response += action_text + observation
        truncated = not terminated and self.turns >= self.max_turns
        self.ended = terminated or truncated
        info["tool_calls"] = self.tool_calls
        return StepResult(observation, reward, terminated, truncated, info)
