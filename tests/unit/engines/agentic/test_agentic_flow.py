"""The episode workload in the flow (tiny model, real engines): an environment that raises, hangs or
answers malformed output fails only its own group, dropped with the reason in the ledger."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from agentic_for_tests import HANG_S

from tandem.core.config import ConfigError, validate_config
from tandem.core.task import RewardFunction
from tandem.pipeline import AsyncTrainingFlow
from tandem.pipeline.builders import build_components

TIMEOUT_S = 0.3  # the environment timeout; a hanging step sleeps HANG_S, far past it
assert HANG_S > 3 * TIMEOUT_S


def config(model_dir: Path, **agentic: object) -> dict[str, object]:
    return {
        "run": {"max_steps": 3, "seed": 0},
        "train": {"prompts_per_step": 4},
        "rollout": {"samples_per_prompt": 2, "max_new_tokens": 3},
        "flow": {"stages": ["dataloader", "generate", "rollout", "logp", "reward", "train"], "micro_batch_size": 2},
        "task": {"name": "agentic_for_tests:ScriptedTask", "options": {"broken": True}},
        "engines": {"type": "torch", "model_path": str(model_dir), "lr": 1e-4, "generation_threads": 1, "train_threads": 1},
        "agentic": {"env_timeout_s": TIMEOUT_S, **agentic},
        "observability": {"write_run_dir": False, "trace": False},
    }


def test_a_misbehaving_environment_fails_only_its_group_with_the_reason_in_the_ledger(model_dir: Path) -> None:
    cfg = validate_config(config(model_dir))
    components = build_components(cfg)
    try:
        result = asyncio.run(AsyncTrainingFlow(cfg, components).run())
    finally:
        components.close()
    # Item i resets with seed i; seeds ending in 1, 2, 3 break at their second step.
    assert result.total_steps == 3 and result.ledger["balanced"] and result.ledger["trained"] == 12
    reasons = {d.prompt_id: (d.stage, d.reason) for d in result.drops}
    trained = {p for step in result.steps for p in step.prompt_ids}
    assert not trained & set(reasons) and all(p % 10 not in (1, 2, 3) for p in trained)
    broken = {p: (p % 10) for p in reasons}
    for prompt_id, (stage, reason) in reasons.items():
        assert stage == "generate"
        expected = {
            1: f"environment step raised: RuntimeError: the lake cracked under seed {prompt_id}",
            2: f"environment step timeout: no answer within {TIMEOUT_S} s",
            3: "environment step malformed: returned str, not StepResult",
        }[broken[prompt_id]]
        assert reason in (expected, f"another episode of its group failed: {expected}"), reason
    assert {1, 2, 3, 11, 12, 13} <= set(reasons)  # every kind of failure, each on its own group
    step = result.steps[-1]
    assert step.rollout_metrics["turns"] == 3.0 and step.rollout_metrics["success"] >= 0.0


def test_a_task_without_an_environment_needs_a_workflow_of_its_own(model_dir: Path) -> None:
    episodic_but_no_environment = {**config(model_dir), "task": {"name": "test_agentic_flow:NoEnvironment"}}
    with pytest.raises(ConfigError, match="agentic.workflow=environment: task 'bare' has no environment"):
        build_components(validate_config(episodic_but_no_environment))


def test_a_context_budget_smaller_than_a_turn_fails_naming_the_field(model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="agentic.max_context_tokens=3 leaves no room"):
        build_components(validate_config(config(model_dir, max_context_tokens=3)))


class NoEnvironment:
    name = "bare"
    kind = "episode"
    model_path = None

    def items(self, seed: int, start: int = 0):  # type: ignore[no-untyped-def]
        raise AssertionError("never read")

    def held_out(self, n: int) -> list:  # type: ignore[type-arg]
        return []

    def rewards(self) -> list[RewardFunction]:
        return [RewardFunction("return", "agentic_for_tests:env_return", runner="inline")]
