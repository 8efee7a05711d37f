"""The reward: a pure, exception-free check of a response's final answer.

Owns the rule that decides correctness, so the reward role, the pretraining evaluation and
the tests agree. Only the final ``=answer`` line counts; the scratchpad above it is not
graded (RL may reshape it). The function never raises on model output: anything that is not
a well-formed final line scores 0.0. It imports nothing heavy, so reward worker processes
start fast.
"""

from __future__ import annotations

import re

# The final line is "=" then the digits of the sum, with no sign and no leading zero (unless
# the sum is 0): the canonical form, so exactly one string is correct.
_FINAL_LINE = re.compile(r"=(0|[1-9][0-9]*)")


def extract_answer(response_text: str) -> str | None:
    """The answer written on the response's last non-empty line, or None if it is malformed."""
    lines = [line.strip() for line in response_text.splitlines() if line.strip()]
    if not lines:
        return None
    match = _FINAL_LINE.fullmatch(lines[-1])
    return match.group(1) if match else None


def verify(response_text: str, answer: str) -> float:
    """1.0 when the response's final answer equals ``answer``, else 0.0 (malformed included)."""
    extracted = extract_answer(response_text)
    return 1.0 if extracted is not None and extracted == answer.strip() else 0.0
