"""Where pi_prox comes from (``PolicyObjective.proximal``) and the critic's objective.

``current`` is exact at a train step's first optimizer step: the trainer's recomputed proximal
log-probs equal the step's own forward pass, so the loss and its gradient are the recompute
ones. ``loglinear`` is too, and at later optimizer steps, on tokens sampled at the step's own
version (zero staleness), it is the behaviour policy: the recompute when the engines agree.
``behaviour`` is naive PPO anchored at the behaviour policy (``decoupled: false``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tandem.algorithms.batch import LossInputs
from tandem.algorithms.gae import ValueInputs, clipped_value_loss, whiten
from tandem.algorithms.objective import PolicyObjective, ValueObjective
from tandem.core.config import AlgorithmConfig

BEHAVIOUR = torch.tensor([[-1.2, -0.4, -2.0], [-0.9, -1.6, 0.0]])
# Every token sampled at version 7 (-1: padding), the train step's own: zero staleness.
FRESH = torch.tensor([[7, 7, 7], [7, 7, -1]])


def inputs(
    logprobs: torch.Tensor, prox: torch.Tensor | None, current_version: float = 7.0, versions: torch.Tensor = FRESH
) -> LossInputs:
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return LossInputs(
        logprobs=logprobs,
        behaviour_logprobs=BEHAVIOUR,
        advantages=torch.tensor([[1.0], [-0.5]]) * mask,
        mask=mask,
        prox_logprobs=prox,
        versions=versions,
        prox_version=7,
        current_version=current_version,
    )


def loss_and_grad(
    objective: PolicyObjective, make_prox: bool, prox: torch.Tensor | None = None, **where: Any
) -> tuple[float, torch.Tensor]:
    logprobs = torch.tensor([[-1.0, -0.5, -1.8], [-1.1, -1.3, 0.0]], requires_grad=True)
    if make_prox:
        prox = logprobs.detach().clone()
    loss, _ = objective(inputs(logprobs, prox, **where))
    loss.backward()
    assert logprobs.grad is not None
    return float(loss.detach()), logprobs.grad


def test_the_step_s_own_forward_pass_is_the_recomputed_proximal_policy() -> None:
    settings = AlgorithmConfig()
    recompute = loss_and_grad(PolicyObjective(settings, "recompute"), make_prox=True)
    current = loss_and_grad(PolicyObjective(settings, "current"), make_prox=False)
    assert current[0] == pytest.approx(recompute[0])
    torch.testing.assert_close(current[1], recompute[1])


def test_loglinear_at_a_train_step_s_first_optimizer_step_is_the_recomputed_proximal_policy() -> None:
    # The first optimizer step's forward runs on pi_prox (current_version == prox_version):
    # alpha = 1 for tokens of every age, so pi_prox is the step's own forward, as recomputed.
    settings = AlgorithmConfig()
    recompute = loss_and_grad(PolicyObjective(settings, "recompute"), make_prox=True)
    for versions in (FRESH, torch.tensor([[4, 5, 6], [7, 3, -1]])):
        loglinear = loss_and_grad(PolicyObjective(settings, "loglinear"), make_prox=False, versions=versions)
        assert loglinear[0] == pytest.approx(recompute[0])
        torch.testing.assert_close(loglinear[1], recompute[1])


def test_loglinear_at_zero_staleness_is_the_recompute_of_engines_that_agree() -> None:
    # A later optimizer step (the weights at 7.5, half-way to version 8) on tokens sampled at
    # version 7: alpha = 0, pi_prox = pi_behav. A recompute at version 7 by a trainer that agrees
    # with the rollout engine returns those very log-probs: the same loss and gradient.
    settings = AlgorithmConfig()
    recompute = loss_and_grad(PolicyObjective(settings, "recompute"), make_prox=False, prox=BEHAVIOUR, current_version=7.5)
    loglinear = loss_and_grad(PolicyObjective(settings, "loglinear"), make_prox=False, current_version=7.5)
    assert loglinear[0] == pytest.approx(recompute[0])
    torch.testing.assert_close(loglinear[1], recompute[1])


def test_loglinear_needs_the_versions() -> None:
    logprobs = torch.zeros(2, 3, requires_grad=True)
    bare = replace(inputs(logprobs, None), versions=None)
    with pytest.raises(ValueError, match="loglinear needs"):
        PolicyObjective(AlgorithmConfig(), "loglinear")(bare)


def test_behaviour_as_the_proximal_policy_is_naive_ppo() -> None:
    behaviour = loss_and_grad(PolicyObjective(AlgorithmConfig(), "behaviour"), make_prox=False)
    naive = loss_and_grad(PolicyObjective(AlgorithmConfig(decoupled=False)), make_prox=False)
    assert behaviour[0] == pytest.approx(naive[0])
    torch.testing.assert_close(behaviour[1], naive[1])


def test_a_recomputed_proximal_policy_must_be_given() -> None:
    with pytest.raises(ValueError, match="prox_logprobs"):
        loss_and_grad(PolicyObjective(AlgorithmConfig(), "recompute"), make_prox=False)


def test_unknown_proximal_sources_are_refused() -> None:
    with pytest.raises(ValueError, match="proximal"):
        PolicyObjective(AlgorithmConfig(), "linear")  # type: ignore[arg-type]


def test_the_value_objective_is_the_clipped_value_loss_averaged_as_configured() -> None:
    values = torch.tensor([[0.4, 1.0], [0.0, 0.0]], requires_grad=True)
    data = ValueInputs(
        values=values, old_values=torch.tensor([[0.5, 0.5], [0.2, 0.0]]),
        returns=torch.tensor([[1.0, 0.0], [1.0, 0.0]]), mask=torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
    )
    loss, metrics = ValueObjective(clip_eps=0.2)(data)
    expected, _ = clipped_value_loss(values, data.old_values, data.returns, data.mask, clip_eps=0.2)
    assert float(loss.detach()) == pytest.approx(float(expected.detach()))
    assert metrics["value_loss"] == pytest.approx(float(expected.detach()))
    assert ValueObjective(0.2).mean_over == "tokens"
    assert ValueObjective(0.2, "seq-mean-token-mean").mean_over == "sequences"
    # By hand, token mean over the 3 real tokens, 1/2 max(unclipped, clipped)^2 each:
    #   0.4 vs old 0.5, return 1: clip range [0.3, 0.7], 0.4 inside: (0.6)^2 = 0.36
    #   1.0 vs old 0.5, return 0: clipped to 0.7: max(1.0, 0.49) = 1.0
    #   0.0 vs old 0.2, return 1: clipped to 0.0: both 1.0
    assert float(loss.detach()) == pytest.approx(0.5 * (0.36 + 1.0 + 1.0) / 3)


def test_whitening_by_hand() -> None:
    advantages = torch.tensor([[0.5, 0.5, 9.0], [-0.25, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    std = math.sqrt(0.1875)
    torch.testing.assert_close(
        whiten(advantages, mask), torch.tensor([[0.25 / std, 0.25 / std, 0.0], [-0.5 / std, 0.0, 0.0]]), rtol=1e-6, atol=1e-6
    )
    assert not whiten(torch.tensor([[2.0, 2.0]]), torch.ones(1, 2)).any()  # equal values: zeros, not 0 / 0
    assert not whiten(torch.tensor([[2.0, 3.0]]), torch.tensor([[1.0, 0.0]])).any()  # one value


def test_the_settings_protocol_is_satisfied_by_a_plain_namespace() -> None:
    # The objective reads the loss settings by name only: pure use needs no pydantic model.
    settings = SimpleNamespace(**AlgorithmConfig().model_dump())
    loss, _ = loss_and_grad(PolicyObjective(settings, "current"), make_prox=False)  # type: ignore[arg-type]
    assert math.isfinite(loss)
