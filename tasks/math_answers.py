"""Rewards for math answers: equivalence of the final answer with the ground truth, and its format.

``math`` takes the response's final answer (the content of its last ``\\boxed{...}``, else its
last number: an integer, a decimal or a fraction ``a/b``) and asks HF's ``math-verify`` whether
it equals the ground truth (``\\boxed{\\frac{1}{2}}`` against ``0.5`` is right). ``boxed`` scores
the format alone (a non-empty ``\\boxed{...}``), to combine with ``math`` by weight::

    task.rewards: [{fn: "tandem.tasks.math_answers:math"}, {fn: "tandem.tasks.math_answers:boxed", weight: 0.1}]

Both belong in the reward worker pool (the default runner): sympy can take minutes on an
adversarial answer (``9^{9^{9^{9}}}``), and math-verify's own signal-based timeouts are turned
off so that the pool's ``task.reward_timeout_s`` is the one bound, failing that sample with the
reason recorded rather than scoring it 0 in silence.
"""

from __future__ import annotations

import logging
import re

try:  # the math extra, imported with this module: a pool worker imports it before any call is timed
    from math_verify import parse, verify
except ImportError:  # ``boxed`` and ``final_answer`` need nothing more; ``math`` says what is missing
    parse = verify = None

__all__ = ["boxed", "boxed_content", "final_answer", "math"]

_BOXED = "\\boxed{"
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:\s*/\s*\d+)?")


def boxed_content(response: str) -> str | None:
    """What the last ``\\boxed{...}`` of ``response`` holds (nested braces kept); None when there
    is none or it never closes."""
    start = response.rfind(_BOXED)
    if start < 0:
        return None
    depth, begin = 1, start + len(_BOXED)
    for i in range(begin, len(response)):
        depth += {"{": 1, "}": -1}.get(response[i], 0)
        if depth == 0:
            return response[begin:i]
    return None


def final_answer(response: str) -> str | None:
    """The final answer of ``response``: its last boxed content, else its last number; None: neither."""
    content = boxed_content(response)
    if content is not None:
        return content
    numbers = _NUMBER.findall(response)
    return numbers[-1] if numbers else None


def math(response: str, answer: str | None) -> float:
    """1.0 when the final answer of ``response`` is mathematically equal to ``answer``, else 0.0.
    Raises (failing the sample) for an item without an answer."""
    if answer is None:
        raise ValueError("the math reward needs the item's answer (the ground truth)")
    predicted = final_answer(response)
    if predicted is None:
        return 0.0
    if parse is None or verify is None:
        raise ImportError("the math reward needs math-verify: pip install 'tandem[math]'")
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns on every call that its own timeouts are off
    gold = parse(_latex(answer), parsing_timeout=None)
    if not gold:
        raise ValueError(f"math-verify cannot read the ground truth {answer!r}")
    return 1.0 if verify(gold, parse(_latex(predicted), parsing_timeout=None), timeout_seconds=None) else 0.0


def boxed(response: str, answer: str | None) -> float:
    """1.0 when ``response`` puts an answer in ``\\boxed{...}``, else 0.0 (the format alone)."""
    content = boxed_content(response)
    return 1.0 if content is not None and content.strip() else 0.0


def _latex(expression: str) -> str:
    """``expression`` as math-verify reads it best: in ``$...$``, so a LaTeX answer is taken whole."""
    return f"${expression}$"
