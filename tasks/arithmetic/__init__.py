"""Column-scratchpad addition: a verifiable task with a long tail of response lengths.

The public face of the task, so other code never hard-codes paths or formats: the task plugin
(``make_task``, found by ``task.name: arithmetic``), the problem generator and prompt format,
the verifier (the reward), the JSONL reader/writer, and
``MODEL_DIR``, the folder of the small model shipped for the task (load it with
``AutoModelForCausalLM.from_pretrained(MODEL_DIR)`` and ``AutoTokenizer.from_pretrained(MODEL_DIR)``),
and ``TEACHER_DIR``, a stronger model of the same recipe and tokenizer (on-policy distillation's
teacher, ``configs/distill_arithmetic.yaml``).

Importing this package pulls in neither torch nor transformers, so reward worker processes
and the config layer stay light; the tokenizer and pretraining modules import them.
"""

from __future__ import annotations

from tandem.tasks.arithmetic.jsonl import load_jsonl, write_jsonl
from tandem.tasks.arithmetic.problems import (
    MAX_RESPONSE_CHARS,
    Problem,
    format_prompt,
    format_response,
    generate_problems,
)
from tandem.tasks.arithmetic.task import MODEL_DIR, TEACHER_DIR, ArithmeticTask, make_task
from tandem.tasks.arithmetic.verifier import extract_answer, verify

# One token per character plus <eos>: a max_new_tokens that never truncates a correct answer.
MAX_RESPONSE_TOKENS = MAX_RESPONSE_CHARS + 1

__all__ = [
    "MAX_RESPONSE_TOKENS",
    "MODEL_DIR",
    "TEACHER_DIR",
    "ArithmeticTask",
    "Problem",
    "extract_answer",
    "format_prompt",
    "format_response",
    "generate_problems",
    "load_jsonl",
    "make_task",
    "verify",
    "write_jsonl",
]
