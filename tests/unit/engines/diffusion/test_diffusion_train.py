"""The image train engine: Flow-GRPO's per-step log-probs recomputed exactly, trained in micro-batches."""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tandem.algorithms import PolicyObjective, plan_mini_batches
from tandem.algorithms.batch import LossInputs
from tandem.algorithms.flow_grpo import sde_transition, transition_kl
from tandem.algorithms.losses import compute_policy_loss
from tandem.core.config import AlgorithmConfig
from tandem.core.records import Trajectory
from tandem.engines.diffusion.model import guided_velocity, load_generator
from tandem.engines.diffusion.payload import image_payload
from tandem.engines.diffusion.rollout import DenoiseRequest, DiffusionRolloutEngine
from tandem.engines.diffusion.train import DiffusionTrainEngine
from tandem.tasks.digits import MODEL_DIR, format_prompt

GUIDANCE = 1.5
NOISE = 0.7
PLANS = [(True,) * 6, (False, True, True, True, False, False)]  # plain Flow-GRPO and a Flow-GRPO-Fast window


@pytest.fixture(scope="module")
def trajectories() -> list[Trajectory]:
    """Eight images of four digits, half with an SDE window, sampled by the rollout engine at version 0."""
    engine = DiffusionRolloutEngine(MODEL_DIR, noise_level=NOISE, guidance_scale=GUIDANCE, max_batch_size=3)
    requests = [DenoiseRequest(i // 2, i % 2, format_prompt(i // 2 * 2), 500 + i, PLANS[i % 2]) for i in range(8)]

    async def run() -> list[Trajectory]:
        return [t async for t in engine.generate(requests)]

    try:
        done = sorted(asyncio.run(run()), key=lambda t: (t.prompt_id, t.index))
    finally:
        engine.close()
    return [replace(t, advantage=(-1.0) ** i * (1 + i / 8)) for i, t in enumerate(done)]


def trainer(**kwargs: object) -> DiffusionTrainEngine:
    return DiffusionTrainEngine(MODEL_DIR, **{"lr": 1e-3, **kwargs})  # type: ignore[arg-type]


def flow_grpo(**overrides: object) -> PolicyObjective:
    return PolicyObjective(AlgorithmConfig(decoupled=False, **overrides))  # type: ignore[arg-type]


def weights(engine: DiffusionTrainEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


@dataclass
class Recording:
    """An objective that records the LossInputs it is handed, then computes the configured loss."""

    settings: AlgorithmConfig
    seen: list[LossInputs] = field(default_factory=list)
    mean_over: str = "tokens"

    def __call__(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        self.seen.append(inputs)
        return compute_policy_loss(inputs, self.settings)


def test_recomputed_log_probs_equal_the_rollouts_on_the_same_weights(trajectories: list[Trajectory]) -> None:
    engine = trainer(max_pairs_per_micro_batch=5)  # other batch compositions than the rollout's
    try:
        recomputed = asyncio.run(engine.logprobs(trajectories))
    finally:
        engine.close()
    for trajectory, logprobs in zip(trajectories, recomputed):
        assert len(logprobs) == trajectory.num_actions
        diff = np.abs(np.array(logprobs) - np.array(trajectory.behaviour_logprobs)).max()
        assert diff < 1e-4, (trajectory.prompt_id, trajectory.index, diff)
        sde = image_payload(trajectory).sde
        assert [lp for lp, s in zip(logprobs, sde) if not s] == [0.0] * sde.count(False)


def test_the_loss_sees_samples_by_steps_with_the_trained_steps_as_mask(trajectories: list[Trajectory]) -> None:
    objective = Recording(AlgorithmConfig(decoupled=False))
    engine = trainer(max_pairs_per_micro_batch=1000)
    try:
        metrics = asyncio.run(engine.train_step(trajectories, objective))
    finally:
        engine.close()
    (inputs,) = objective.seen
    assert inputs.logprobs.shape == (8, 6) and inputs.logprobs.requires_grad
    expected_mask = torch.tensor([t.loss_mask for t in trajectories], dtype=torch.float32)
    torch.testing.assert_close(inputs.mask, expected_mask)
    torch.testing.assert_close(inputs.behaviour_logprobs, torch.tensor([t.behaviour_logprobs for t in trajectories]))
    torch.testing.assert_close(inputs.advantages, torch.tensor([[t.advantage] for t in trajectories]) * expected_mask)
    assert inputs.kl is None and inputs.prox_logprobs is None
    assert metrics["tokens"] == float(expected_mask.sum()) and metrics["micro_batches"] == 1.0
    # Same weights as the rollout: every trained ratio is 1 (to float rounding).
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and metrics["clip_fraction"] == 0.0


def stepped_gradient(engine: DiffusionTrainEngine, batch: list[Trajectory]) -> tuple[dict[str, float], torch.Tensor]:
    """One train step's metrics and the (clipped) gradient the optimizer stepped with, flattened."""
    seen: list[torch.Tensor] = []

    def record(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        seen.append(torch.cat([p.grad.reshape(-1).clone() for group in optimizer.param_groups for p in group["params"]]))

    handle = register_optimizer_step_pre_hook(record)
    try:
        metrics = asyncio.run(engine.train_step(batch, flow_grpo()))
    finally:
        handle.remove()
    (gradient,) = seen
    return metrics, gradient


def test_micro_batching_does_not_change_the_step(trajectories: list[Trajectory]) -> None:
    # The gradient is compared, not the weights after the step: AdamW's first step is lr * g / (|g| + eps),
    # whose slope is lr / eps = 1e5 at g = 0, so float32 rounding (which differs between x86-64 CPUs)
    # in a near-zero gradient becomes a weight difference of a sizable fraction of a step.
    whole, split = trainer(max_pairs_per_micro_batch=1000), trainer(max_pairs_per_micro_batch=7)
    try:
        a, whole_gradient = stepped_gradient(whole, trajectories)
        b, split_gradient = stepped_gradient(split, trajectories)
        assert a["micro_batches"] == 1.0 and b["micro_batches"] > 2.0
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        # Summing micro-batches reorders float32 additions: the difference is rounding of the whole
        # gradient's size (measured 1.7e-6 of its norm), far below a mis-weighted micro-batch's.
        assert float((split_gradient - whole_gradient).norm()) <= 1e-4 * float(whole_gradient.norm())
        assert whole.version == split.version == 1
    finally:
        whole.close()
        split.close()


def test_each_mini_batch_is_an_optimizer_step_of_its_own_inside_one_version(trajectories: list[Trajectory]) -> None:
    # Flow-GRPO's reference trains several inner epochs per batch: two mini-batches of a train step
    # are two optimizer steps, each exactly a train step of its own on its half (the same
    # operations in the same order: equal bits on any CPU), while the version moves by one.
    halves = plan_mini_batches([t.prompt_id for t in trajectories], 2, 1, seed=0, step=0)
    together, apart = trainer(), trainer()
    try:
        metrics = asyncio.run(together.train_step(trajectories, flow_grpo(), halves))
        for half in halves:
            asyncio.run(apart.train_step([trajectories[i] for i in half], flow_grpo()))
        assert (together.version, apart.version) == (1, 2)
        assert (metrics["optimizer_steps"], metrics["optimizer_steps_total"]) == (2.0, 2.0)
        assert metrics["tokens"] == sum(t.num_trained for t in trajectories)
        expected = weights(apart)
        assert all(torch.equal(tensor, expected[name]) for name, tensor in weights(together).items())
    finally:
        together.close()
        apart.close()


def test_a_small_step_raises_the_advantage_weighted_log_likelihood_of_the_trained_steps(
    trajectories: list[Trajectory],
) -> None:
    # At ratio 1 the clipped objective's gradient is -mean(A * grad log p): a small step must raise sum(A * log p).
    engine = trainer(lr=1e-6)
    try:
        before = asyncio.run(engine.logprobs(trajectories))
        asyncio.run(engine.train_step(trajectories, flow_grpo()))
        after = asyncio.run(engine.logprobs(trajectories))
    finally:
        engine.close()

    def surrogate(logprobs: list[list[float]]) -> float:
        return sum(t.advantage * np.dot(lp, t.loss_mask) for t, lp in zip(trajectories, logprobs))

    assert surrogate(after) > surrogate(before)
    untrained = [(old[0], new[0]) for t, old, new in zip(trajectories, before, after) if t.loss_mask[0] == 0]
    assert untrained and all(old == new == 0.0 for old, new in untrained)  # ODE steps have no log-prob


def test_the_exact_kl_is_the_closed_form_against_the_initial_weights(trajectories: list[Trajectory]) -> None:
    objective = Recording(AlgorithmConfig(decoupled=False, kl_estimator="exact", kl_coef=0.5))
    engine = trainer(kl_reference=True, max_pairs_per_micro_batch=1000)
    try:
        first = asyncio.run(engine.train_step(trajectories, objective))
        at_version_1 = copy.deepcopy(engine.model)
        second = asyncio.run(engine.train_step(trajectories, objective))
        assert first["kl_loss"] == pytest.approx(0.0, abs=1e-9)  # version 0 is the reference
        assert second["kl_loss"] > 0.0
        inputs = objective.seen[1]
        assert inputs.kl is not None and inputs.kl.shape == (8, 6) and torch.all(inputs.kl[inputs.mask == 0] == 0)
        assert inputs.kl.requires_grad  # the KL term trains the policy's mean
        # By hand for each trained step of one trajectory: ||mean - ref_mean||^2 / (2 std^2), pixel mean,
        # between the transitions of the weights the second step started from and of the initial ones.
        initial = load_generator(MODEL_DIR)
        payload = image_payload(trajectories[1])
        cond, uncond = initial.encode([payload.prompt]), initial.encode([""])
        for step in (1, 2, 3):
            x, sigma = torch.from_numpy(payload.latents[step])[None], torch.tensor([payload.sigmas[step]])
            with torch.no_grad():
                (mean, std), (ref_mean, _) = (
                    sde_transition(x, guided_velocity(m, x, sigma, cond, uncond, GUIDANCE, 1000), sigma,
                                   payload.sigmas[step + 1], NOISE)
                    for m in (at_version_1, initial.transformer)
                )
            by_hand = ((mean - ref_mean) ** 2 / (2 * std**2)).mean()
            recorded = float(inputs.kl[1, step].detach())
            assert recorded == pytest.approx(float(by_hand), rel=1e-4, abs=1e-9)
            assert recorded == pytest.approx(float(transition_kl(mean, ref_mean, std)), rel=1e-4)
    finally:
        engine.close()


def test_trajectories_it_cannot_train_are_refused(trajectories: list[Trajectory]) -> None:
    engine = trainer()
    ode = trajectories[1]  # its step 0 is an ODE step
    cases = {
        "ODE steps": [replace(ode, loss_mask=[1] * 6)],
        "no advantage": [replace(trajectories[0], advantage=None)],
        "some trajectories": [replace(trajectories[0], prox_logprobs=[0.0] * 6), trajectories[2]],
        "exact KL": [replace(trajectories[0], ref_logprobs=[0.0] * 6)],
        "loss_mask for 5 steps": [replace(trajectories[0], behaviour_logprobs=[0.0] * 5)],
    }
    try:
        for message, batch in cases.items():
            with pytest.raises(ValueError, match=message):
                asyncio.run(engine.train_step(batch, flow_grpo()))
        with pytest.raises(TypeError, match="image trajectories"):
            asyncio.run(engine.logprobs([replace(trajectories[0], payload="text")]))
        assert engine.version == 0
    finally:
        engine.close()


def test_state_round_trips_and_the_export_loads_as_a_generator(trajectories: list[Trajectory], tmp_path: Path) -> None:
    engine, restored = trainer(), trainer()
    try:
        asyncio.run(engine.train_step(trajectories, flow_grpo()))
        asyncio.run(engine.save_state(tmp_path))
        asyncio.run(restored.load_state(tmp_path))
        assert restored.version == engine.version == 1
        for name, tensor in weights(engine).items():
            assert torch.equal(weights(restored)[name], tensor)
        # The optimizer state came along: the next step is the same on both.
        asyncio.run(engine.train_step(trajectories, flow_grpo()))
        asyncio.run(restored.train_step(trajectories, flow_grpo()))
        for name, tensor in weights(engine).items():
            torch.testing.assert_close(weights(restored)[name], tensor)
        asyncio.run(engine.export(tmp_path / "export"))
        exported = load_generator(tmp_path / "export")
        for name, tensor in exported.transformer.state_dict().items():
            assert torch.equal(tensor, weights(engine)[name])
    finally:
        engine.close()
        restored.close()
