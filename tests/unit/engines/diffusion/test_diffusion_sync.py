"""Weight sync into the image rollout engine lands between denoising steps, and every step says which weights made it."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace

import numpy as np
import pytest

from tandem.algorithms import PolicyObjective
from tandem.core.config import AlgorithmConfig
from tandem.core.records import Trajectory
from tandem.engines.diffusion.rollout import DenoiseRequest, DiffusionRolloutEngine
from tandem.engines.diffusion.train import DiffusionTrainEngine
from tandem.engines.shared.weight_sync import TorchWeightSync, TrainerSyncSource
from tandem.param_sync import InProcessTransport, ParamSyncer, Receiver
from tandem.tasks.digits import MODEL_DIR, format_prompt

STEPS = 40


def generate(engine: DiffusionRolloutEngine, requests: list[DenoiseRequest]) -> list[Trajectory]:
    async def run() -> list[Trajectory]:
        return [t async for t in engine.generate(requests)]

    return asyncio.run(run())


@pytest.mark.parametrize("load_mode", ["swap", "pause"])
def test_a_sync_mid_image_changes_the_weights_between_two_steps_and_each_step_carries_its_version(load_mode: str) -> None:
    rollout = DiffusionRolloutEngine(MODEL_DIR, noise_level=0.7, guidance_scale=1.5, load_mode=load_mode)  # type: ignore[arg-type]
    trainer = DiffusionTrainEngine(MODEL_DIR, lr=1e-3)
    initial = DiffusionTrainEngine(MODEL_DIR, lr=1e-3)  # version 0's weights, to score the early steps
    source = TrainerSyncSource(trainer)  # type: ignore[arg-type]
    sync = TorchWeightSync(source, ParamSyncer(source, InProcessTransport([Receiver(rollout.target, consume_bucket_mb=0.5)]),
                                               produce_bucket_mb=0.5))
    try:
        # Version 1: one step on a few images, so the weights differ visibly from version 0's.
        warmup = generate(rollout, [DenoiseRequest(0, i, format_prompt(i), i, (True,) * 4) for i in range(4)])
        asyncio.run(trainer.train_step([replace(t, advantage=float(t.index) - 1.5) for t in warmup],
                                       PolicyObjective(AlgorithmConfig(decoupled=False))))
        assert trainer.version == 1 and rollout.version == 0

        # Slow the denoising down once it has begun, and sync while the image is half made.
        started, calls = threading.Event(), [0]

        def pace(*_: object) -> None:
            calls[0] += 1
            if calls[0] == 5:
                started.set()
            if calls[0] >= 5:
                time.sleep(0.01)

        hook = rollout.generator.transformer.register_forward_hook(pace)

        async def run() -> tuple[list[Trajectory], int]:
            stream = rollout.generate([DenoiseRequest(1, 0, format_prompt(7), 77, (True,) * STEPS)])
            collected = asyncio.ensure_future(_collect(stream))
            await asyncio.to_thread(started.wait, 30)
            report = await sync.sync(1)
            return await collected, report.version

        (trajectory,), synced = asyncio.run(run())
        hook.remove()
        assert synced == 1 and rollout.version == 1
        versions = trajectory.versions
        switch = versions.index(1)
        assert versions == [0] * switch + [1] * (STEPS - switch) and 5 <= switch < STEPS
        assert trajectory.metrics == {"version_span": 1.0}
        # Every step's behaviour log-prob is the one its stamped weights give, not the other version's.
        at = {0: asyncio.run(initial.logprobs([trajectory]))[0], 1: asyncio.run(trainer.logprobs([trajectory]))[0]}
        for step, version in enumerate(versions):
            assert abs(trajectory.behaviour_logprobs[step] - at[version][step]) < 1e-4, (step, version)
        gaps = np.abs(np.array(at[0]) - np.array(at[1]))
        assert gaps.max() > 1e-3  # the two versions are distinguishable, so the check above means something
    finally:
        sync.close()
        rollout.close()
        trainer.close()
        initial.close()


async def _collect(stream: object) -> list[Trajectory]:
    return [t async for t in stream]  # type: ignore[attr-defined]
