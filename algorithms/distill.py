"""On-policy distillation: a teacher's per-token log-probs turned into the student's advantages (numpy, no torch).

Owns the map from one sampled trajectory's student and teacher log-probs (of the tokens the
student sampled) to one advantage per token. The student minimises the reverse KL
``KL(pi_student || pi_teacher)`` on its own samples; per token the single-sample estimate of it
is ``log pi_student(x_t) - log pi_teacher(x_t)`` with ``x_t ~ pi_student`` (the k1 estimator of
``algorithms.kl``, here a reward rather than a loss term), and its negative is the token's
advantage, so the policy gradient raises tokens the teacher likes more than the student does
and lowers the others (mode-seeking).

Sources: Thinking Machines' blog post "On-Policy Distillation" (2025) and its tinker-cookbook
(``distillation/train_on_policy.py``, ``incorporate_kl_penalty``: the sampled log-prob minus the
teacher's, negated, added to the task advantage); Agarwal et al. 2024, "On-Policy Distillation
of Language Models: Learning from Self-Generated Mistakes" (GKD at its reverse-KL end); slime's
``--use-opd``, which subtracts the same per-token term from any estimator's advantage.
:func:`distillation_advantages` weights the task's side instead (``reward_weight``), so that 0
is pure distillation.

Invariants: pure and deterministic; inputs are not modified; log-probs that are not finite, or
sequences of different lengths, raise ValueError (a ``-inf`` teacher log-prob would make an
infinite advantage, never something to train on silently).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["distillation_advantages", "reverse_kl_per_token"]


def reverse_kl_per_token(student_logprobs: Sequence[float], teacher_logprobs: Sequence[float]) -> np.ndarray:
    """``log pi_student(x_t) - log pi_teacher(x_t)`` at each sampled token: the per-token
    single-sample estimate of ``KL(pi_student || pi_teacher)`` (unbiased when ``x_t`` was sampled
    from the policy the student log-probs are of)."""
    student = np.asarray(student_logprobs, dtype=np.float64)
    teacher = np.asarray(teacher_logprobs, dtype=np.float64)
    if student.shape != teacher.shape or student.ndim != 1:
        raise ValueError(f"student and teacher log-probs must be 1-D of one length, got {student.shape} and {teacher.shape}")
    if not (np.isfinite(student).all() and np.isfinite(teacher).all()):
        raise ValueError(f"log-probs must be finite, got student {student.tolist()} and teacher {teacher.tolist()}")
    return student - teacher


def distillation_advantages(
    student_logprobs: Sequence[float],
    teacher_logprobs: Sequence[float],
    *,
    task_advantage: float = 0.0,
    reward_weight: float = 0.0,
) -> np.ndarray:
    """Per-token advantages ``-(log pi_student - log pi_teacher) + reward_weight * task_advantage``.

    ``task_advantage`` is the trajectory's advantage from the task reward (e.g. GRPO's over its
    group), broadcast over its tokens; ``reward_weight = 0`` is pure distillation.
    """
    if not np.isfinite(task_advantage):
        raise ValueError(f"task_advantage must be finite, got {task_advantage}")
    return reward_weight * task_advantage - reverse_kl_per_token(student_logprobs, teacher_logprobs)
