"""Flow-GRPO's pure functions: the SDE step's Gaussian, its log-prob and KL, the clipped objective, the window, the schedule."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import norm

from tandem.algorithms.flow_grpo import (
    choose_sde_window,
    classifier_free_guidance,
    flow_grpo_loss,
    flow_match_sigmas,
    ode_step,
    sde_step,
    sde_step_mask,
    sde_transition,
    transition_kl,
    transition_log_prob,
)


def _batch(seed: int = 0, shape: tuple[int, ...] = (3, 1, 4, 4)) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def test_sde_mean_and_std_follow_the_papers_equation_9() -> None:
    # Written the paper's way: x + [v + σ_t²/(2t)·(x + (1 - t)·v)]·dt, noise σ_t·sqrt(|dt|).
    x, v = _batch()
    t, t_next, a = 0.6, 0.45, 0.7
    sigma_t = a * math.sqrt(t / (1 - t))
    dt = t_next - t
    mean, std = sde_transition(x, v, t, t_next, a)
    torch.testing.assert_close(mean, x + (v + sigma_t**2 / (2 * t) * (x + (1 - t) * v)) * dt)
    assert float(std) == pytest.approx(sigma_t * math.sqrt(-dt))


def test_sde_log_prob_is_the_mean_of_scipys_gaussian_log_density() -> None:
    x, v = _batch()
    step = sde_step(x, v, 0.8, 0.7, noise_level=0.7, generator=torch.Generator().manual_seed(1))
    mean, std = sde_transition(x, v, 0.8, 0.7, 0.7)
    torch.testing.assert_close(step.mean, mean)
    density = norm.logpdf(step.next_sample.double().numpy(), loc=mean.double().numpy(), scale=float(std))
    expected = torch.from_numpy(density).mean(dim=(1, 2, 3)).float()
    torch.testing.assert_close(step.log_prob, expected, rtol=1e-5, atol=1e-5)


def test_recomputed_log_prob_of_the_recorded_sample_equals_the_rollouts() -> None:
    # The train side recomputes mean and std from the same (sample, velocity) and scores the recorded draw.
    x, v = _batch()
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    step = sde_step(x, v, 1.0, 0.9, noise_level=0.7, noise=noise)
    mean, std = sde_transition(x, v, 1.0, 0.9, 0.7)
    torch.testing.assert_close(transition_log_prob(step.next_sample, mean, std), step.log_prob)
    torch.testing.assert_close(step.next_sample, mean + std * noise)


def test_at_sigma_one_the_noise_scale_uses_the_next_sigma() -> None:
    # t/(1 - t) is infinite at t = 1; the reference puts the schedule's next sigma in the denominator.
    x, v = _batch()
    _, std = sde_transition(x, v, 1.0, 0.9, 0.7)
    assert torch.isfinite(std)
    assert float(std) == pytest.approx(0.7 * math.sqrt(1.0 / (1 - 0.9)) * math.sqrt(0.1), rel=1e-6)


def test_per_sample_sigmas_match_scalar_steps_row_by_row() -> None:
    x, v = _batch()
    sigmas = torch.tensor([0.9, 0.5, 0.2])
    nexts = torch.tensor([0.8, 0.4, 0.0])
    mean, std = sde_transition(x, v, sigmas, nexts, 0.5)
    for row in range(3):
        row_mean, row_std = sde_transition(x[row : row + 1], v[row : row + 1], float(sigmas[row]), float(nexts[row]), 0.5)
        torch.testing.assert_close(mean[row : row + 1], row_mean)
        assert float(std[row]) == pytest.approx(float(row_std))


def test_ode_step_is_the_sde_mean_without_noise_and_the_euler_step() -> None:
    x, v = _batch()
    mean, std = sde_transition(x, v, 0.7, 0.6, noise_level=0.0)
    torch.testing.assert_close(ode_step(x, v, 0.7, 0.6), mean)
    torch.testing.assert_close(ode_step(x, v, 0.7, 0.6), x + v * (0.6 - 0.7))
    assert float(std) == 0.0


def test_log_prob_gradient_reaches_the_velocity_but_not_the_recorded_sample() -> None:
    x, v = _batch()
    v.requires_grad_(True)
    step = sde_step(x, v, 0.5, 0.4, noise_level=0.7, generator=torch.Generator().manual_seed(3))
    step.log_prob.sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0  # a detached draw would cancel (x - mean) and give zero


def test_sde_step_refuses_zero_noise_and_misshaped_noise() -> None:
    x, v = _batch()
    with pytest.raises(ValueError, match="noise_level"):
        sde_step(x, v, 0.5, 0.4, noise_level=0.0)
    with pytest.raises(ValueError, match="noise must have"):
        sde_step(x, v, 0.5, 0.4, noise_level=0.7, noise=torch.zeros(1, 1, 4, 4))
    with pytest.raises(ValueError, match="one value per sample"):
        sde_transition(x, v, torch.tensor([0.5, 0.4]), 0.3, 0.7)


def test_closed_form_kl_matches_a_monte_carlo_estimate() -> None:
    g = torch.Generator().manual_seed(4)
    mean = torch.randn(2, 1, 4, 4, generator=g)
    ref_mean = mean + 0.3 * torch.randn(2, 1, 4, 4, generator=g)
    std = torch.tensor(0.25)
    draws = 20_000
    means, ref_means = mean.repeat(draws, 1, 1, 1), ref_mean.repeat(draws, 1, 1, 1)
    x = means + std * torch.randn(means.shape, generator=g)
    # E_{x ~ N(mean)}[log p(x) - log p_ref(x)], each log-prob averaged over elements as the step's is.
    log_ratio = (transition_log_prob(x, means, std) - transition_log_prob(x, ref_means, std)).double().view(draws, 2)
    estimate = log_ratio.mean(0)
    std_error = log_ratio.std(0) / math.sqrt(draws)
    closed = transition_kl(mean, ref_mean, std).double()
    assert torch.all((estimate - closed).abs() < 4 * std_error), (estimate, closed, std_error)
    assert torch.all(closed > 0)


def test_kl_is_zero_for_equal_means_and_differentiable_in_the_policy_mean() -> None:
    mean = torch.randn(2, 1, 4, 4, requires_grad=True)
    assert torch.equal(transition_kl(mean, mean.detach().clone(), torch.tensor(0.3)), torch.zeros(2))
    transition_kl(mean, torch.zeros(2, 1, 4, 4), torch.tensor(0.3)).sum().backward()
    assert mean.grad is not None and mean.grad.abs().sum() > 0


def test_grpo_loss_clips_by_the_sign_of_the_advantage() -> None:
    # Ratios 1.5, 0.5, 1.5, 0.5 against advantages +1, +1, -1, -1, clip range 0.2.
    logprobs = torch.log(torch.tensor([1.5, 0.5, 1.5, 0.5]))
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, metrics = flow_grpo_loss(logprobs, torch.zeros(4), advantages, clip_range=0.2)
    # max(-A r, -A clip(r)): -1.2 (clipped), -0.5, 1.5, 0.8 (clipped) -> mean 0.15
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.5 + 0.8) / 4)
    assert metrics["clip_fraction"] == 1.0  # |r - 1| = 0.5 > 0.2 for all four
    assert metrics["ratio_mean"] == pytest.approx(1.0)


def test_grpo_loss_gradient_flows_only_through_the_new_log_probs() -> None:
    logprobs = torch.tensor([[0.05, -0.3], [0.1, 0.0]], requires_grad=True)
    old = torch.zeros(2, 2, requires_grad=True)
    advantages = torch.tensor([1.0, -2.0], requires_grad=True)  # one per sample, shared by its two steps
    loss, metrics = flow_grpo_loss(logprobs, old, advantages, clip_range=0.2)
    loss.backward()
    assert old.grad is None and advantages.grad is None
    # Unclipped pairs get d/dlogp (-A r)/4 = -A r / 4; the sample-0 step at ratio e^-0.3 < 0.8 with A > 0 is
    # not clipped (the max keeps the unclipped term), so every pair has gradient here.
    ratio = logprobs.detach().exp()
    torch.testing.assert_close(logprobs.grad, -torch.tensor([[1.0], [-2.0]]) * ratio / 4)
    assert metrics["clip_fraction"] == pytest.approx(0.25)


def test_grpo_loss_gives_no_gradient_to_pairs_clipped_in_the_advantages_direction() -> None:
    logprobs = torch.log(torch.tensor([1.5, 1.1])).requires_grad_(True)
    loss, _ = flow_grpo_loss(logprobs, torch.zeros(2), torch.tensor([1.0, 1.0]), clip_range=0.2)
    loss.backward()
    assert logprobs.grad[0] == 0.0 and logprobs.grad[1] == pytest.approx(-1.1 / 2)


def test_classifier_free_guidance_interpolates_and_extrapolates() -> None:
    uncond, cond = torch.zeros(2, 3), torch.ones(2, 3)
    torch.testing.assert_close(classifier_free_guidance(uncond, cond, 1.0), cond)
    torch.testing.assert_close(classifier_free_guidance(uncond, cond, 0.0), uncond)
    torch.testing.assert_close(classifier_free_guidance(uncond, cond, 4.5), torch.full((2, 3), 4.5))


def test_sde_window_fixed_start_and_mask() -> None:
    window = choose_sde_window(10, 3, start=2)
    assert window == range(2, 5)
    assert sde_step_mask(10, window) == [False, False, True, True, True, False, False, False, False, False]


def test_sde_window_random_start_is_seeded_and_bounded() -> None:
    windows = [choose_sde_window(10, 2, seed=seed, latest_start=4) for seed in range(200)]
    assert {w.start for w in windows} == set(range(5))  # every allowed start occurs, none beyond
    assert all(len(w) == 2 for w in windows)
    assert choose_sde_window(10, 2, seed=7, latest_start=4) == windows[7]
    assert {w.start for w in (choose_sde_window(10, 4, seed=s) for s in range(200))} == set(range(7))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_steps": 5, "size": 6, "start": 0}, "window size"),
        ({"num_steps": 5, "size": 2}, "exactly one"),
        ({"num_steps": 5, "size": 2, "start": 1, "seed": 1}, "exactly one"),
        ({"num_steps": 5, "size": 2, "start": 4}, "start must be"),
        ({"num_steps": 5, "size": 2, "seed": 0, "latest_start": 4}, "latest_start"),
    ],
)
def test_sde_window_refuses_windows_outside_the_schedule(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        choose_sde_window(**kwargs)


@pytest.mark.parametrize("shift", [1.0, 3.0])
@pytest.mark.parametrize("num_steps", [1, 4, 10, 28])
def test_sigma_schedule_is_the_flow_match_euler_schedulers(num_steps: int, shift: float) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(num_steps)
    sigmas = flow_match_sigmas(num_steps, shift=shift)
    assert torch.equal(sigmas, scheduler.sigmas)
    assert torch.equal(sigmas[:-1] * 1000, scheduler.timesteps)


def test_ode_steps_over_the_schedule_are_the_flow_match_euler_schedulers_steps() -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(6)
    sigmas = flow_match_sigmas(6, shift=3.0)
    ours = theirs = torch.randn(2, 1, 4, 4, generator=torch.Generator().manual_seed(5))
    for i, timestep in enumerate(scheduler.timesteps):
        velocity = torch.sin(ours * (i + 1))  # any function of the state stands in for the model
        ours = ode_step(ours, velocity, float(sigmas[i]), float(sigmas[i + 1]))
        theirs = scheduler.step(torch.sin(theirs * (i + 1)), timestep, theirs).prev_sample
    torch.testing.assert_close(ours, theirs)


def _exact_kl_settings(**overrides: object) -> object:
    from types import SimpleNamespace

    base = dict(
        loss="ppo", clip_eps_low=0.2, clip_eps_high=0.2, dual_clip_c=None, decoupled=False,
        behaviour_weight_level="token", behaviour_weight_mode="mask", behaviour_weight_cap=5.0,
        behaviour_weight_floor=None, tis_cap=1.0, topr_positive_weight=1.0, topr_negative_weight=1.0,
        cispo_eps_low=1.0, cispo_eps_high=0.2, kimi15_tau=0.1, kl_estimator="exact", kl_coef=0.5,
        kl_importance_weight=False, aggregation="token-mean",
    )  # fmt: skip
    return SimpleNamespace(**{**base, **overrides})


def test_the_loss_adds_the_engines_exact_kl_over_the_trained_steps() -> None:
    # Flow-GRPO's KL term: the closed form the engine computed per (sample, step), weighted by kl_coef,
    # averaged like the policy loss over the trained steps only (mask), with its gradient.
    from tandem.algorithms.batch import LossInputs
    from tandem.algorithms.losses import EXACT_KL, compute_policy_loss

    mean = torch.randn(2, 3, 1, 4, 4, requires_grad=True)
    ref_mean, std = torch.zeros(2, 3, 1, 4, 4), torch.tensor(0.5)
    kl = transition_kl(mean.view(6, 1, 4, 4), ref_mean.view(6, 1, 4, 4), std).view(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
    logprobs = torch.zeros(2, 3, requires_grad=True)
    inputs = LossInputs(logprobs=logprobs, behaviour_logprobs=torch.zeros(2, 3), advantages=torch.zeros(2, 3), mask=mask, kl=kl)
    loss, metrics = compute_policy_loss(inputs, _exact_kl_settings())
    expected = (kl * mask).sum() / mask.sum()
    assert EXACT_KL == "exact"
    assert metrics["kl_loss"] == pytest.approx(expected.item()) and loss.item() == pytest.approx(0.5 * expected.item())
    loss.backward()
    assert mean.grad is not None
    assert torch.all(mean.grad[0, 2] == 0) and torch.all(mean.grad[1, 0] == 0)  # untrained steps: no KL gradient
    assert mean.grad[0, 0].abs().sum() > 0


def test_the_exact_kl_must_come_from_the_engine_and_is_not_importance_weighted() -> None:
    from tandem.algorithms.batch import LossInputs
    from tandem.algorithms.losses import compute_policy_loss

    zeros = torch.zeros(1, 2)
    logprobs = zeros.clone().requires_grad_()
    inputs = LossInputs(logprobs=logprobs, behaviour_logprobs=zeros, advantages=zeros, mask=torch.ones(1, 2))
    with pytest.raises(ValueError, match=r"LossInputs.kl"):
        compute_policy_loss(inputs, _exact_kl_settings())
    inputs.kl = torch.tensor([[0.1, float("nan")]])
    loss, metrics = compute_policy_loss(inputs, _exact_kl_settings())  # a non-finite KL leaves its step out
    assert metrics["nonfinite_fraction"] == 0.5 and torch.isfinite(loss)
    inputs.prox_logprobs = zeros
    with pytest.raises(ValueError, match="not one"):
        compute_policy_loss(inputs, _exact_kl_settings(decoupled=True, kl_importance_weight=True))
