"""The image rollout engine: Flow-GRPO's sampler on the shipped digit generator, continuously batched."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from tandem.algorithms.flow_grpo import sde_transition, transition_log_prob
from tandem.core.records import FinishReason, Trajectory
from tandem.engines.diffusion.model import guided_velocity
from tandem.engines.diffusion.payload import ImagePayload, image_payload
from tandem.engines.diffusion.rollout import DenoiseRequest, DiffusionRolloutEngine, EngineClosedError
from tandem.tasks.digits import MODEL_DIR, format_prompt
from tandem.tasks.digits.models import load_generator as load_digit_generator
from tandem.tasks.digits.sampling import sample_images

GUIDANCE = 1.5
NOISE = 0.7


@pytest.fixture(scope="module")
def engine() -> DiffusionRolloutEngine:
    engine = DiffusionRolloutEngine(MODEL_DIR, noise_level=NOISE, guidance_scale=GUIDANCE, max_batch_size=8)
    yield engine
    engine.close()


def request(digit: int, seed: int, sde: tuple[bool, ...], prompt_id: int = 0, index: int = 0) -> DenoiseRequest:
    return DenoiseRequest(prompt_id, index, format_prompt(digit), seed, sde)


def generate(engine: DiffusionRolloutEngine, requests: list[DenoiseRequest]) -> list[Trajectory]:
    async def run() -> list[Trajectory]:
        return [t async for t in engine.generate(requests)]

    done = asyncio.run(run())
    return sorted(done, key=lambda t: (t.prompt_id, t.index))


def test_ode_sampling_is_the_tasks_reference_sampler(engine: DiffusionRolloutEngine) -> None:
    # The task's sampler (scheduler.step with guidance) and the engine's agree image for image.
    digits, seeds = [3, 7, 0], [11, 12, 13]
    trajectories = generate(engine, [request(d, s, (False,) * 6, prompt_id=i) for i, (d, s) in enumerate(zip(digits, seeds))])
    reference = sample_images(load_digit_generator(), digits, seeds, num_steps=6, guidance_scale=GUIDANCE)
    ours = np.stack([image_payload(t).image for t in trajectories])
    np.testing.assert_allclose(ours, reference.numpy(), atol=1e-5)


def test_a_trajectory_records_every_step_as_an_action(engine: DiffusionRolloutEngine) -> None:
    plan = (False, True, True, False, True)
    (trajectory,) = generate(engine, [request(4, 99, plan)])
    payload = image_payload(trajectory)
    assert isinstance(payload, ImagePayload)
    assert trajectory.num_actions == 5 and trajectory.versions == [0] * 5 and trajectory.start_version == 0
    assert trajectory.loss_mask == [0, 1, 1, 0, 1] and payload.sde == list(plan)
    assert trajectory.finish_reason is FinishReason.LENGTH
    assert payload.latents.shape == (6, 1, 8, 8) and len(payload.sigmas) == 6 and payload.sigmas[-1] == 0.0
    # The chain starts from the request seed's noise and ends in the image (no VAE here).
    np.testing.assert_array_equal(payload.latents[0], torch.randn(1, 8, 8, generator=torch.Generator().manual_seed(99)).numpy())
    np.testing.assert_array_equal(payload.latents[-1], payload.image)
    assert [lp for lp, sde in zip(trajectory.behaviour_logprobs, plan) if not sde] == [0.0, 0.0]
    assert all(lp != 0.0 for lp, sde in zip(trajectory.behaviour_logprobs, plan) if sde)
    assert (payload.noise_level, payload.guidance_scale) == (NOISE, GUIDANCE)


def test_sde_log_probs_are_the_gaussian_density_of_the_recorded_draw(engine: DiffusionRolloutEngine) -> None:
    (trajectory,) = generate(engine, [request(2, 5, (True,) * 4)])
    payload = image_payload(trajectory)
    gen = engine.generator
    uncond, cond = gen.encode([""]), gen.encode([payload.prompt])
    for i in range(4):
        x = torch.from_numpy(payload.latents[i])[None]
        with torch.no_grad():
            v = guided_velocity(gen.transformer, x, torch.tensor([payload.sigmas[i]]), cond, uncond, GUIDANCE, 1000)
        mean, std = sde_transition(x, v, payload.sigmas[i], payload.sigmas[i + 1], NOISE)
        drawn = torch.from_numpy(payload.latents[i + 1])[None]
        # By hand: the mean over pixels of the normal log-density.
        by_hand = (-((drawn - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * np.log(2 * np.pi)).mean()
        assert trajectory.behaviour_logprobs[i] == pytest.approx(float(by_hand), abs=1e-4)
        assert trajectory.behaviour_logprobs[i] == pytest.approx(float(transition_log_prob(drawn, mean, std)), abs=1e-4)


def test_an_image_does_not_depend_on_the_batch_it_shared(engine: DiffusionRolloutEngine) -> None:
    alone = generate(engine, [request(8, 21, (True,) * 5)])[0]
    others = [request(d, 30 + d, (True,) * (3 + d % 3), prompt_id=d) for d in range(1, 8)]  # other lengths, other seeds
    crowd = generate(engine, [*others, request(8, 21, (True,) * 5, prompt_id=8)])
    together = next(t for t in crowd if t.prompt_id == 8)
    np.testing.assert_allclose(image_payload(together).latents, image_payload(alone).latents, atol=1e-5)
    np.testing.assert_allclose(together.behaviour_logprobs, alone.behaviour_logprobs, atol=1e-4)


def test_more_requests_than_rows_and_concurrent_calls_all_finish(engine: DiffusionRolloutEngine) -> None:
    async def run() -> tuple[list[Trajectory], list[Trajectory]]:
        first = [request(d % 10, d, (True,) * 3, prompt_id=d) for d in range(12)]  # 12 requests, 8 rows
        second = [request(1, 100 + i, (False,) * 7, prompt_id=100, index=i) for i in range(5)]

        async def collect(requests: list[DenoiseRequest]) -> list[Trajectory]:
            return [t async for t in engine.generate(requests)]

        a, b = await asyncio.gather(collect(first), collect(second))
        return a, b

    a, b = asyncio.run(run())
    assert sorted(t.prompt_id for t in a) == list(range(12))
    assert sorted(t.index for t in b) == list(range(5)) and all(t.num_actions == 7 for t in b)


def test_a_closed_stream_drops_its_requests_and_the_engine_goes_on(engine: DiffusionRolloutEngine) -> None:
    async def run() -> list[Trajectory]:
        stream = engine.generate([request(1, i, (True,) * 30, prompt_id=i) for i in range(8)])
        await stream.__anext__()
        await stream.aclose()
        return [t async for t in engine.generate([request(2, 7, (True,) * 2)])]

    assert len(asyncio.run(run())) == 1


def test_requests_without_steps_are_refused_and_a_closed_engine_refuses_work() -> None:
    engine = DiffusionRolloutEngine(MODEL_DIR, noise_level=NOISE, guidance_scale=1.0, max_batch_size=2)
    with pytest.raises(ValueError, match="no denoising steps"):
        engine.generate([request(1, 1, ())])
    engine.close()

    async def run() -> None:
        engine.generate([request(1, 1, (True,))])

    with pytest.raises(EngineClosedError):
        asyncio.run(run())
    with pytest.raises(ValueError, match="noise_level"):
        DiffusionRolloutEngine(MODEL_DIR, noise_level=0.0, guidance_scale=1.0)
