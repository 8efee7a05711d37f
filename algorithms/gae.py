"""Generalized advantage estimation and PPO's clipped value loss, for a critic.

Owns the map from per-token rewards and a critic's values to per-token advantages and returns
(Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
Estimation"), and the critic's loss against those returns with PPO's value clipping (the
``cliprange_value`` of OpenAI baselines' ppo2; verl's ``compute_value_loss``, AReaL's
``ppo_critic_loss_fn``).

Time counts actions: the steps of the recursion are the positions with ``mask == 1`` (the
response tokens). Positions with ``mask == 0`` are skipped, neither discounted nor
bootstrapped through: padding, and in multi-turn episodes the environment's tokens between two
turns, so the last action before an environment turn bootstraps from the value of the first
action after it (verl's ``compute_gae_advantage_return`` does the same).

Also :func:`whiten`, the batch normalisation of advantages verl applies to GAE's
(``masked_whiten`` in ``compute_gae_advantage_return``), and :class:`ValueInputs`, the tensors a
critic engine hands the value objective (``algorithms.objective.ValueObjective``).

Invariants: pure, no gradient (advantages and returns are targets, computed under no_grad);
masked positions get advantage 0 and return 0; a non-zero reward at a masked position raises
ValueError rather than being dropped (rewards belong to actions); values at masked positions
are never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.algorithms.losses import aggregate_loss

__all__ = ["ValueInputs", "clipped_value_loss", "gae_advantages", "outcome_token_rewards", "whiten"]


@dataclass(slots=True)
class ValueInputs:
    """One micro-batch of a critic's training, ``[rows, actions]`` each: ``values`` carries the
    gradient, ``old_values`` (what the returns were computed with), ``returns`` and ``mask`` (1 on
    trained actions) are data."""

    values: torch.Tensor
    old_values: torch.Tensor
    returns: torch.Tensor
    mask: torch.Tensor


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 2:
        raise ValueError(f"expected [rows, tokens] tensors of one shape, got {shapes}")


@torch.no_grad()
def gae_advantages(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)``, each ``[rows, tokens]``, by GAE(gamma, lambda).

    Over the actions ``t`` of a row (the positions with ``mask == 1``, in order), with ``t+1``
    the next action and ``V = 0`` after the last one: ``delta_t = r_t + gamma V_{t+1} - V_t``,
    ``A_t = delta_t + gamma lam A_{t+1}``, ``R_t = A_t + V_t`` (the critic's target). ``lam = 1``
    gives the Monte-Carlo return minus the value, ``lam = 0`` the one-step TD error.
    """
    _check_same_shape(rewards=rewards, values=values, mask=mask)
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must lie in [0, 1], got gamma={gamma}, lam={lam}")
    act = mask > 0
    if bool((~act & (rewards != 0)).any()):
        raise ValueError("a non-zero reward sits at a masked position; rewards belong to actions (mask == 1)")
    rewards = torch.where(act, rewards, 0.0)
    values = torch.where(act, values, 0.0)
    advantages = torch.zeros_like(values)
    next_value = values.new_zeros(values.shape[0])
    next_advantage = values.new_zeros(values.shape[0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        # A masked position passes its successor's value and advantage through unchanged.
        next_value = torch.where(act[:, t], values[:, t], next_value)
        next_advantage = torch.where(act[:, t], advantage, next_advantage)
        advantages[:, t] = torch.where(act[:, t], advantage, 0.0)
    return advantages, torch.where(act, advantages + values, 0.0)


@torch.no_grad()
def whiten(advantages: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Advantages shifted and scaled to mean 0 and (unbiased) std 1 over the ``mask > 0``
    positions, 0 elsewhere (verl's ``masked_whiten``); with one position, or equal values, the
    result is all zeros rather than a division by ~0."""
    _check_same_shape(advantages=advantages, mask=mask)
    real = mask > 0
    count = int(real.sum())
    if count < 2:
        return torch.zeros_like(advantages)
    values = advantages[real]
    centred = torch.where(real, advantages - values.mean(), 0.0)
    std = values.std()
    if float(std) == 0.0:
        return torch.zeros_like(advantages)
    return centred / (std + eps)


def outcome_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token rewards for GAE from one outcome score per row: the score on the row's last
    action (its last ``mask == 1`` position), 0 elsewhere; a row without actions must score 0."""
    if scores.dim() != 1 or mask.dim() != 2 or scores.shape[0] != mask.shape[0]:
        raise ValueError(f"expected scores [rows] and mask [rows, tokens], got {tuple(scores.shape)}, {tuple(mask.shape)}")
    act = mask > 0
    has_action = act.any(dim=-1)
    if bool((~has_action & (scores != 0)).any()):
        raise ValueError("a row without actions has a non-zero score")
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(act, positions, -1).max(dim=-1).values
    rewards = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    rows = has_action.nonzero().squeeze(-1)
    rewards[rows, last[rows]] = scores[rows]
    return rewards


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float,
    aggregation: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped value loss and its metrics.

    ``loss = 1/2 aggregate(max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2))`` with ``V``
    the critic's current values (carrying gradient), ``V_old`` those it had when the returns
    were computed and ``R`` the returns: a value may not buy a lower loss by moving more than
    ``eps`` from ``V_old``; where the clipped term is the larger, ``V`` gets no gradient.
    ``clip_eps = math.inf`` gives the plain squared error. Aggregation as in
    :func:`algorithms.losses.aggregate_loss` over ``mask > 0``.

    Metrics: ``value_loss``; ``value_clip_fraction`` (tokens where the clipped term won) and
    ``value_error_mean`` (mean ``|V - R|``), token means over real tokens.
    """
    _check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    if not clip_eps > 0:
        raise ValueError(f"clip_eps must be > 0, got {clip_eps}")
    real = mask > 0
    values = torch.where(real, values, 0.0)
    old_values = torch.where(real, old_values.detach(), 0.0)
    returns = torch.where(real, returns.detach(), 0.0)
    clipped_values = values.clamp(old_values - clip_eps, old_values + clip_eps)
    unclipped_loss = (values - returns).square()
    clipped_loss = (clipped_values - returns).square()
    loss = 0.5 * aggregate_loss(torch.maximum(unclipped_loss, clipped_loss), real, aggregation)
    num_real = real.sum().clamp(min=1)
    return loss, {
        "value_loss": loss.item(),
        "value_clip_fraction": float((real & (clipped_loss > unclipped_loss)).sum() / num_real),
        "value_error_mean": float(torch.where(real, (values - returns).abs(), 0.0).detach().sum() / num_real),
    }
