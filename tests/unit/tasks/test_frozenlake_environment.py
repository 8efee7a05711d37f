"""FrozenLake as a text environment: maps per seed, the grid, the action parser, the expert, the rules."""

from __future__ import annotations

import random

import pytest

import tandem.tasks.frozenlake
from tandem.core.environment import Environment, EnvironmentRunner
from tandem.tasks.frozenlake import (
    ACTIONS,
    HELD_OUT_SEEDS,
    MAX_TURNS,
    TRAIN_SEEDS,
    FrozenLakeEnvironment,
    expert_action,
    generate_map,
    parse_action,
    render,
    shortest_path,
)
from tandem.tasks.frozenlake.maps import move


def test_a_seed_always_gives_the_same_solvable_map() -> None:
    for seed in (0, 1, 123, HELD_OUT_SEEDS[0]):
        lake = generate_map(seed)
        assert lake == generate_map(seed)
        assert len(lake) == 4 and all(len(row) == 4 for row in lake)
        assert lake[0][0] == "S" and lake[3][3] == "G"
        assert set("".join(lake)) <= set("SFHG")
    assert len({generate_map(seed) for seed in range(50)}) > 25  # seeds do vary the map


def test_training_and_held_out_seeds_are_disjoint() -> None:
    assert TRAIN_SEEDS.stop <= HELD_OUT_SEEDS.start


def test_render_draws_the_grid_with_the_agent_then_its_neighbours() -> None:
    lake = ("SFHF", "FFFH", "HFFF", "FFHG")
    # Neighbours in action order: left, down, right, up; "#" beyond the edge.
    assert render(lake, (0, 0)) == "@.H.\n...H\nH...\n..HG\n#..#\n"
    assert render(lake, (1, 2)) == "..H.\n..@H\nH...\n..HG\n..HH\n"
    assert render(lake, (2, 1)) == "..H.\n...H\nH@..\n..HG\nH...\n"
    assert render(lake, (3, 3)) == "..H.\n...H\nH...\n..H@\nH##.\n"


@pytest.mark.parametrize("text", ["L", "D", "R", "U"])
def test_parser_accepts_exactly_one_action_letter(text: str) -> None:
    assert parse_action(text) == text


@pytest.mark.parametrize("text", ["", "l", "LR", "L\n", " L", "left", "<eot>", "@", "LL"])
def test_parser_rejects_anything_else(text: str) -> None:
    assert parse_action(text) is None


def walk(lake: tuple[str, ...], actions: list[str]) -> tuple[int, int]:
    position = (0, 0)
    for action in actions:
        position = move(lake, position, action)  # type: ignore[arg-type]
        assert lake[position[0]][position[1]] != "H", (lake, actions)
    return position


def test_bfs_expert_reaches_the_goal_on_every_map_and_its_path_is_shortest() -> None:
    for seed in range(500):
        lake = generate_map(seed)
        path = shortest_path(lake)
        assert path is not None
        assert walk(lake, path) == (3, 3)
        assert len(path) == 6  # the Manhattan distance: no shorter path exists on a 4×4 lake


def test_bfs_finds_the_detour_when_the_direct_way_is_blocked() -> None:
    lake = ("SFFF", "HHHF", "FFFF", "FHHH", "FFFG")  # 5 rows, 4 columns: the path must snake
    path = shortest_path(lake)
    assert path == list("RRRDDLLLDDRRR")
    assert walk(lake, path) == (4, 3)
    assert shortest_path(("SH", "HG")) is None


def test_following_the_expert_in_the_environment_wins_every_non_slippery_episode() -> None:
    environment = FrozenLakeEnvironment()
    for seed in range(200):
        environment.reset(seed)
        while True:
            result = environment.step(expert_action(environment.lake_map, environment.position))
            if result.terminated or result.truncated:
                break
        assert (result.reward, result.terminated, result.info["outcome"]) == (1.0, True, "goal")
        assert environment.turns == 6


def test_implements_the_environment_protocol() -> None:
    environment = FrozenLakeEnvironment()
    assert isinstance(environment, Environment)
    assert environment.max_turns == MAX_TURNS


def test_reset_renders_the_seeds_map_with_the_agent_on_the_start() -> None:
    environment = FrozenLakeEnvironment()
    observation = environment.reset(7)
    assert observation == render(generate_map(7), (0, 0))
    assert observation.startswith("@")


def test_falling_into_a_hole_terminates_without_reward() -> None:
    environment = FrozenLakeEnvironment()
    seed = next(s for s in range(1000) if generate_map(s)[1][0] == "H")
    environment.reset(seed)
    result = environment.step("D")
    assert (result.reward, result.terminated, result.truncated) == (0.0, True, False)
    assert result.info == {"position": [1, 0], "outcome": "hole"}
    assert result.observation.splitlines()[1][0] == "@"
    neighbours = result.observation.splitlines()[4]
    assert (neighbours[0], neighbours[3]) == ("#", ".")  # in the hole: the edge on its left, the start above


def test_a_malformed_action_costs_a_turn_and_leaves_the_agent_in_place() -> None:
    environment = FrozenLakeEnvironment()
    first = environment.reset(3)
    result = environment.step("RR")
    assert (result.observation, result.reward, result.terminated, result.truncated) == (first, 0.0, False, False)
    assert "expected exactly one of L D R U, got 'RR'" in result.info["error"]
    assert environment.turns == 1


def test_the_turn_limit_truncates_and_ends_the_episode() -> None:
    environment = FrozenLakeEnvironment(max_turns=4)
    environment.reset(3)
    results = [environment.step("U") for _ in range(4)]  # against the wall: never moves
    assert [r.truncated for r in results] == [False, False, False, True]
    assert results[-1].info["outcome"] == "turn_limit" and not results[-1].terminated
    with pytest.raises(RuntimeError, match="reset first"):
        environment.step("D")


def test_moving_into_the_edge_is_a_valid_move_that_stays_put() -> None:
    environment = FrozenLakeEnvironment()
    first = environment.reset(3)
    result = environment.step("L")
    assert result.observation == first and "error" not in result.info


def test_slippery_episodes_replay_exactly_per_seed_and_do_slip() -> None:
    def positions(seed: int) -> list[list[int]]:
        environment = FrozenLakeEnvironment(slippery=True, max_turns=30)
        environment.reset(seed)
        trail = []
        for _ in range(30):
            result = environment.step("R")
            trail.append(result.info["position"])
            if result.terminated or result.truncated:
                break
        return trail

    assert positions(5) == positions(5)
    # Pushing right only, a non-slippery agent never leaves row 0; a slippery one does.
    assert any(row != 0 for seed in range(10) for row, _ in positions(seed))


def test_random_actions_fail_some_episodes() -> None:
    environment = FrozenLakeEnvironment()
    rng = random.Random(0)
    outcomes = []
    for seed in range(100):
        environment.reset(seed)
        while True:
            result = environment.step(rng.choice(ACTIONS))
            if result.terminated or result.truncated:
                outcomes.append(result.info["outcome"])
                break
    assert {"hole", "turn_limit"} <= set(outcomes)
    assert outcomes.count("goal") < 30


async def test_runs_under_the_environment_runner() -> None:
    runner = EnvironmentRunner(timeout_s=5.0)
    try:
        async with runner.open(FrozenLakeEnvironment) as session:
            await session.reset(0)
            lake = generate_map(0)
            for action in shortest_path(lake) or []:
                result = await session.step(action)
    finally:
        runner.shutdown()
    assert result.reward == 1.0 and result.terminated


def test_public_api_is_listed_and_importable() -> None:
    for name in tandem.tasks.frozenlake.__all__:
        assert hasattr(tandem.tasks.frozenlake, name), name
