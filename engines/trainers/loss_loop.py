"""The one micro-batch loss loop every token trainer runs: plain torch (and its DDP ranks), FSDP2
and megatron-core ranks.

An optimizer step's gradient is the sum over micro-batches of each micro-batch's loss weighted by
its share of the whole optimizer step's trained tokens or sequences (:class:`StepTotals`), so
however the step is cut (into micro-batches, across ranks) the gradient is the one-batch gradient.
(A train step takes one optimizer step per mini-batch of its plan: ``engines.trainers.optimizer_steps``.) Each trainer
supplies only its ``forward`` (per-token log-probs and entropies of a micro-batch at its current
weights) and the version those weights are; what the objective sees of a micro-batch
(:func:`loss_inputs`: behaviour, proximal and reference log-probs, per-sequence or per-token
advantages, the fresh-token mask) is built here once, so a feature added here (per-token
advantages for GAE today) works for every trainer.

Invariants:
- a step's trajectories agree on which optional fields they carry (:func:`check_trainable`);
- the weights of an optimizer step's micro-batch losses sum to one over the whole optimizer step
  (every rank);
- with ``passes`` set, exactly that many forwards and backwards run whatever happens (a rank in
  lockstep with others must join every collective): filler passes and the passes after an
  objective raised backward a zero, and the error is raised at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from tandem.algorithms.batch import LossInputs
from tandem.algorithms.metrics import accumulate_metrics
from tandem.algorithms.objective import LossMeanOver
from tandem.core.protocols import LossObjective
from tandem.core.records import FinishReason, Trajectory, token_trajectory
from tandem.engines.shared.microbatch import MicroBatch, collate, plan_micro_batches, token_payload

__all__ = [
    "Forward",
    "StepTotals",
    "accumulate",
    "check_trainable",
    "loss_inputs",
    "micro_batch_plan",
    "padded",
    "score",
]

# A trainer's forward: (per-token log-probs, per-token entropies) of a micro-batch's responses.
Forward = Callable[[MicroBatch], tuple[torch.Tensor, torch.Tensor]]
# A one-token row: what a rank in lockstep forwards when it has no micro-batch left.
_FILLER = token_trajectory(-1, 0, [0], [0], [0.0], [0], FinishReason.LENGTH)


@dataclass(frozen=True, slots=True)
class StepTotals:
    """The whole optimizer step's trained tokens and sequences (over every rank): the denominators
    of the micro-batch loss weights, so the weighted sum of micro-batch losses is the optimizer
    step's mean. A sequence counts when it has at least one trained token."""

    mean_over: LossMeanOver
    tokens: int
    sequences: int

    @classmethod
    def of(cls, samples: Sequence[Trajectory], mean_over: LossMeanOver) -> StepTotals:
        trained = [s for s in samples if s.num_trained > 0]
        return cls(mean_over, sum(s.num_trained for s in trained), len(trained))

    def weight(self, batch: MicroBatch) -> float:
        if self.mean_over == "tokens":
            return batch.num_tokens / self.tokens
        return len(batch.indices) / self.sequences


def check_trainable(samples: Sequence[Trajectory]) -> None:
    """Raise ``ValueError`` naming the trajectory and field unless ``samples`` can be trained on
    as one step: each has an advantage and per-token fields of its own length, and the optional
    fields are present on all of them or on none."""
    if not samples:
        raise ValueError("train_step on no trajectories")
    for field in ("prox_logprobs", "ref_logprobs", "token_advantages"):
        present = {getattr(s, field) is not None for s in samples}
        if len(present) > 1:
            raise ValueError(f"{field} is set on some trajectories and not on others")
    for s in samples:
        where = f"trajectory {s.prompt_id}/{s.index}"
        if s.advantage is None and s.token_advantages is None:
            raise ValueError(f"{where} has no advantage")
        for name in ("behaviour_logprobs", "prox_logprobs", "ref_logprobs", "loss_mask", "token_advantages"):
            values = getattr(s, name)
            if values is not None and len(values) != s.num_actions:
                raise ValueError(f"{where}: {len(values)} {name} for {s.num_actions} tokens")
        if len(token_payload(s).response_ids) != s.num_actions:
            raise ValueError(f"{where}: {len(token_payload(s).response_ids)} tokens for {s.num_actions} log-probs")


def padded(rows: Sequence[Sequence[float] | None], mask: torch.Tensor) -> torch.Tensor:
    """Right-pad per-token values to ``mask``'s shape with zeros, on ``mask``'s device (every row
    present: :func:`check_trainable` made sure)."""
    out = torch.zeros(mask.shape, dtype=torch.float32)
    for b, values in enumerate(rows):
        assert values is not None
        out[b, : len(values)] = torch.tensor(values, dtype=torch.float32)
    return out.to(mask.device)


def micro_batch_plan(samples: Sequence[Trajectory], max_tokens: int) -> list[list[int]]:
    """The micro-batches of ``samples``' trajectories with actions, as indices into ``samples``
    (``plan_micro_batches`` over prompt + response lengths); one without actions has nothing to
    forward and rides in none."""
    acting = [i for i, s in enumerate(samples) if s.num_actions > 0]
    lengths = [len(token_payload(samples[i]).prompt_ids) + samples[i].num_actions for i in acting]
    return [[acting[j] for j in group] for group in plan_micro_batches(lengths, max_tokens)]


def _passes(samples: Sequence[Trajectory], max_tokens: int, device: torch.device, passes: int) -> Iterator[MicroBatch | None]:
    """The micro-batches, then ``None`` (a filler pass) until ``passes`` passes were made."""
    plan = micro_batch_plan(samples, max_tokens)
    for indices in plan:
        yield collate(samples, indices, device)
    for _ in range(passes - len(plan)):
        yield None


def score(
    samples: Sequence[Trajectory], forward: Forward, *, max_tokens: int, device: torch.device, passes: int = 0
) -> tuple[list[list[float]], list[list[float]]]:
    """Per-token log-probs and entropies of ``samples`` (empty for a trajectory without actions);
    ``passes > 0`` pads with filler forwards to that many (lockstep engines)."""
    logprobs: list[list[float]] = [[] for _ in samples]
    entropies: list[list[float]] = [[] for _ in samples]
    with torch.no_grad():
        for batch in _passes(samples, max_tokens, device, passes):
            token_logp, entropy = forward(batch if batch is not None else collate([_FILLER], [0], device))
            if batch is None:
                continue
            for row, i in enumerate(batch.indices):
                n = samples[i].num_actions
                logprobs[i] = token_logp[row, :n].tolist()
                entropies[i] = entropy[row, :n].tolist()
    return logprobs, entropies


def loss_inputs(
    samples: Sequence[Trajectory],
    batch: MicroBatch,
    token_logp: torch.Tensor,
    entropy: torch.Tensor,
    version: int,
    progress: float = 0.0,
) -> LossInputs:
    """The objective's view of one micro-batch; ``version`` is the train step's (pi_prox's) and
    ``progress`` the share of its optimizer steps taken before this one, so the weights
    ``token_logp`` came from stand at ``version + progress``. Only at the first optimizer step are
    they a version's: tokens sampled at it are then *fresh* (the mismatch metrics compare only
    those); later, none is."""
    rows = [samples[i] for i in batch.indices]
    trained = batch.loss_mask
    if rows[0].token_advantages is not None:  # per action (GAE), else one per trajectory
        advantages = padded([s.token_advantages for s in rows], trained) * trained
    else:
        advantages = torch.tensor([[s.advantage] for s in rows], device=trained.device) * trained
    return LossInputs(
        logprobs=token_logp,
        behaviour_logprobs=padded([s.behaviour_logprobs for s in rows], trained),
        advantages=advantages,
        mask=trained,
        prox_logprobs=padded([s.prox_logprobs for s in rows], trained) if rows[0].prox_logprobs is not None else None,
        ref_logprobs=padded([s.ref_logprobs for s in rows], trained) if rows[0].ref_logprobs is not None else None,
        entropy=entropy,
        fresh=(batch.versions == version).to(trained.dtype) * trained if progress == 0 else None,
        versions=batch.versions,
        prox_version=version,
        current_version=version + progress,
    )


def accumulate(
    samples: Sequence[Trajectory],
    forward: Forward,
    objective: LossObjective,
    totals: StepTotals,
    *,
    max_tokens: int,
    device: torch.device,
    version: int,
    progress: float = 0.0,
    passes: int = 0,
) -> tuple[dict[str, float], int]:
    """Backward each micro-batch's loss weighted by its share of the optimizer step (``totals``),
    adding to the gradients (not zeroed here); returns the weighted metric sums and the number of
    real micro-batches. ``version`` and ``progress`` say where the weights stand
    (:func:`loss_inputs`). Filler passes (``passes``) backward a zero: they add nothing but take
    part in the collectives of a lockstep engine.

    An objective that raises does not cut the passes short (the other ranks would wait in a
    collective for this one): its pass and the rest backward zeros, then the error is raised.
    """
    sums: dict[str, float] = {}
    micro_batches = 0
    failure: Exception | None = None
    for batch in _passes(samples, max_tokens, device, passes):
        token_logp, entropy = forward(batch if batch is not None else collate([_FILLER], [0], device))
        if batch is None or failure is not None:
            (token_logp.sum() * 0.0).backward()
            continue
        try:
            loss, metrics = objective(loss_inputs(samples, batch, token_logp, entropy, version, progress))
        except Exception as exc:
            failure = exc
            (token_logp.sum() * 0.0).backward()
            continue
        weight = totals.weight(batch)
        (loss * weight).backward()
        micro_batches += 1
        trained = batch.loss_mask
        mean_entropy = float((entropy * trained).sum() / trained.sum().clamp(min=1))
        accumulate_metrics(sums, {**metrics, "loss": float(loss.detach()), "entropy": mean_entropy}, weight)
    if failure is not None:
        raise failure
    return sums, micro_batches
