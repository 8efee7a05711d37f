"""The image workflow: Flow-GRPO's sampling plan per request, with_reward's whole-batch hold, pictures per evaluation."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from tandem.core.protocols import RolloutRequest
from tandem.core.records import FinishReason, PromptGroup, TaskItem, Trajectory
from tandem.engines.diffusion.grid import image_grid
from tandem.engines.diffusion.payload import ImagePayload
from tandem.engines.diffusion.rollout import DenoiseRequest
from tandem.engines.diffusion.workflow import ImageWorkflow


class ScriptedEngine:
    """Finishes its requests one every 10 ms, in order, each an image whose pixels are all ``prompt_id / 10``."""

    version = 3

    def __init__(self) -> None:
        self.requests: list[DenoiseRequest] = []
        self.finished_at: dict[tuple[int, int], float] = {}

    async def _stream(self, requests: Sequence[DenoiseRequest]) -> AsyncIterator[Trajectory]:
        loop = asyncio.get_running_loop()
        for request in requests:
            await asyncio.sleep(0.01)
            self.finished_at[(request.prompt_id, request.index)] = loop.time()
            steps = len(request.sde)
            image = np.full((1, 2, 2), request.prompt_id / 10, dtype=np.float32)
            payload = ImagePayload(request.prompt, np.zeros((steps + 1, 1, 2, 2), np.float32), [1.0] * steps + [0.0],
                                   list(request.sde), 0.7, 1.5, image)
            yield Trajectory(request.prompt_id, request.index, [0.0] * steps, [self.version] * steps, self.version,
                             FinishReason.LENGTH, payload, loss_mask=[int(s) for s in request.sde])

    def generate(self, requests: Sequence[DenoiseRequest]) -> AsyncIterator[Trajectory]:
        self.requests.extend(requests)
        return self._stream(requests)


def requests(groups: int, n: int, evaluation: bool = False) -> list[RolloutRequest]:
    return [
        RolloutRequest(PromptGroup(g, TaskItem(prompt=f"draw the digit {g % 10}"), n), i, 1000 * g + i, evaluation)
        for g in range(groups)
        for i in range(n)
    ]


def drain(workflow: ImageWorkflow, batch: list[RolloutRequest]) -> list[tuple[Trajectory, float]]:
    async def run() -> list[tuple[Trajectory, float]]:
        loop = asyncio.get_running_loop()
        return [(t, loop.time()) async for t in workflow.rollout(batch)]

    return asyncio.run(run())


def test_training_samples_every_step_stochastically_and_evaluation_deterministically_with_more_steps() -> None:
    engine = ScriptedEngine()
    workflow = ImageWorkflow(engine, train_steps=4, eval_steps=9)
    drain(workflow, requests(1, 2) + requests(1, 1, evaluation=True))
    train, _, evaluation = engine.requests
    assert train.sde == (True,) * 4 and train.prompt == "draw the digit 0" and train.seed == 0
    assert evaluation.sde == (False,) * 9


def test_flow_grpo_fast_trains_one_window_per_group_inside_the_allowed_starts() -> None:
    engine = ScriptedEngine()
    workflow = ImageWorkflow(engine, train_steps=10, eval_steps=10, sde_window=3, sde_window_latest_start=4, seed=5)
    done = drain(workflow, requests(40, 2))
    plans: dict[int, set[tuple[bool, ...]]] = {}
    for request in engine.requests:
        plans.setdefault(request.prompt_id, set()).add(request.sde)
    assert all(len(p) == 1 for p in plans.values())  # both samples of a group branch at the same steps
    starts = {plan.index(True) for (plan,) in plans.values()}
    assert starts == set(range(5))  # every allowed start occurs over 40 groups, none later
    assert all(sum(plan) == 3 and plan[plan.index(True) : plan.index(True) + 3] == (True,) * 3 for (plan,) in plans.values())
    for trajectory, _ in done:  # the window is what the loss trains
        assert trajectory.loss_mask == [int(s) for s in next(iter(plans[trajectory.prompt_id]))]
    again = ScriptedEngine()
    drain(ImageWorkflow(again, train_steps=10, eval_steps=10, sde_window=3, sde_window_latest_start=4, seed=5), requests(40, 2))
    assert [r.sde for r in again.requests] == [r.sde for r in engine.requests]  # seeded: a retry samples the same plan


def test_a_window_that_cannot_fit_is_refused() -> None:
    with pytest.raises(ValueError):
        ImageWorkflow(ScriptedEngine(), train_steps=4, eval_steps=4, sde_window=5)
    with pytest.raises(ValueError):
        ImageWorkflow(ScriptedEngine(), train_steps=4, eval_steps=4, sde_window=2, sde_window_latest_start=3)


@pytest.mark.parametrize("with_reward", [True, False])
def test_with_reward_off_delivers_a_call_only_once_all_its_images_are_done(with_reward: bool) -> None:
    engine = ScriptedEngine()
    done = drain(ImageWorkflow(engine, train_steps=2, eval_steps=2, with_reward=with_reward), requests(3, 2))
    last_finished = max(engine.finished_at.values())
    delivered = [at for _, at in done]
    assert len(done) == 6
    if with_reward:  # each image as it finishes: the first long before the last is made
        assert delivered[0] < last_finished - 0.03
    else:  # none before the last is finished
        assert min(delivered) >= last_finished


def test_an_evaluation_leaves_a_grid_of_its_images_named_by_version(tmp_path: Path) -> None:
    engine = ScriptedEngine()
    workflow = ImageWorkflow(engine, train_steps=2, eval_steps=3, pictures=tmp_path, picture_columns=5)
    evaluation = requests(10, 1, evaluation=True)
    drain(workflow, list(reversed(evaluation)))  # the grid is in prompt order whatever the finishing order
    drain(workflow, requests(2, 2))  # training calls draw nothing
    from PIL import Image

    (path,) = tmp_path.iterdir()
    assert path.name == "version_000003.png"
    grid = np.asarray(Image.open(path))
    np.testing.assert_array_equal(grid, image_grid([np.full((1, 2, 2), g / 10, np.float32) for g in range(10)], 5))


def test_grid_tiles_images_row_major_scaled_up_with_gaps() -> None:
    images = [np.full((1, 8, 8), v, np.float32) for v in (-1.0, 0.0, 1.0, 5.0)]
    grid = image_grid(images, columns=3)
    assert grid.shape == (2 * 64 + 2, 3 * 64 + 2 * 2)  # 8x8 tiles scaled 8x, 2-pixel gaps
    assert grid[0, 0] == 0 and grid[0, 66] == 128 and grid[0, 132] == 255 and grid[66, 0] == 255  # 5.0 clipped to 1
    assert grid[0, 64] == 255 and grid[64, 0] == 255  # the gaps are white
    rgb = image_grid([np.zeros((3, 4, 4), np.float32)], columns=1)
    assert rgb.shape == (64, 64, 3)
    with pytest.raises(ValueError):
        image_grid([np.zeros((2, 4, 4), np.float32)], columns=1)
