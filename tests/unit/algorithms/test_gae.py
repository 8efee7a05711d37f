"""GAE and the clipped value loss against hand-computed values: the specification of algorithms.gae."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.algorithms.gae import clipped_value_loss, gae_advantages, outcome_token_rewards

GAMMA, LAM = 0.9, 0.8


def assert_close(actual: torch.Tensor, expected: list[list[float]]) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_gae_hand_values_across_an_environment_turn() -> None:
    # Row 0: actions at 0, 1 and 3; position 2 is the environment's turn (mask 0), its value 9
    # must not be read. Reward 1 on the last action. gamma 0.9, lambda 0.8:
    #   t3: delta = 1 + 0 - 0.8 = 0.2                                  A = 0.2
    #   t1: delta = 0 + 0.9 * 0.8 - 0.6 = 0.12 (bootstraps from t3)    A = 0.12 + 0.72 * 0.2 = 0.264
    #   t0: delta = 0 + 0.9 * 0.6 - 0.5 = 0.04                         A = 0.04 + 0.72 * 0.264 = 0.23008
    # Returns A + V: 0.73008, 0.864, 0 (masked), 1.0.
    # Row 1: two actions then padding: t1: 0.5 - 0.2 = 0.3; t0: 0.9 * 0.2 - 0.1 + 0.72 * 0.3 = 0.296.
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.5, 0.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 9.0, 0.8], [0.1, 0.2, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    advantages, returns = gae_advantages(rewards, values, mask, gamma=GAMMA, lam=LAM)
    assert_close(advantages, [[0.23008, 0.264, 0.0, 0.2], [0.296, 0.3, 0.0, 0.0]])
    assert_close(returns, [[0.73008, 0.864, 0.0, 1.0], [0.396, 0.5, 0.0, 0.0]])


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.floats(-2, 2), st.floats(-2, 2), st.booleans()), min_size=1, max_size=8),
    st.floats(0, 1),
    st.floats(0, 1),
)
def test_masked_positions_are_skipped_as_if_absent(
    steps: list[tuple[float, float, bool]], gamma: float, lam: float
) -> None:
    # GAE over a row with masked positions equals GAE over the row with them removed.
    rewards = torch.tensor([[r if keep else 0.0 for r, _, keep in steps]], dtype=torch.float64)
    values = torch.tensor([[v for _, v, _ in steps]], dtype=torch.float64)
    mask = torch.tensor([[1.0 if keep else 0.0 for *_, keep in steps]], dtype=torch.float64)
    advantages, returns = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam)
    kept = mask[0] > 0
    compact_adv, compact_ret = gae_advantages(
        rewards[:, kept], values[:, kept], torch.ones(1, int(kept.sum()), dtype=torch.float64), gamma=gamma, lam=lam
    )
    torch.testing.assert_close(advantages[:, kept], compact_adv)
    torch.testing.assert_close(returns[:, kept], compact_ret)
    assert (advantages[:, ~kept] == 0).all() and (returns[:, ~kept] == 0).all()


def test_lambda_one_is_the_monte_carlo_return_and_lambda_zero_the_td_error() -> None:
    rewards = torch.tensor([[0.0, 1.0, 2.0]])
    values = torch.tensor([[0.5, 0.25, 1.0]])
    mask = torch.ones(1, 3)
    # gamma 0.5: returns G = [0 + 0.5 * 1 + 0.25 * 2, 1 + 0.5 * 2, 2] = [1, 2, 2].
    advantages, returns = gae_advantages(rewards, values, mask, gamma=0.5, lam=1.0)
    assert_close(returns, [[1.0, 2.0, 2.0]])
    assert_close(advantages, [[0.5, 1.75, 1.0]])
    # lambda 0: delta_t = r + 0.5 V_{t+1} - V_t = [0.125 - 0.5, 1 + 0.5 - 0.25, 2 - 1].
    advantages, _ = gae_advantages(rewards, values, mask, gamma=0.5, lam=0.0)
    assert_close(advantages, [[-0.375, 1.25, 1.0]])


def test_a_reward_on_a_masked_position_is_refused() -> None:
    with pytest.raises(ValueError, match="masked position"):
        gae_advantages(torch.tensor([[0.0, 1.0]]), torch.zeros(1, 2), torch.tensor([[1.0, 0.0]]), gamma=1.0, lam=1.0)


@pytest.mark.parametrize("bad", [{"gamma": 1.1, "lam": 0.9}, {"gamma": 0.9, "lam": -0.1}])
def test_gamma_and_lambda_outside_the_unit_interval_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        gae_advantages(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), **bad)


def test_advantages_carry_no_gradient() -> None:
    values = torch.tensor([[0.5, 0.6]], requires_grad=True)
    advantages, returns = gae_advantages(torch.tensor([[0.0, 1.0]]), values, torch.ones(1, 2), gamma=1.0, lam=1.0)
    assert not advantages.requires_grad and not returns.requires_grad


def test_outcome_rewards_sit_on_each_rows_last_action() -> None:
    # Row 0's last action is position 2 (position 3 is padding after an environment token at 1);
    # row 1 has no action and score 0.
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    rewards = outcome_token_rewards(torch.tensor([2.0, 0.0, -1.0]), mask)
    assert_close(rewards, [[0.0, 0.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, -1.0]])
    with pytest.raises(ValueError, match="without actions"):
        outcome_token_rewards(torch.tensor([2.0, 1.0, -1.0]), mask)


# ---------------------------------------------------------------------- value loss


def test_clipped_value_loss_hand_values_and_gradient() -> None:
    # eps 0.2. Token 0: V = 1.0, V_old = 1.1, R = 1.5: clip(1.0, 0.9, 1.3) = 1.0, both terms 0.25.
    # Token 1: V = 2.0, V_old = 1.0, R = 2.5: unclipped 0.25, clipped (1.2 - 2.5)^2 = 1.69 wins,
    # and it does not depend on V: no gradient. Token 2 is padding.
    # loss = 0.5 * (0.25 + 1.69) / 2 = 0.485; grad token 0 = 0.5 * 2 * (1.0 - 1.5) / 2 = -0.25.
    values = torch.tensor([[1.0, 2.0, 50.0]], requires_grad=True)
    old = torch.tensor([[1.1, 1.0, float("nan")]])
    returns = torch.tensor([[1.5, 2.5, float("inf")]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, metrics = clipped_value_loss(values, old, returns, mask, clip_eps=0.2)
    loss.backward()
    assert loss.item() == pytest.approx(0.485)
    assert values.grad is not None
    assert_close(values.grad, [[-0.25, 0.0, 0.0]])
    assert metrics == pytest.approx({"value_loss": 0.485, "value_clip_fraction": 0.5, "value_error_mean": 0.5})


def test_unbounded_clip_is_the_plain_squared_error() -> None:
    values = torch.tensor([[1.0, 2.0]], requires_grad=True)
    loss, metrics = clipped_value_loss(
        values, torch.tensor([[1.2, 1.0]]), torch.tensor([[1.5, 2.5]]), torch.ones(1, 2), clip_eps=math.inf
    )
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * (0.25 + 0.25) / 2)
    assert values.grad is not None
    assert_close(values.grad, [[-0.25, -0.25]])
    assert metrics["value_clip_fraction"] == 0.0


def test_value_loss_sequence_aggregation() -> None:
    # Row means of the squared errors: row 0 (1 + 9) / 2 = 5, row 1: 4; mean 4.5, halved 2.25.
    values = torch.tensor([[1.0, 3.0], [2.0, 0.0]])
    loss, _ = clipped_value_loss(
        values, values, torch.zeros(2, 2), torch.tensor([[1.0, 1.0], [1.0, 0.0]]), clip_eps=math.inf,
        aggregation="seq-mean-token-mean",
    )
    assert loss.item() == pytest.approx(2.25)
