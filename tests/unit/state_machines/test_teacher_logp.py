"""The teacher_logp role (on-policy distillation): the teacher scores each sampled token, stamped
with its fixed version; the train role turns those scores into per-token advantages equal to the
negative reverse KL computed by hand on a toy vocabulary (plus the task advantage by its weight);
the teacher and its stage go together in config; a run on the fake engines trains with them,
and checkpoints the teacher so a resumed run scores with the one it started with."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import pytest

from tandem.core.config import ConfigError
from tandem.core.history import RunHistory
from tandem.core.ledger import Ledger
from tandem.core.records import FinishReason, PromptGroup, TaskItem, Trajectory, TrajectoryGroup, token_trajectory
from tandem.core.staleness import StalenessGate, VersionClock
from tandem.core.trace import TraceRecorder
from tandem.pipeline import AsyncTrainingFlow
from tandem.pipeline.builders import build_components
from tandem.state_machines.base import FlowServices
from tandem.state_machines.teacher_logp import TeacherLogPStateMachine, mean_reverse_kl
from tandem.state_machines.train import TrainStateMachine
from tests.conftest import make_config, run_virtual
from tests.unit.pipeline.test_flow import recording

TEACHER_STAGES = ["dataloader", "generate", "rollout", "teacher_logp", "reward", "train"]

# A three-token vocabulary: the next-token distribution at each of three positions.
STUDENT = [[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.25, 0.25, 0.5]]
TEACHER = [[0.7, 0.2, 0.1], [0.2, 0.2, 0.6], [0.1, 0.8, 0.1]]


class TableTeacher:
    """A teacher over the toy vocabulary: the log-prob of each response token from ``TEACHER``."""

    version = 7  # a teacher's version is whatever it is, and fixed

    async def logprobs(self, trajectories: Sequence[Trajectory]) -> list[list[float]]:
        return [[math.log(TEACHER[i][x]) for i, x in enumerate(t.payload.response_ids)] for t in trajectories]


def sampled(index: int, tokens: list[int], reward: float) -> Trajectory:
    """A trajectory the student sampled: its behaviour log-probs read from ``STUDENT``."""
    trajectory = token_trajectory(
        0, index, [1], tokens, [math.log(STUDENT[i][x]) for i, x in enumerate(tokens)], [0] * len(tokens),
        FinishReason.STOP,
    )
    trajectory.reward = reward
    return trajectory


def services(reward_weight: float) -> FlowServices:
    cfg = make_config(flow={"stages": TEACHER_STAGES}, teacher={"reward_weight": reward_weight})
    clock = VersionClock()
    gate = StalenessGate(clock, cfg.staleness.k, cfg.train.prompts_per_step, cfg.run.max_steps, 100)
    components = build_components(cfg)
    components.teacher = TableTeacher()
    return FlowServices(cfg, clock, gate, Ledger(gate), components, TraceRecorder(0.0, 1000), RunHistory())


def scored_and_advantaged(reward_weight: float) -> tuple[TeacherLogPStateMachine, list[Trajectory]]:
    """Two samples of one prompt through the teacher role, then the train role's advantages."""

    async def scenario() -> tuple[TeacherLogPStateMachine, list[Trajectory]]:
        svc = services(reward_weight)
        samples = [sampled(0, [0, 2, 1], 1.0), sampled(1, [1, 1], 0.0)]
        group = TrajectoryGroup(PromptGroup(0, TaskItem("p", [1]), 2, step=0), samples)
        teacher = TeacherLogPStateMachine("teacher_logp", svc)
        scored = await teacher.process([group])
        return teacher, TrainStateMachine("train", svc).advantages(scored)

    return run_virtual(scenario())


def test_each_tokens_advantage_is_the_negative_reverse_kl_to_the_teacher() -> None:
    teacher, (first, second) = scored_and_advantaged(reward_weight=0.0)
    # By hand: -(log p_student(x) - log p_teacher(x)) = log(p_teacher(x) / p_student(x)) per token.
    assert first.token_advantages == pytest.approx([math.log(0.7 / 0.5), math.log(0.6 / 0.3), math.log(0.8 / 0.25)])
    assert second.token_advantages == pytest.approx([math.log(0.2 / 0.3), math.log(0.2 / 0.6)])
    # The teacher's log-probs are kept with the version of the teacher that computed them.
    assert first.teacher_logprobs == pytest.approx([math.log(0.7), math.log(0.6), math.log(0.8)])
    assert first.teacher_version == second.teacher_version == teacher.version == 7
    # The step's reverse-KL estimate: the mean over its five trained tokens.
    by_hand = -sum(math.log(r) for r in (1.4, 2.0, 3.2, 2 / 3, 1 / 3)) / 5
    assert mean_reverse_kl([first, second]) == pytest.approx(by_hand)


def test_the_task_advantage_is_mixed_in_by_its_weight() -> None:
    _, pure = scored_and_advantaged(reward_weight=0.0)
    _, mixed = scored_and_advantaged(reward_weight=0.5)
    # GRPO over the group's rewards [1, 0]: (r - 0.5) / std (Bessel: 0.7071) = +-0.7071, times 0.5.
    for trajectory, reference, task in zip(mixed, pure, (1 / math.sqrt(2), -1 / math.sqrt(2))):
        assert trajectory.advantage == pytest.approx(task, rel=1e-5)
        assert trajectory.token_advantages == pytest.approx([a + 0.5 * task for a in reference.token_advantages], rel=1e-5)


def test_masked_tokens_are_left_out_of_the_steps_reverse_kl() -> None:
    _, (first, _) = scored_and_advantaged(reward_weight=0.0)
    first.loss_mask = [1, 0, 1]  # e.g. an environment's token in an episode
    assert mean_reverse_kl([first]) == pytest.approx(-(math.log(1.4) + math.log(3.2)) / 2)


def test_the_teacher_and_its_stage_go_together() -> None:
    with pytest.raises(ConfigError, match="flow.stages has teacher_logp but no teacher is configured"):
        make_config(flow={"stages": TEACHER_STAGES})
    with pytest.raises(ConfigError, match="teacher is set but flow.stages has no teacher_logp stage"):
        make_config(teacher={})
    with pytest.raises(ConfigError, match="teacher.model_path and teacher.threads apply to engines.type=torch"):
        make_config(flow={"stages": TEACHER_STAGES}, teacher={"model_path": "somewhere"})


@pytest.mark.parametrize(
    ("sections", "refusal"),
    [
        ({"algorithm": {"dynamic_sampling": True}}, r"teacher with algorithm\.dynamic_sampling"),
        ({"algorithm": {"advantage": "gae"}, "flow": {"stages": [*TEACHER_STAGES[:4], "critic", *TEACHER_STAGES[4:]]}},
         r"teacher with algorithm\.advantage=gae"),
    ],
)
def test_what_a_teacher_cannot_go_with_is_refused_naming_the_field(sections: dict, refusal: str) -> None:
    with pytest.raises(ConfigError, match=refusal):
        make_config(**{"flow": {"stages": TEACHER_STAGES}, "teacher": {}, **sections})


def test_a_run_on_the_fake_engines_trains_with_the_teachers_advantages() -> None:
    cfg = make_config(flow={"stages": TEACHER_STAGES}, teacher={})
    components, trainer = recording(cfg)
    result = run_virtual(AsyncTrainingFlow(cfg, components).run())
    assert result.final_version == cfg.run.max_steps and result.ledger["balanced"]
    trained = [t for batch in trainer.batches for t in batch]
    assert len(trained) == cfg.run.max_steps * cfg.train.prompts_per_step * cfg.rollout.samples_per_prompt
    # The fake teacher puts every token half a nat above the student: advantage +0.5 everywhere.
    for t in trained:
        assert t.teacher_version == 0 and t.token_advantages == pytest.approx([0.5] * t.num_actions)
    assert [s.train_metrics["teacher_reverse_kl"] for s in result.steps] == pytest.approx([-0.5] * cfg.run.max_steps)
    assert result.roles["teacher_logp"].items == len(trained) // cfg.rollout.samples_per_prompt  # every group scored once


class SavedTeacher:
    """A fake teacher that saves itself: log-probs ``offset`` nats above the behaviour's, its
    offset standing for its weights."""

    version = 0

    def __init__(self, offset: float) -> None:
        self.offset = offset

    async def logprobs(self, trajectories: Sequence[Trajectory]) -> list[list[float]]:
        return [[lp + self.offset for lp in t.behaviour_logprobs] for t in trajectories]

    async def save_state(self, folder: Path) -> None:
        (folder / "teacher.json").write_text(json.dumps(self.offset))

    async def load_state(self, folder: Path) -> None:
        self.offset = json.loads((folder / "teacher.json").read_text())


def test_a_resumed_run_scores_with_the_teacher_it_checkpointed(tmp_path: Path) -> None:
    def run(teacher: SavedTeacher, **run: object) -> list[Trajectory]:
        cfg = make_config(
            flow={"stages": TEACHER_STAGES}, teacher={}, staleness={"max_staleness": 1},
            run={"output_dir": str(tmp_path), "name": "d", **run}, observability={"write_run_dir": True, "trace": False},
        )
        components, trainer = recording(cfg)
        components.teacher = teacher
        try:
            run_virtual(AsyncTrainingFlow(cfg, components).run())
        finally:
            components.close()
        return [t for batch in trainer.batches for t in batch]

    run(SavedTeacher(0.5), max_steps=4, save_steps=2)
    saved = tmp_path / "d" / "checkpoints" / "step_00000002"
    state = json.loads((saved / "flow.json").read_text())
    assert state["teacher_saved"] and state["in_flight"]  # step 2's prompts were in flight at the checkpoint
    # Resumed with a teacher built otherwise (its files changed since): the checkpoint's comes back.
    resumed = run(SavedTeacher(3.0), max_steps=4, resume=str(saved))
    assert {t.prompt_id for t in resumed} >= set(state["in_flight"])  # generated and scored again
    for t in resumed:
        assert t.teacher_logprobs == pytest.approx([lp + 0.5 for lp in t.behaviour_logprobs]) and t.teacher_version == 0
