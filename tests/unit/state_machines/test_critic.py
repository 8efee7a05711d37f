"""The critic role on the fake engines: values reach training stamped with their critic version,
the critic trains one step per policy step at its own pace, and its checkpoint resumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.core.config import ConfigError
from tandem.engines.fake import FakeValueEngine
from tandem.pipeline import AsyncTrainingFlow
from tests.conftest import make_config, run_virtual
from tests.unit.pipeline.test_flow import recording

CRITIC_STAGES = ["dataloader", "generate", "rollout", "logp", "critic", "reward", "train"]


def critic_config(tmp_path: Path | None = None, **sections: dict) -> dict:
    run = {"max_steps": 8, **({"output_dir": str(tmp_path), "name": "critic"} if tmp_path else {})}
    return dict(
        run={**run, **sections.pop("run", {})},
        flow={"stages": CRITIC_STAGES},
        algorithm={"advantage": "gae", "gae_gamma": 1.0, "gae_lambda": 0.9},
        observability={"write_run_dir": tmp_path is not None, "trace": False},
        **sections,
    )


def critic_rows(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in rows if r["kind"] == "critic"]


def test_gae_and_the_critic_stage_go_together() -> None:
    with pytest.raises(ConfigError, match="critic"):
        make_config(algorithm={"advantage": "gae"})
    with pytest.raises(ConfigError, match="critic"):
        make_config(flow={"stages": CRITIC_STAGES})


def test_every_trained_trajectory_carries_values_advantages_and_returns(tmp_path: Path) -> None:
    cfg = make_config(**critic_config(tmp_path))
    components, trainer = recording(cfg)
    result = run_virtual(AsyncTrainingFlow(cfg, components).run())
    for t, batch in enumerate(trainer.batches):
        for sample in batch:
            assert sample.values is not None and len(sample.values) == sample.num_actions
            assert sample.token_advantages is not None and sample.returns is not None
            assert 0 <= sample.value_version <= t  # the critic never runs ahead of the policy's steps
    assert result.steps[0].value_staleness == [0] * result.steps[0].samples  # step 0: the untrained critic, version 0
    # One critic step per trained policy step, in order, each version one more than the last.
    rows = critic_rows(tmp_path / "critic" / "metrics.jsonl")
    assert [r["version"] for r in rows] == list(range(1, len(rows) + 1))
    assert [r["policy_step"] for r in rows] == list(range(len(rows)))
    assert len(rows) == cfg.run.max_steps  # the run ends once the critic has trained on its last step
    assert all("value_loss" in r["metrics"] for r in rows)


def test_the_critics_version_advances_at_its_own_pace() -> None:
    # A critic step four times slower than a policy step: the critic falls behind the policy (the
    # train -> critic channel holds one batch, then the policy waits for it), and the values the
    # policy trains with are staler, which is recorded per trajectory; the run still ends with a
    # critic that trained on every step.
    def run(critic_step_s: float) -> tuple[int, int, int]:
        cfg = make_config(**critic_config(engines={"critic_step_latency": {"type": "constant", "mean_s": critic_step_s}}))
        flow = AsyncTrainingFlow(cfg)
        result = run_virtual(flow.run())
        critic = next(m for m in flow.machines if m.name == "critic")
        return result.final_version, critic.version, sum(s for r in result.steps for s in r.value_staleness)

    policy, slow_critic, slow_staleness = run(2.0)
    _, fast_critic, fast_staleness = run(0.0)
    assert slow_staleness > fast_staleness  # the slow critic fell behind while the run went on
    assert slow_critic == fast_critic == policy  # and the run ended once it had caught up, step for step


def test_the_critic_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    first = make_config(**critic_config(tmp_path, run={"max_steps": 4, "save_steps": 2}))
    run_virtual(AsyncTrainingFlow(first).run())
    saved = sorted((tmp_path / "critic" / "checkpoints").glob("step_*"))[-1]
    state = json.loads((saved / "fake_critic.json").read_text())
    assert state["version"] >= 2  # it trained, and its state went into the checkpoint

    restored: list[int] = []
    original = FakeValueEngine.load_state

    async def spy(self: FakeValueEngine, folder: Path) -> None:
        await original(self, folder)
        restored.append(self.version)

    resumed = make_config(**critic_config(tmp_path, run={"max_steps": 6, "resume": True}))
    FakeValueEngine.load_state = spy  # type: ignore[method-assign]
    try:
        result = run_virtual(AsyncTrainingFlow(resumed).run())
    finally:
        FakeValueEngine.load_state = original  # type: ignore[method-assign]
    assert restored == [state["version"]]
    assert result.resumed_from_version == 4
    after = [r for r in critic_rows(tmp_path / "critic" / "metrics.jsonl") if r["policy_step"] >= 4]
    assert after and after[0]["version"] == state["version"] + 1  # it continued from the saved version
