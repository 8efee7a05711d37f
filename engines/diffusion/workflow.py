"""The image workflow: the flow's rollout requests as denoising runs, and the pictures of each evaluation.

What it owns: the sampling plan of each request (Flow-GRPO's choices, config ``diffusion``):
- training: ``train_steps`` steps, SDE on all of them, or (Flow-GRPO-Fast) on a window of
  ``sde_window`` consecutive steps and ODE elsewhere; the window is drawn once per prompt group
  (seeded by the run seed and the group's id, so every sample of a group and every retry
  branches at the same steps), and ``loss_mask`` marks it as the trained steps;
- evaluation (``RolloutRequest.evaluation``): ``eval_steps`` deterministic ODE steps, more than
  training's (denoising reduction); with the validate role's fixed seeds the same held-out
  prompts start from the same noise at every version, so the images show what changed.

``with_reward`` false holds a call's trajectories until all of them are finished, so the
reward role (which scores each micro-batch as it arrives) sees the whole batch at once: the
"off" of MM-GRPO's ``rollout.with_reward``.

Pictures: when a call is a held-out evaluation (all its requests are) and ``pictures`` names a
folder, the workflow writes ``version_V.png`` there, the evaluation's images in prompt order,
``V`` the version every image started with (the minimum, as the validate role reports it).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from tandem.algorithms.flow_grpo import choose_sde_window, sde_step_mask
from tandem.core.protocols import RolloutRequest
from tandem.core.records import Trajectory
from tandem.engines.diffusion.grid import write_grid
from tandem.engines.diffusion.payload import image_payload
from tandem.engines.diffusion.rollout import DenoiseRequest

__all__ = ["DenoisingEngine", "ImageWorkflow"]


class DenoisingEngine(Protocol):
    """What the workflow drives: the in-process rollout engine, or its Ray proxy."""

    @property
    def version(self) -> int: ...

    def generate(self, requests: Sequence[DenoiseRequest]) -> AsyncIterator[Trajectory]: ...


class ImageWorkflow:
    """Implements :class:`core.protocols.RolloutWorkflow` over a denoising engine."""

    def __init__(
        self,
        engine: DenoisingEngine,
        *,
        train_steps: int,
        eval_steps: int,
        sde_window: int | None = None,
        sde_window_latest_start: int | None = None,
        seed: int = 0,
        with_reward: bool = True,
        pictures: Path | None = None,
        picture_columns: int = 10,
    ) -> None:
        if sde_window is not None:
            choose_sde_window(train_steps, sde_window, start=0, latest_start=sde_window_latest_start)  # fits, or raises
        self.engine = engine
        self.train_steps = train_steps
        self.eval_steps = eval_steps
        self.sde_window = sde_window
        self.sde_window_latest_start = sde_window_latest_start
        self.seed = seed
        self.with_reward = with_reward
        self.pictures = pictures
        self.picture_columns = picture_columns

    def plan(self, request: RolloutRequest) -> tuple[bool, ...]:
        """Per denoising step of this request: SDE (trained) or ODE."""
        if request.evaluation:
            return (False,) * self.eval_steps
        if self.sde_window is None:
            return (True,) * self.train_steps
        group_seed = int(np.random.SeedSequence([self.seed, request.group.prompt_id]).generate_state(1)[0])
        window = choose_sde_window(
            self.train_steps, self.sde_window, seed=group_seed, latest_start=self.sde_window_latest_start
        )
        return tuple(sde_step_mask(self.train_steps, window))

    def rollout(self, requests: Sequence[RolloutRequest]) -> AsyncIterator[Trajectory]:
        denoise = [
            DenoiseRequest(r.group.prompt_id, r.index, r.group.prompt, r.seed, self.plan(r)) for r in requests
        ]
        stream = self.engine.generate(denoise)
        evaluation = bool(requests) and all(r.evaluation for r in requests)
        if evaluation and self.pictures is not None:
            return self._pictured(stream)
        if not self.with_reward and not evaluation:
            return self._whole_batch(stream)
        return stream

    async def _whole_batch(self, stream: AsyncIterator[Trajectory]) -> AsyncIterator[Trajectory]:
        finished = [t async for t in stream]
        for trajectory in finished:
            yield trajectory

    async def _pictured(self, stream: AsyncIterator[Trajectory]) -> AsyncIterator[Trajectory]:
        finished: list[Trajectory] = []
        async for trajectory in stream:
            finished.append(trajectory)
            yield trajectory
        assert self.pictures is not None
        finished.sort(key=lambda t: (t.prompt_id, t.index))
        version = min(t.start_version for t in finished)
        images = [image_payload(t).image for t in finished]
        await asyncio.to_thread(write_grid, images, self.picture_columns, self.pictures / f"version_{version:06d}.png")
