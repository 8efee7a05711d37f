"""Multi-digit addition problems with a column-by-column scratchpad: the generator and formats.

This module owns what a problem looks like: the operand-length distribution, the prompt
format and the worked solution (the scratchpad the shipped model was pretrained to write).

A problem ``4589+123`` reads, prompt then the reference response::

    4589+123=            <- prompt, ending in a newline (the tokenizer prepends <bos>)
    9+3+0=12             <- one line per column, least significant first: a+b+carry_in=sum
    8+2+1=11
    5+1+1=07
    4+0+0=04
    =4712                <- final answer line (the verifier reads only this)

Each column line has a fixed width (9 characters with its newline), so a response is
``9 * columns + len(answer) + 1`` characters long: 11 for ``3+4`` and 82 for two 8-digit
operands. Operand lengths are drawn from a geometric-like distribution (many short, a few
long), so response lengths spread over ~7x, the long tail asynchronous RL has to hide.

Invariant: everything here is a pure function of its arguments (``seed`` included), so the
same seed gives the same problems on every machine.
"""

from __future__ import annotations

import random
from typing import TypedDict

MAX_DIGITS = 8
# P(operand has k digits) is proportional to LENGTH_DECAY ** (k - 1): with 0.6, about 40 %
# of operands have one digit and ~1 % have eight, so most responses are short.
LENGTH_DECAY = 0.6
COLUMN_LINE_CHARS = len("9+3+0=12\n")
# The longest reference response: 8 column lines, "=", a 9-digit answer. Generation budgets
# (max_new_tokens) must leave room for it plus the end-of-sequence token.
MAX_RESPONSE_CHARS = MAX_DIGITS * COLUMN_LINE_CHARS + 1 + MAX_DIGITS + 1
# Seeds of the evaluation problem streams, kept apart from every training stream (short problems
# still repeat: there are only 100 one-digit sums): pretraining's early-stopping check set, and
# the report set it measured the shipped model on, which RL holds out for evaluation.
CHECK_SEED, REPORT_SEED = 1_000_001, 1_000_002


class Problem(TypedDict):
    """One row of the task: what the model is shown and the answer the verifier expects."""

    prompt: str
    answer: str


def format_prompt(a: int, b: int) -> str:
    """The prompt for ``a + b``; the response starts right after the ``=``'s newline."""
    if a < 0 or b < 0:
        raise ValueError(f"operands must be non-negative, got {a} and {b}")
    return f"{a}+{b}=\n"


def format_response(a: int, b: int) -> str:
    """The reference response for ``a + b``: the column scratchpad, then ``=answer``."""
    digits_a, digits_b = str(a)[::-1], str(b)[::-1]
    lines: list[str] = []
    carry = 0
    for column in range(max(len(digits_a), len(digits_b))):
        da = int(digits_a[column]) if column < len(digits_a) else 0
        db = int(digits_b[column]) if column < len(digits_b) else 0
        total = da + db + carry
        lines.append(f"{da}+{db}+{carry}={total:02d}")
        carry = total // 10
    lines.append(f"={a + b}")
    return "\n".join(lines)


def sample_operands(rng: random.Random) -> tuple[int, int]:
    """Two operands whose digit counts follow the skewed length distribution."""
    return _sample_operand(rng), _sample_operand(rng)


def generate_problems(n: int, seed: int) -> list[Problem]:
    """``n`` problems drawn deterministically from ``seed``."""
    rng = random.Random(seed)
    problems: list[Problem] = []
    for _ in range(n):
        a, b = sample_operands(rng)
        problems.append(Problem(prompt=format_prompt(a, b), answer=str(a + b)))
    return problems


_LENGTH_WEIGHTS = [LENGTH_DECAY**k for k in range(MAX_DIGITS)]


def _sample_operand(rng: random.Random) -> int:
    digits = rng.choices(range(1, MAX_DIGITS + 1), weights=_LENGTH_WEIGHTS)[0]
    if digits == 1:
        return rng.randrange(10)
    return rng.randrange(10 ** (digits - 1), 10**digits)
