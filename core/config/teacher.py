"""The teacher's section (on-policy distillation) and the rules it imposes on the rest of the config.

A teacher is a frozen model that scores each action of the student's own samples (the
``teacher_logp`` stage); the train role turns its log-probs into per-token advantages, the
negative reverse KL (``algorithms.distill``). The section and the stage go together. Whether the
teacher's tokenizer is the student's can only be read from its files: the torch builder checks it
before any engine starts (``engines.text.build.teacher_engine``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field

from tandem.core.config.section import Section

if TYPE_CHECKING:
    from tandem.core.config.schema import TandemConfig

__all__ = ["TeacherConfig", "check_teacher"]


class TeacherConfig(Section):
    """On-policy distillation: a teacher scores every action the student samples; the student
    minimises the reverse KL to it (per-token advantage ``-(log pi_student - log pi_teacher)``,
    the student's being the behaviour log-probs the rollout recorded)."""

    model_path: Path | None = None
    """A local Hugging Face checkpoint folder (model + tokenizer) whose tokenizer is the student's;
    relative paths are taken from the working directory, then from the project root. Required with
    ``engines.type: torch``; the fake engines' teacher has no model (leave it unset)."""
    reward_weight: float = Field(0.0, ge=0.0)
    """Weight of the task reward's advantage (``algorithm.advantage`` over each group's rewards)
    added to every token's distillation advantage; 0: pure distillation (the rewards are still
    computed and reported)."""
    threads: int | None = Field(None, ge=1)
    """CPU threads of the teacher's engine (a worker thread of its own); None: the trainer's
    per-rank budget, as the reference model gets. Torch engines only."""


def check_teacher(config: TandemConfig) -> None:
    """The teacher section and the ``teacher_logp`` stage go together, and the rest of the run can
    use per-token teacher advantages."""
    teacher, algo = config.teacher, config.algorithm
    staged = "teacher_logp" in config.flow.stages
    if teacher is None:
        if staged:
            raise ValueError(
                "flow.stages has teacher_logp but no teacher is configured: add a teacher section (teacher.model_path)"
            )
        return
    if not staged:
        raise ValueError("teacher is set but flow.stages has no teacher_logp stage: its log-probs would never be computed")
    if config.engines.type == "torch":
        if teacher.model_path is None:
            raise ValueError("teacher.model_path: engines.type=torch needs the teacher's checkpoint folder")
    elif teacher.model_path is not None or teacher.threads is not None:
        raise ValueError(
            f"teacher.model_path and teacher.threads apply to engines.type=torch; the {config.engines.type} "
            "engines' teacher has no model: leave them unset"
        )
    if algo.advantage == "gae":
        raise ValueError(
            "teacher with algorithm.advantage=gae: both set per-token advantages; distill with a group "
            "estimator (grpo, rloo, reinforce), whose advantage teacher.reward_weight mixes in"
        )
    if algo.dynamic_sampling:
        raise ValueError(
            "teacher with algorithm.dynamic_sampling: a group whose rewards are all equal still carries "
            "the teacher's per-token signal; dynamic sampling would drop it"
        )
    if config.cluster.backend != "local":
        raise ValueError("teacher: the teacher's engine runs in this process (cluster.backend=local); no Ray actor serves it")
