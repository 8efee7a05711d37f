"""AsyncTrainingFlow end to end on the fake engines: the schedule, custom stages, failures."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tandem.algorithms import plan_mini_batches
from tandem.core.components import Components
from tandem.core.config import TandemConfig
from tandem.core.protocols import LossObjective
from tandem.core.records import Trajectory, TrajectoryGroup
from tandem.engines.fake import FakeTrainEngine
from tandem.pipeline import AsyncTrainingFlow
from tandem.pipeline.builders import build_components
from tandem.state_machines.base import StageError
from tandem.state_machines.train import TrainStateMachine
from tests.conftest import make_config, run_virtual


class RecordingTrainer(FakeTrainEngine):
    """The fake trainer (with its injected faults), remembering every batch it trained."""

    def __init__(self, inner: FakeTrainEngine) -> None:
        super().__init__(inner._step_latency, inner._logp_latency, inner._train_faults, inner._logp_faults)
        self.batches: list[list[Trajectory]] = []
        self.plans: list[Sequence[Sequence[int]] | None] = []

    async def train_step(
        self, batch: Sequence[Trajectory], objective: LossObjective, mini_batches: Sequence[Sequence[int]] | None = None
    ) -> dict[str, float]:
        metrics = await super().train_step(batch, objective, mini_batches)  # a failed step trained nothing
        self.batches.append(list(batch))
        self.plans.append(mini_batches)
        return metrics


class RecordingTrain(TrainStateMachine):
    """The train role, remembering the group of every trajectory it hands the engine, so tests
    can check group-level facts (step, admitted bound) of what the engine trained."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group_of: dict[int, TrajectoryGroup] = {}

    def advantages(self, batch: list[TrajectoryGroup]) -> list[Trajectory]:
        self.group_of.update((g.prompt_id, g) for g in batch)
        return super().advantages(batch)

    def groups(self, trained: list[Trajectory]) -> list[TrajectoryGroup]:
        """The groups of a trained batch, in the batch's order."""
        return list({t.prompt_id: self.group_of[t.prompt_id] for t in trained}.values())


def recording(config: TandemConfig) -> tuple[Components, RecordingTrainer]:
    components = build_components(config)
    trainer = RecordingTrainer(components.trainer)  # type: ignore[arg-type]
    components.trainer = trainer
    return components, trainer


def intervals(trace: dict, track: str, state: str) -> list[tuple[float, float]]:
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    return [
        (e["ts"], e["ts"] + e["dur"])
        for e in trace["traceEvents"]
        if e["ph"] == "X" and names[e["tid"]] == track and e["name"] == state and e["dur"] > 0
    ]


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(x1, y1) - max(x0, y0)) for x0, x1 in a for y0, y1 in b)


def test_k0_is_exactly_the_synchronous_schedule(tmp_path: Path) -> None:
    cfg = make_config(
        staleness={"max_staleness": 0},
        run={"output_dir": str(tmp_path), "name": "k0"},
        observability={"write_run_dir": True, "trace": True},
    )
    components, trainer = recording(cfg)
    result = run_virtual(AsyncTrainingFlow(cfg, components).run())

    per_step = cfg.train.prompts_per_step
    # Step t trains exactly the t-th block of prompts, every token sampled with version t ...
    for t, batch in enumerate(trainer.batches):
        assert sorted({s.prompt_id for s in batch}) == list(range(t * per_step, (t + 1) * per_step))
        assert {v for s in batch for v in s.versions} == {t}
    # ... and generation never runs while training does.
    trace = json.loads((tmp_path / "k0" / "trace.json").read_text())
    assert overlap(intervals(trace, "generate", "running"), intervals(trace, "train", "running")) == 0
    assert result.staleness_counts == {0: cfg.run.max_steps * per_step}


def test_k1_overlaps_generation_with_training_within_the_bound(tmp_path: Path) -> None:
    cfg = make_config(
        staleness={"max_staleness": 1},
        run={"output_dir": str(tmp_path), "name": "k1"},
        observability={"write_run_dir": True, "trace": True},
    )
    components, trainer = recording(cfg)
    result = run_virtual(AsyncTrainingFlow(cfg, components).run())
    trace = json.loads((tmp_path / "k1" / "trace.json").read_text())
    assert overlap(intervals(trace, "generate", "running"), intervals(trace, "train", "running")) > 0
    assert set(result.staleness_counts) <= {0, 1} and result.staleness_counts.get(1, 0) > 0
    for t, batch in enumerate(trainer.batches):
        assert all(s.start_version >= t - 1 for s in batch)


def test_k1_is_faster_than_sync_on_the_same_work() -> None:
    sync = run_virtual(AsyncTrainingFlow(make_config(staleness={"max_staleness": 0})).run())
    async_ = run_virtual(AsyncTrainingFlow(make_config(staleness={"max_staleness": 1})).run())
    assert async_.wall_s < sync.wall_s


def test_mini_batches_and_epochs_are_optimizer_steps_inside_one_version(tmp_path: Path) -> None:
    # Each step's trainer gets the seeded plan of its step: two mini-batches of whole groups, for
    # two epochs. The version (and so k, admission, the ledger, the syncs) still counts train
    # steps; the optimizer-step counter counts four per version, and resumes with a checkpoint.
    sections: dict[str, Any] = {
        "staleness": {"max_staleness": 1}, "train": {"prompts_per_step": 4, "mini_batches": 2, "epochs": 2},
        "run": {"max_steps": 6, "seed": 0, "output_dir": str(tmp_path), "save_steps": 1},
        "observability": {"write_run_dir": True},
    }  # fmt: skip
    cfg = make_config(**sections)
    components, trainer = recording(cfg)
    result = run_virtual(AsyncTrainingFlow(cfg, components).run())
    assert result.final_version == cfg.run.max_steps and set(result.staleness_counts) <= {0, 1}
    assert [s.version for s in result.syncs] == list(range(1, len(result.syncs) + 1))
    for t, (batch, plan) in enumerate(zip(trainer.batches, trainer.plans, strict=True)):
        groups = [s.prompt_id for s in batch]
        assert plan == plan_mini_batches(groups, 2, 2, seed=cfg.run.seed, step=t)
    totals = [(s.train_metrics["optimizer_steps"], s.train_metrics["optimizer_steps_total"]) for s in result.steps]
    steps = cfg.run.max_steps
    assert totals == [(4.0, 4.0 * (t + 1)) for t in range(steps)]

    more = make_config(**{**sections, "run": {**sections["run"], "max_steps": steps + 2, "resume": True}})
    components, trainer = recording(more)
    resumed = run_virtual(AsyncTrainingFlow(more, components).run())
    assert [s.train_metrics["optimizer_steps_total"] for s in resumed.steps[-2:]] == [4.0 * (steps + 1), 4.0 * (steps + 2)]
    for t, (batch, plan) in enumerate(zip(trainer.batches, trainer.plans, strict=True), start=steps):
        assert plan == plan_mini_batches([s.prompt_id for s in batch], 2, 2, seed=cfg.run.seed, step=t)


def test_result_reports_steps_ledger_and_roles(config: TandemConfig) -> None:
    result = run_virtual(AsyncTrainingFlow(config).run())
    assert [s.step for s in result.steps] == list(range(config.run.max_steps))
    assert result.final_version == config.run.max_steps
    assert result.ledger["trained"] == config.run.max_steps * config.train.prompts_per_step
    assert result.ledger["balanced"] and result.ledger["in_flight"] == 0
    assert set(result.roles) == {"dataloader", "generate", "rollout", "logp", "ref_logp", "reward", "train", "param_update"}
    assert result.roles["train"].state_seconds["running"] > 0
    assert all(ch.max_depth <= ch.capacity for ch in result.channels.values())
    assert [s.version for s in result.syncs] == list(range(1, len(result.syncs) + 1))


def test_a_filter_stage_between_reward_and_train_drops_with_reasons_and_refills() -> None:
    cfg = make_config(
        flow={
            "stages": ["dataloader", "generate", "rollout", "logp", "ref_logp", "reward", "filter", "train"],
            "custom_stages": {"filter": "tests.unit.pipeline.stages_for_tests:DropOddPrompts"},
        }
    )
    components, trainer = recording(cfg)
    result = run_virtual(AsyncTrainingFlow(cfg, components).run())
    trained = [s.prompt_id for batch in trainer.batches for s in batch if s.index == 0]
    dropped = [d.prompt_id for d in result.drops]
    assert all(p % 2 == 0 for p in trained) and all(p % 2 == 1 for p in dropped)
    assert len(trained) == len(set(trained)) == cfg.run.max_steps * cfg.train.prompts_per_step
    assert not set(trained) & set(dropped)
    assert {d.stage for d in result.drops} == {"filter"}
    assert {d.reason for d in result.drops} == {"filtered: odd prompt id"}
    assert result.ledger["balanced"] and result.ledger["admitted"] == len(trained) + len(dropped)


def test_a_replaced_reward_stage_is_used() -> None:
    cfg = make_config(flow={"custom_stages": {"reward": "tests.unit.pipeline.stages_for_tests:ConstantReward"}})
    result = run_virtual(AsyncTrainingFlow(cfg).run())
    assert {s.reward_mean for s in result.steps} == {0.25}


def test_a_failing_stage_stops_the_flow_within_a_second_naming_stage_and_prompt() -> None:
    # Without logp: it takes turns with train, so a 60 s step could hold prompt 5 back from the
    # failing stage and the test would measure the lock, not the stop.
    cfg = make_config(
        flow={
            "custom_stages": {"reward": "tests.unit.pipeline.stages_for_tests:FailOnPrompt"},
            "micro_batch_size": 1,
            "stages": ["dataloader", "generate", "rollout", "reward", "train"],
        },
        algorithm={"decoupled": False},
        engines={
            "generation_latency": {"type": "constant", "mean_s": 0.01},
            "train_step_latency": {"type": "constant", "mean_s": 60.0},  # a step in progress must not delay the stop
            "logp_latency": {"mean_s": 0.0}, "reward_latency": {"mean_s": 0.0}, "sync_latency": {"mean_s": 0.0},
        },
    )

    async def scenario() -> float:
        flow = AsyncTrainingFlow(cfg)
        started = time.monotonic()
        with pytest.raises(StageError) as info:
            await flow.run()
        assert info.value.stage == "reward" and info.value.prompt_ids == [5]
        assert "verifier exploded" in str(info.value)
        leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
        assert not leftover
        return time.monotonic() - started

    assert asyncio.run(scenario()) < 1.0


def test_cancelling_the_flow_leaves_no_task_behind(config: TandemConfig) -> None:
    async def scenario() -> None:
        task = asyncio.ensure_future(AsyncTrainingFlow(config).run())
        await asyncio.sleep(2.5)  # virtual: mid-run
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run_virtual(scenario())  # run_virtual asserts that no task is left pending


def test_metrics_are_served_on_localhost_while_running() -> None:
    cfg = make_config(
        observability={"metrics_port": 0},
        engines={"train_step_latency": {"type": "constant", "mean_s": 0.05}, "generation_latency": {"mean_s": 0.02}},
    )

    async def scenario() -> str:
        flow = AsyncTrainingFlow(cfg)
        task = asyncio.ensure_future(flow.run())
        while flow.metrics_port is None:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        url = f"http://127.0.0.1:{flow.metrics_port}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
        await task
        return body

    body = asyncio.run(scenario())
    for series in (
        'tandem_policy_version{role="generate"}',
        'tandem_policy_version{role="train"}',
        "tandem_param_update_lag",
        'tandem_channel_depth{channel="generate->rollout"}',
        'tandem_role_state_seconds_total{role="train",state="running"}',
        "tandem_trained_staleness_bucket",
        "tandem_samples_per_second",
        "tandem_tokens_per_second",
    ):
        assert series in body, series


def test_run_folder_has_metrics_trace_and_summary(tmp_path: Path) -> None:
    cfg = make_config(run={"output_dir": str(tmp_path), "name": "r"}, observability={"write_run_dir": True, "trace": True})
    result = run_virtual(AsyncTrainingFlow(cfg).run())
    run_dir = tmp_path / "r"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(cfg.run.max_steps))
    trace = json.loads((run_dir / "trace.json").read_text())
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert {"dataloader", "generate", "train", "param_update"} <= tracks
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == len(result.steps)


@pytest.mark.parametrize("k", [0, 1, 2, 4])
def test_proximal_log_probs_are_the_trainers_at_the_step_that_trains_them_and_scored_once(k: int) -> None:
    # The logp role scores a group ahead of its step only once the trainer has reached that
    # step; with k >= 1 groups arrive earlier than that and the train step scores them. Either
    # way each trajectory is scored once, at the version that trains it.
    cfg = make_config(staleness={"max_staleness": k}, run={"max_steps": 8})
    components, trainer = recording(cfg)
    result = run_virtual(AsyncTrainingFlow(cfg, components).run())
    for t, batch in enumerate(trainer.batches):
        assert {s.prox_version for s in batch} == {t}, f"step {t}"
    assert not any(s.train_metrics["prox_rescored_fraction"] for s in result.steps)  # no forward pass wasted
    scored_in_step = [s.train_metrics["prox_scored_in_step_fraction"] for s in result.steps]
    if k == 0:
        assert not any(scored_in_step)  # synchronous: every group is scored ahead of its step
    else:
        assert any(scored_in_step)  # groups arrived before their step: the train step scored them
