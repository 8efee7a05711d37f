"""The objectives the train and critic roles hand their engines: the configured loss, ready to call.

Owns the one decision that joins the algorithm to an engine's micro-batching: a loss that is a
token mean must be weighted by each micro-batch's share of the step's tokens, a sequence mean
by its share of the step's sequences, for the accumulated gradient to equal the whole step's
(``mean_over``). Engines call the objective on each micro-batch's inputs and know nothing else
of the algorithm.

It also owns where decoupled PPO's proximal log-probs come from (``ProximalSource``), pi_prox
being the policy at the start of the train step for every optimizer step of it:
``recompute`` reads the ones the flow recomputed (``LossInputs.prox_logprobs``); ``loglinear``
interpolates between the behaviour log-probs and the micro-batch's own forward pass by version
distance (``algorithms.prox``, from ``LossInputs.versions``, ``prox_version`` and
``current_version``), exact at the train step's first optimizer step, where the forward runs on
pi_prox; ``current`` takes the step's own forward pass, detached, which is exact only where a
train step is one optimizer step (AReaL's log-linear approximation with ``v_current = v_prox``,
whose interpolation weight is then 1 for every token; the config refuses it with mini-batches
or epochs); ``behaviour`` takes the rollout engine's log-probs (the behaviour weight is then 1:
naive PPO anchored at pi_behav).

Torch-free at import (the roles build objectives for every engine, fakes included); the torch
losses are imported on the first call. Picklable, so data-parallel ranks in other processes
receive them with each step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from tandem.algorithms.batch import LossInputs
    from tandem.algorithms.gae import ValueInputs
    from tandem.algorithms.losses import LossSettings

__all__ = ["PROXIMAL_SOURCES", "LossMeanOver", "PolicyObjective", "ProximalSource", "ValueObjective"]

# What a loss averages over inside a micro-batch: "tokens" for a token mean, "sequences" for a
# mean over sequences (of per-sequence token means or sums).
LossMeanOver = Literal["tokens", "sequences"]
ProximalSource = Literal["recompute", "loglinear", "current", "behaviour"]
PROXIMAL_SOURCES: tuple[str, ...] = ("recompute", "loglinear", "current", "behaviour")


def _mean_over(aggregation: str) -> LossMeanOver:
    return "tokens" if aggregation == "token-mean" else "sequences"


@dataclass(frozen=True, slots=True)
class PolicyObjective:
    """``objective(inputs) -> (loss, metrics)``: the configured policy loss (plus KL) of one
    micro-batch, a mean over ``mean_over``; see :func:`algorithms.losses.compute_policy_loss`.
    ``proximal`` says where a decoupled loss's pi_prox comes from (see the module docstring)."""

    settings: LossSettings
    proximal: ProximalSource = "recompute"

    def __post_init__(self) -> None:
        if self.proximal not in PROXIMAL_SOURCES:
            raise ValueError(f"unknown proximal source {self.proximal!r}; allowed: {list(PROXIMAL_SOURCES)}")

    @property
    def mean_over(self) -> LossMeanOver:
        return _mean_over(self.settings.aggregation)

    def __call__(self, inputs: LossInputs) -> tuple[Any, dict[str, float]]:
        from tandem.algorithms.losses import compute_policy_loss  # torch, on first use only

        if self.settings.decoupled and self.proximal == "loglinear":
            inputs = replace(inputs, prox_logprobs=_loglinear(inputs))
        elif self.settings.decoupled and self.proximal == "current":
            inputs = replace(inputs, prox_logprobs=inputs.logprobs.detach())
        elif self.settings.decoupled and self.proximal == "behaviour":
            inputs = replace(inputs, prox_logprobs=inputs.behaviour_logprobs.detach())
        return compute_policy_loss(inputs, self.settings)


@dataclass(frozen=True, slots=True)
class ValueObjective:
    """``objective(inputs) -> (loss, metrics)``: the critic's clipped value loss of one
    micro-batch (:func:`algorithms.gae.clipped_value_loss`), a mean over ``mean_over``."""

    clip_eps: float
    aggregation: str = "token-mean"

    @property
    def mean_over(self) -> LossMeanOver:
        return _mean_over(self.aggregation)

    def __call__(self, inputs: ValueInputs) -> tuple[Any, dict[str, float]]:
        from tandem.algorithms.gae import clipped_value_loss  # torch, on first use only

        return clipped_value_loss(
            inputs.values, inputs.old_values, inputs.returns, inputs.mask,
            clip_eps=self.clip_eps, aggregation=self.aggregation,
        )


def _loglinear(inputs: LossInputs) -> Any:
    """``proximal: loglinear``'s pi_prox for one micro-batch; refused without the versions it reads."""
    from tandem.algorithms.prox import loglinear_prox_logprobs

    if inputs.versions is None or inputs.prox_version is None or inputs.current_version is None:
        raise ValueError("proximal=loglinear needs the engine to give each token's version and the step's (LossInputs.versions)")
    return loglinear_prox_logprobs(
        inputs.behaviour_logprobs, inputs.logprobs, inputs.versions, inputs.mask,
        prox_version=inputs.prox_version, current_version=inputs.current_version,
    )
