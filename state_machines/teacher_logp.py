"""The teacher_logp role: on-policy distillation's teacher scores every action the student sampled.

It owns the teacher's side of distillation: each trajectory gets the teacher's log-prob of each
of its actions (``Trajectory.teacher_logprobs``, at the sampling temperature: the engine scores
``log_softmax(logits / rollout.temperature)`` as the rollout sampled) stamped with the teacher's
version (``teacher_version``; fixed, the teacher never trains). It runs beside ``ref_logp`` and
like it: a chain stage after rollout, asynchronous, in micro-batches, on the teacher's own engine
(its own worker thread and thread budget), under the role's error policy.

What the numbers become is here too, so the role's whole life reads in one file: the train role
calls :func:`distill` on a step's trajectories, which sets each one's per-token advantages to the
negative reverse KL to the teacher (``algorithms.distill``) plus the task's advantage times
``teacher.reward_weight``. The student's log-probs there are the behaviour log-probs the rollout
recorded: the distribution the tokens were actually sampled from, so ``log pi_behav - log
pi_teacher`` is an unbiased estimate of that policy's reverse KL (tinker-cookbook uses its
sampler's log-probs the same way); they exist as soon as a sample does, so distillation needs
no ``logp`` stage and works with every ``algorithm.proximal``; and the loss's off-policy
machinery (decoupled PPO's behaviour weight) corrects for the student having moved since, as it
does for any advantage. At ``k = 0`` behaviour and trainer log-probs agree to float rounding.

Checkpoints: a checkpoint holds the teacher's weights (``core.checkpoint``, as for the
reference), and trajectories in flight are generated, and so scored, again on resume: the
teacher's numbers after a resume are the ones the run started with.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.algorithms.distill import distillation_advantages, reverse_kl_per_token
from tandem.core.records import Trajectory, TrajectoryGroup
from tandem.state_machines.base import Stage
from tandem.state_machines.logp import score

__all__ = ["TeacherLogPStateMachine", "distill", "mean_reverse_kl"]


class TeacherLogPStateMachine(Stage[TrajectoryGroup, TrajectoryGroup]):
    role = "teacher_logp"

    async def process(self, items: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
        engine = self.services.components.teacher
        if engine is None:
            raise RuntimeError("the teacher_logp stage runs but the components have no teacher engine")
        version = engine.version
        for trajectory, lp in await score(engine, items, "teacher log-probs"):
            trajectory.teacher_logprobs, trajectory.teacher_version = lp, version
        self.version = version
        return items


def _teacher_logprobs(trajectory: Trajectory) -> list[float]:
    if trajectory.teacher_logprobs is None:
        raise ValueError(
            f"prompt {trajectory.prompt_id} trajectory {trajectory.index} reached training without teacher log-probs"
        )
    return trajectory.teacher_logprobs


def distill(trajectories: Sequence[Trajectory], reward_weight: float) -> None:
    """Set each trajectory's ``token_advantages``: ``-(log pi_behav - log pi_teacher)`` per action
    plus ``reward_weight`` times its task ``advantage`` (set before, from its group's rewards)."""
    for t in trajectories:
        assert t.advantage is not None  # the train role sets it first
        t.token_advantages = distillation_advantages(
            t.behaviour_logprobs, _teacher_logprobs(t), task_advantage=t.advantage, reward_weight=reward_weight
        ).tolist()


def mean_reverse_kl(trajectories: Sequence[Trajectory]) -> float:
    """The step's reverse-KL estimate to the teacher: the mean of ``log pi_behav - log pi_teacher``
    over its trained actions (0 when none is trained); what distillation drives down."""
    total, count = 0.0, 0
    for t in trajectories:
        kl = reverse_kl_per_token(t.behaviour_logprobs, _teacher_logprobs(t))
        mask = t.loss_mask if t.loss_mask is not None else [1] * t.num_actions
        total += float(sum(k for k, m in zip(kl, mask, strict=True) if m))
        count += sum(mask)
    return total / count if count else 0.0
