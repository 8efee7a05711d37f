"""The policy objective the train role hands a train engine: the configured loss, ready to call.

Owns the one decision that joins the algorithm to an engine's micro-batching: a loss that is a
token mean must be weighted by each micro-batch's share of the step's tokens, a sequence mean
by its share of the step's sequences, for the accumulated gradient to equal the whole step's
(``mean_over``). Engines call the objective on each micro-batch's
:class:`~algorithms.batch.LossInputs` and know nothing else of the algorithm.

Torch-free at import (the train role builds an objective for every engine, fakes included);
the torch losses are imported on the first call. Picklable, so data-parallel ranks in other
processes receive it with each step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from algorithms.batch import LossInputs
    from algorithms.losses import LossSettings

__all__ = ["LossMeanOver", "PolicyObjective"]

# What a loss averages over inside a micro-batch: "tokens" for a token mean, "sequences" for a
# mean over sequences (of per-sequence token means or sums).
LossMeanOver = Literal["tokens", "sequences"]


@dataclass(frozen=True, slots=True)
class PolicyObjective:
    """``objective(inputs) -> (loss, metrics)``: the configured policy loss (plus KL) of one
    micro-batch, a mean over ``mean_over``; see :func:`algorithms.losses.compute_policy_loss`."""

    settings: LossSettings

    @property
    def mean_over(self) -> LossMeanOver:
        return "tokens" if self.settings.aggregation == "token-mean" else "sequences"

    def __call__(self, inputs: LossInputs) -> tuple[Any, dict[str, float]]:
        from algorithms.losses import compute_policy_loss  # torch, on first use only

        return compute_policy_loss(inputs, self.settings)
