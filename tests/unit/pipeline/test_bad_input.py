"""Bad input mid-run becomes a recorded drop or a failed sample, and the run goes on:
prompts longer than the budget, rewards that are NaN, a bool or not a RewardResult at all."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

from tandem.core.protocols import LossObjective, RewardResult
from tandem.core.records import PromptGroup, TaskItem, Trajectory
from tandem.engines.fake import FakeTrainEngine
from tandem.pipeline import AsyncTrainingFlow
from tandem.pipeline.builders import build_components
from tests.conftest import make_config, run_virtual


def every_third_prompt_long(seed: int, start: int = 0) -> Iterator[TaskItem]:
    """Prompt i has 2 tokens, or 5 when i % 3 == 1."""
    for i in range(start, 1 << 30):
        yield TaskItem(f"p{i}", [i % 50] * (5 if i % 3 == 1 else 2), answer=str(i))


class Recording(FakeTrainEngine):
    def __init__(self) -> None:
        super().__init__(lambda: 0.0, lambda: 0.0)  # type: ignore[arg-type]
        self.batches: list[list[Trajectory]] = []

    async def train_step(
        self, batch: Sequence[Trajectory], objective: LossObjective, mini_batches: Sequence[Sequence[int]] | None = None
    ) -> dict[str, float]:
        self.batches.append(list(batch))
        return await super().train_step(batch, objective, mini_batches)


def test_a_prompt_over_the_budget_is_dropped_naming_it_and_its_slot_refilled() -> None:
    cfg = make_config(staleness={"max_staleness": 1})
    components = build_components(cfg)
    components.prompts = every_third_prompt_long
    components.max_prompt_tokens = 3
    trainer = Recording()
    components.trainer = trainer
    result = run_virtual(AsyncTrainingFlow(cfg, components).run())

    long_drops = [d for d in result.drops if d.prompt_id % 3 == 1]
    assert long_drops and len(long_drops) == len(result.drops)
    assert all(d.stage == "generate" and d.reason.startswith("prompt of 5 tokens is over the budget of 3") for d in long_drops)
    trained = [s for batch in trainer.batches for s in batch]
    assert len({s.prompt_id for s in trained}) == cfg.run.max_steps * cfg.train.prompts_per_step  # every step full
    assert all(len(s.payload.prompt_ids) == 2 for s in trained)
    assert result.ledger["balanced"] and result.ledger["in_flight"] == 0


class BadReward:
    """Scores each sample by its place (2 samples per prompt): a float (not a RewardResult),
    NaN, a bool, or a good 1.0."""

    async def score(self, samples: Sequence[Trajectory], groups: Sequence[PromptGroup]) -> list[Any]:
        kinds = [0.5, RewardResult(math.nan), RewardResult(True), RewardResult(1.0)]  # type: ignore[arg-type]
        return [kinds[(2 * s.prompt_id + s.index) % 4] for s in samples]


def test_rewards_of_the_wrong_type_or_nan_fail_their_samples_and_the_run_goes_on() -> None:
    cfg = make_config(run={"max_steps": 2})
    components = build_components(cfg)
    components.reward = BadReward()
    trainer = Recording()
    components.trainer = trainer
    result = run_virtual(AsyncTrainingFlow(cfg, components).run())

    assert len(result.steps) == 2
    infos = {s.reward_info: s.reward for batch in trainer.batches for s in batch}
    assert infos["invalid reward 0.5: not a RewardResult"] == 0.0
    assert infos["invalid reward nan"] == 0.0
    assert infos["invalid reward True"] == 0.0
    assert infos[""] == 1.0
