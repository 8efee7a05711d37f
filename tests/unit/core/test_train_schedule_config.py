"""``train.mini_batches`` and ``train.epochs``: one optimizer step per train step unless asked, never
more mini-batches than groups, and no pi_prox from a forward pass that has left it."""

from __future__ import annotations

import pytest

from tandem.core.config import ConfigError, load_config, validate_config
from tandem.core.paths import CONFIGS_DIR

DEFAULT = CONFIGS_DIR / "default.yaml"


def test_a_train_step_is_one_optimizer_step_unless_asked() -> None:
    train = load_config(DEFAULT).train
    assert (train.mini_batches, train.epochs, train.optimizer_steps) == (1, 1, 1)
    many = load_config(DEFAULT, ["train.mini_batches=4", "train.epochs=2", "algorithm.proximal=loglinear"])
    assert many.train.optimizer_steps == 8


def test_more_mini_batches_than_groups_are_refused_naming_the_fields() -> None:
    with pytest.raises(ConfigError, match=r"train\.mini_batches=9 exceeds train\.prompts_per_step=8"):
        load_config(DEFAULT, ["train.mini_batches=9", "algorithm.proximal=loglinear"])


@pytest.mark.parametrize("schedule", [["train.mini_batches=4"], ["train.epochs=2"]])
def test_pi_prox_from_the_step_s_own_forward_is_refused_past_one_optimizer_step_before_anything_starts(
    schedule: list[str],
) -> None:
    # The default job takes pi_prox from the step's forward (proximal: current): with mini-batches
    # or epochs, every optimizer step after the first would anchor the clip at its own weights.
    refusal = r"algorithm\.proximal=current .* train\.mini_batches=\d and train\.epochs=\d .*recompute.*loglinear"
    with pytest.raises(ConfigError, match=refusal):
        load_config(DEFAULT, schedule)


def test_the_proximal_sources_that_hold_pi_prox_still_are_accepted() -> None:
    many = ["train.mini_batches=4", "train.epochs=2"]
    assert load_config(DEFAULT, [*many, "algorithm.proximal=loglinear"]).algorithm.proximal == "loglinear"
    assert load_config(DEFAULT, [*many, "algorithm.proximal=behaviour"]).algorithm.proximal == "behaviour"
    assert not load_config(DEFAULT, [*many, "algorithm.decoupled=false", "algorithm.proximal=recompute"]).algorithm.decoupled
    recompute = {
        "task": {"name": "arithmetic"},
        "engines": {"type": "torch"},
        "train": {"mini_batches": 4, "epochs": 2},
        "flow": {"stages": ["dataloader", "generate", "rollout", "logp", "reward", "train"]},
    }
    assert validate_config(recompute).algorithm.proximal == "recompute"
