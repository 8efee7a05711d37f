"""The calculator task plugin: its problems, held-out set, environment and reward."""

from __future__ import annotations

import itertools

from tandem.core.environment import EnvironmentTask
from tandem.core.task import Task
from tandem.engines.agentic import EpisodePayload
from tandem.tasks.arithmetic import generate_problems
from tandem.tasks.calculator import HELD_OUT_SEEDS, MODEL_DIR, TRAIN_SEEDS, CalculatorEnvironment
from tandem.tasks.calculator.reward import correct
from tandem.tasks.registry import load_task


def test_it_is_an_episode_task_found_by_name_with_its_model() -> None:
    task = load_task("calculator")
    assert isinstance(task, Task) and isinstance(task, EnvironmentTask)
    assert task.kind == "episode" and task.model_path == MODEL_DIR


def test_items_are_the_problems_their_environment_resets_to() -> None:
    task = load_task("calculator")
    items = list(itertools.islice(task.items(seed=0), 30))
    assert list(itertools.islice(task.items(seed=0, start=10), 20)) == items[10:]
    environment = task.environment()()
    assert isinstance(environment, CalculatorEnvironment)
    for item in items:
        assert item.meta["seed"] in TRAIN_SEEDS
        assert environment.reset(item.meta["seed"]) == item.prompt
        assert generate_problems(1, item.meta["seed"])[0] == {"prompt": item.prompt, "answer": item.answer}
    assert [i.meta["seed"] for i in task.held_out(3)] == list(HELD_OUT_SEEDS[:3])
    assert load_task("calculator", {"max_turns": 2}).environment()().max_turns == 2


def test_the_reward_is_the_environments_verdict() -> None:
    right = EpisodePayload([1], [2], actions=["9+3+0=", "=12"], env_rewards=[0.0, 1.0])
    unanswered = EpisodePayload([1], [2], actions=["9+3+0="], env_rewards=[0.0])
    assert (correct(right, "12"), correct(unanswered, "12")) == (1.0, 0.0)
