"""The token-aligned tensors a policy loss sees: the contract between train engines and losses.

Every tensor is ``[rows, tokens]`` over response tokens only, right-padded, with ``mask`` 1.0
on real tokens and 0.0 on padding. Engines build it (packing or padding as they like); loss
functions are pure functions of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "LossInputs",
]

@dataclass(slots=True)
class LossInputs:
    """Inputs of one micro-batch to a policy loss.

    ``logprobs`` carries the gradient; every other tensor is detached data. ``prox_logprobs``
    (decoupled PPO's proximal policy) and ``ref_logprobs`` (KL reference) are ``None`` when
    the flow does not compute them; losses that need them must refuse ``None`` loudly.
    """

    logprobs: torch.Tensor  # current policy, requires grad
    behaviour_logprobs: torch.Tensor  # the rollout engine's, at sampling time
    advantages: torch.Tensor  # per-sample advantage broadcast over its tokens
    mask: torch.Tensor  # 1.0 real response token, 0.0 padding
    prox_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None  # per-token entropy of the current policy, detached
    # Per-action KL(pi_theta || pi_ref) computed exactly by the engine, with gradient through
    # pi_theta: the loss's KL term when ``kl_estimator == "exact"``. An image engine fills it with
    # the closed form between two Gaussian transitions (``algorithms.flow_grpo.transition_kl``),
    # which needs the reference's transition mean, not a log-prob of the sampled action.
    kl: torch.Tensor | None = None
    # 1.0 on trained tokens sampled by the very weights ``logprobs`` come from (the trainer's
    # version): there ``behaviour_logprobs - logprobs`` is the engines' numerical mismatch alone
    # (``algorithms.corrections.mismatch_metrics``). None: the engine does not say.
    fresh: torch.Tensor | None = None
    # Where ``logprobs`` stand in version time, for log-linear proximal log-probs
    # (``algorithms.prox``): the policy version that sampled each token (-1 on padding), the
    # version the train step started from (pi_prox's) and that of the weights ``logprobs`` come
    # from: the step's version plus the share of its optimizer steps already taken (a train step
    # is one version however many optimizer steps it takes). None: the engine does not say.
    versions: torch.Tensor | None = None
    prox_version: int | None = None
    current_version: float | None = None
