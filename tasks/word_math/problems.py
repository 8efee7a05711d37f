"""Word problems with exact answers: the generator, the chat prompt and the worked response.

Four kinds, drawn uniformly, each a short sentence about small numbers (a tiny model learns them
in minutes) whose answer is an integer, a fraction or a decimal::

    sam has 12 pens and gets 7. how many now?        12+7=\\boxed{19}
    sam has 12 pens and gives 7 away. how many left?  12-7=\\boxed{5}
    6 pies for 4 kids. how much pie each?             6/4=\\boxed{3/2}
    a cap is 1.5, a pen is 2.7. what is the total?    1.5+2.7=\\boxed{4.2}

A prompt is one user message (the model's chat template renders it); the response writes the
operation, then the answer in ``\\boxed{}``, which the ``math`` reward checks for equivalence
(``6/4`` is right for ``3/2``). Everything here is a pure function of its arguments (``seed``
included), so the same seed gives the same problems on every machine.
"""

from __future__ import annotations

import random
from fractions import Fraction
from typing import TypedDict

__all__ = ["CHARACTERS", "CHECK_SEED", "REPORT_SEED", "Problem", "generate_problems", "messages", "sample_problem"]

NAMES = ("sam", "ann", "bo", "kim", "lee", "max")
THINGS = ("pen", "cup", "hat", "egg", "box", "toy")
PIES = ("pie", "cake", "pizza")
# Every character a prompt, a response or the chat template writes.
CHARACTERS = (*"abcdefghijklmnopqrstuvwxyz", *"0123456789", " ", ".", ",", "?", "/", "+", "-", "=", "\\", "{", "}", "\n")
# The evaluation problems' seed, apart from every training stream: pretraining's report set, which RL holds out.
CHECK_SEED, REPORT_SEED = 2_000_001, 2_000_002


class Problem(TypedDict):
    """One problem: its text (the user's message), the reference response and the exact answer."""

    question: str
    response: str
    answer: str


def _decimal(rng: random.Random) -> str:
    return f"{rng.randint(1, 9)}.{rng.randint(1, 9)}"


def sample_problem(rng: random.Random) -> Problem:
    """One problem of a kind drawn uniformly."""
    kind = rng.randrange(4)
    if kind < 2:
        name, thing, a, b = rng.choice(NAMES), rng.choice(THINGS), rng.randint(2, 20), rng.randint(1, 9)
        if kind == 0:
            question, expression, value = f"{name} has {a} {thing}s and gets {b}. how many now?", f"{a}+{b}", a + b
        else:
            a = a + b  # the result stays positive
            question, expression, value = f"{name} has {a} {thing}s and gives {b} away. how many left?", f"{a}-{b}", a - b
        answer = str(value)
    elif kind == 2:
        pie, a, b = rng.choice(PIES), rng.randint(1, 12), rng.randint(2, 9)
        question, expression = f"{a} {pie}s for {b} kids. how much {pie} each?", f"{a}/{b}"
        answer = str(Fraction(a, b))
    else:
        x, y = _decimal(rng), _decimal(rng)
        question, expression = f"a cap is {x}, a pen is {y}. what is the total?", f"{x}+{y}"
        total = Fraction(x) + Fraction(y)
        answer = str(total.numerator) if total.denominator == 1 else f"{float(total):g}"
    return Problem(question=question, response=f"{expression}=\\boxed{{{answer}}}", answer=answer)


def generate_problems(n: int, seed: int) -> list[Problem]:
    """``n`` problems from the stream of ``seed``."""
    rng = random.Random(seed)
    return [sample_problem(rng) for _ in range(n)]


def messages(problem: Problem) -> tuple[dict[str, str], ...]:
    """The problem as the chat the model is shown."""
    return ({"role": "user", "content": problem["question"]},)
