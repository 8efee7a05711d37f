"""AReaL's log-linear proximal log-probs against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from tandem.algorithms.prox import loglinear_prox_logprobs

BEHAVIOUR = torch.tensor([[-2.0, -2.0, -2.0, -4.0]])
CURRENT = torch.tensor([[-1.0, -1.0, -1.0, -3.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0]])


def test_interpolation_by_version_distance() -> None:
    # v_prox 5, v_cur 6; tokens sampled at 3, 4, 5 (the fourth is padding, version -1 ignored):
    # alpha = 2/3, 1/2, 0 -> -2 + alpha * (-1 - -2) = -4/3, -1.5, -2; padding keeps its behaviour.
    versions = torch.tensor([[3, 4, 5, -1]])
    prox = loglinear_prox_logprobs(BEHAVIOUR, CURRENT, versions, MASK, prox_version=5, current_version=6)
    torch.testing.assert_close(prox, torch.tensor([[-4 / 3, -1.5, -2.0, -4.0]]))


def test_a_later_optimizer_step_of_the_train_step_stands_between_versions() -> None:
    # Mini-batches: after 2 of a train step's 4 optimizer steps the weights stand at v_cur = 5.5
    # (v_prox 5, the step's start). Tokens sampled at 3, 4, 5: alpha = 2/2.5, 1/1.5, 0
    # -> -2 + 0.8, -2 + 2/3, -2 (a token of the step's own version keeps its behaviour log-prob).
    versions = torch.tensor([[3, 4, 5, -1]])
    prox = loglinear_prox_logprobs(BEHAVIOUR, CURRENT, versions, MASK, prox_version=5, current_version=5.5)
    torch.testing.assert_close(prox, torch.tensor([[-1.2, -4 / 3, -2.0, -4.0]]))


def test_a_forward_at_the_proximal_version_is_exact() -> None:
    # A train step's first optimizer step: its forward runs at v_prox, so alpha = 1 whatever the
    # tokens' versions (including tokens of that very version): pi_prox = pi_theta.
    versions = torch.tensor([[3, 4, 5, 5]])
    prox = loglinear_prox_logprobs(BEHAVIOUR, CURRENT, versions, torch.ones(1, 4), prox_version=5, current_version=5)
    torch.testing.assert_close(prox, CURRENT)


def test_the_result_is_data() -> None:
    current = CURRENT.clone().requires_grad_()
    versions = torch.tensor([[3, 4, 5, 5]])
    prox = loglinear_prox_logprobs(BEHAVIOUR, current, versions, MASK, prox_version=5, current_version=6)
    assert not prox.requires_grad


def test_versions_out_of_order_are_refused() -> None:
    with pytest.raises(ValueError, match="newer than the proximal"):
        loglinear_prox_logprobs(BEHAVIOUR, CURRENT, torch.tensor([[3, 6, 5, -1]]), MASK, prox_version=5, current_version=6)
    with pytest.raises(ValueError, match="prox_version"):
        loglinear_prox_logprobs(BEHAVIOUR, CURRENT, torch.tensor([[3, 4, 5, -1]]), MASK, prox_version=7, current_version=6)
    with pytest.raises(ValueError, match="one shape"):
        loglinear_prox_logprobs(BEHAVIOUR, CURRENT[:, :3], torch.tensor([[3, 4, 5, -1]]), MASK, prox_version=5, current_version=6)
