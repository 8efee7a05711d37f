"""The FrozenLake task plugin: its items and held-out maps, options, environment and rewards."""

from __future__ import annotations

import itertools
import pickle

import pytest

from tandem.core.environment import EnvironmentTask
from tandem.core.task import Task
from tandem.engines.agentic import EpisodePayload
from tandem.tasks.frozenlake import HELD_OUT_SEEDS, MAX_TURNS, MODEL_DIR, generate_map, render
from tandem.tasks.frozenlake.reward import malformed_actions, reached_goal
from tandem.tasks.frozenlake.task import HELD_OUT_MAPS
from tandem.tasks.registry import load_task


def test_it_is_an_episode_task_found_by_name_with_the_shipped_model() -> None:
    task = load_task("frozenlake")
    assert isinstance(task, Task) and isinstance(task, EnvironmentTask)
    assert task.kind == "episode" and task.model_path == MODEL_DIR


def test_items_are_deterministic_maps_resumable_at_any_position() -> None:
    task = load_task("frozenlake")
    first = list(itertools.islice(task.items(seed=0), 40))
    assert first == list(itertools.islice(task.items(seed=0), 40))
    assert list(itertools.islice(task.items(seed=0, start=25), 15)) == first[25:]
    assert first != list(itertools.islice(task.items(seed=1), 40))
    for item in first:  # each item names the map it plays and shows it as the first observation
        assert item.prompt == render(generate_map(item.meta["seed"]), (0, 0))
    assert len({item.meta["seed"] for item in first}) == 40


def test_training_never_plays_a_held_out_layout() -> None:
    task = load_task("frozenlake")
    held_out = {generate_map(seed) for seed in HELD_OUT_SEEDS[:HELD_OUT_MAPS]}
    trained = [generate_map(item.meta["seed"]) for item in itertools.islice(task.items(seed=3), 2000)]
    assert not held_out & set(trained)
    assert [i.meta["seed"] for i in task.held_out(5)] == list(HELD_OUT_SEEDS[:5])
    with pytest.raises(ValueError, match=f"has {HELD_OUT_MAPS} maps"):
        task.held_out(HELD_OUT_MAPS + 1)


def test_options_reach_the_environment_which_pickles_for_a_child_process() -> None:
    default = load_task("frozenlake").environment()()
    assert (default.slippery, default.max_turns) == (False, MAX_TURNS)
    factory = load_task("frozenlake", {"slippery": True, "size": 5}).environment()
    environment = pickle.loads(pickle.dumps(factory))()
    assert environment.slippery and environment.max_turns == 2 * 4 + 4
    assert environment.reset(7).count("\n") == 6  # five rows and the neighbour line
    assert load_task("frozenlake", {"max_turns": 3}).environment()().max_turns == 3
    with pytest.raises(ValueError, match="size must be at least 2"):
        load_task("frozenlake", {"size": 1})


def test_the_rewards_read_the_episode() -> None:
    won = EpisodePayload([1], [5, 2], actions=["R", "x", "D", "DD"], env_rewards=[0.0, 0.0, 0.0, 1.0])
    lost = EpisodePayload([1], [5, 2], actions=["D"], env_rewards=[0.0])
    assert (reached_goal(won, None), reached_goal(lost, None)) == (1.0, 0.0)
    assert (malformed_actions(won, None), malformed_actions(lost, None)) == (-2.0, 0.0)
    weights = {r.name: r.weight for r in load_task("frozenlake").rewards()}
    assert weights == {"goal": 1.0, "format": 0.1}
