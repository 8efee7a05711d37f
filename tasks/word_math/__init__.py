"""Word problems with exact answers (integers, fractions, decimals), asked as chat messages.

The public face of the task: the plugin (``make_task``, found by ``task.name: word_math``), the
problem generator, and ``MODEL_DIR``, the small chat model shipped for it (a character
tokenizer with a ChatML template, pretrained by ``python -m tandem.tasks.word_math.pretrain``).
Rewards are the shipped math rewards (``tasks.math_answers``). Importing this package pulls in
neither torch nor transformers.
"""

from __future__ import annotations

from tandem.tasks.word_math.problems import REPORT_SEED, Problem, generate_problems, messages
from tandem.tasks.word_math.task import MAX_RESPONSE_TOKENS, MODEL_DIR, WordMathTask, make_task

__all__ = [
    "MAX_RESPONSE_TOKENS",
    "MODEL_DIR",
    "REPORT_SEED",
    "Problem",
    "WordMathTask",
    "generate_problems",
    "make_task",
    "messages",
]
