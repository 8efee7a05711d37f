"""Token-budget micro-batches of token trajectories and the per-token log-probs of their responses.

What it owns: how a list of token trajectories (``TokenPayload``: text, and multi-turn episodes
whose environment tokens are masked out of the loss) becomes padded forward passes, and how
each response token's log-prob and entropy are read back out of the logits. Pure functions of
their inputs; the engines in ``engines/trainers/torch_train.py`` decide threads, grads and optimizers.

Invariants:
- samples are sorted longest first and packed greedily so that ``rows * longest`` (the padded
  tokens a forward pays for) stays within ``max_tokens``; a sample longer than the budget
  gets a micro-batch of its own rather than being split;
- sequences are right-padded (prompt then response, positions ``0..len-1``), so every real
  token sees exactly the context the rollout engine gave it;
- log-probs are ``log_softmax(logits / temperature)`` at the positions that predicted each
  response token, in float32, ``[rows, longest response]`` and aligned with ``response_ids``;
- ``mask`` is 1.0 on every real response token (all are scored), ``loss_mask`` only on those
  the loss trains (a trajectory's ``loss_mask``; all of them when it has none).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.core.records import TokenPayload, Trajectory

__all__ = ["MicroBatch", "collate", "plan_micro_batches", "response_logprobs", "token_payload"]


def plan_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group indices into micro-batches whose padded size ``rows * longest`` fits ``max_tokens``."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    plan: list[list[int]] = []
    for i in order:
        # Longest first: the first index of the open micro-batch is its longest row.
        if plan and (len(plan[-1]) + 1) * lengths[plan[-1][0]] <= max_tokens:
            plan[-1].append(i)
        else:
            plan.append([i])
    return plan


@dataclass(slots=True)
class MicroBatch:
    """One padded forward pass over some samples.

    ``gather_index`` [rows, R] indexes the kept logits (the last ``logits_to_keep`` positions)
    at the position predicting each response token; ``mask`` [rows, R] is 1.0 on real tokens,
    ``loss_mask`` [rows, R] on the real tokens that are trained.
    """

    indices: list[int]  # positions of the rows in the caller's sample list
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    logits_to_keep: int
    gather_index: torch.Tensor
    response_ids: torch.Tensor
    mask: torch.Tensor
    loss_mask: torch.Tensor
    versions: torch.Tensor  # [rows, R] the policy version of each response token, -1 on padding

    @property
    def num_tokens(self) -> int:
        """Trained tokens: what a token-mean loss divides by."""
        return int(self.loss_mask.sum().item())


def token_payload(trajectory: Trajectory) -> TokenPayload:
    """The trajectory's tokens; an error names it if it is not a token trajectory."""
    payload = trajectory.payload
    if not isinstance(payload, TokenPayload):
        raise TypeError(
            f"prompt {trajectory.prompt_id} trajectory {trajectory.index}: the torch text engines train token "
            f"trajectories, got a {type(payload).__name__} payload"
        )
    return payload


def collate(trajectories: Sequence[Trajectory], indices: list[int], device: torch.device) -> MicroBatch:
    """Right-pad ``trajectories[indices]`` (prompt + response) into one micro-batch."""
    rows = [token_payload(trajectories[i]) for i in indices]
    prompt_lens = [len(s.prompt_ids) for s in rows]
    response_lens = [len(s.response_ids) for s in rows]
    length = max(p + r for p, r in zip(prompt_lens, response_lens, strict=True))
    longest_response = max(response_lens)
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), length, dtype=torch.long)
    response_ids = torch.zeros(len(rows), longest_response, dtype=torch.long)
    mask = torch.zeros(len(rows), longest_response)
    loss_mask = torch.zeros(len(rows), longest_response)
    versions = torch.full((len(rows), longest_response), -1, dtype=torch.long)
    for b, (i, s) in enumerate(zip(indices, rows, strict=True)):
        tokens = [*s.prompt_ids, *s.response_ids]
        input_ids[b, : len(tokens)] = torch.tensor(tokens)
        attention_mask[b, : len(tokens)] = 1
        response_ids[b, : len(s.response_ids)] = torch.tensor(s.response_ids, dtype=torch.long)
        mask[b, : len(s.response_ids)] = 1.0
        versions[b, : len(trajectories[i].versions)] = torch.tensor(trajectories[i].versions, dtype=torch.long)
        trained = trajectories[i].loss_mask
        if trained is None:
            loss_mask[b, : len(s.response_ids)] = 1.0
        else:
            loss_mask[b, : len(trained)] = torch.tensor(trained, dtype=torch.float32)
    # Only positions from the shortest prompt's last token on predict response tokens: keep
    # those logits, not the whole [rows, length, vocab] block.
    first = min(prompt_lens) - 1
    keep = length - first
    offsets = torch.tensor(prompt_lens).unsqueeze(1) - 1 - first
    gather_index = (offsets + torch.arange(longest_response)).clamp(max=keep - 1)
    return MicroBatch(
        indices=indices,
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        logits_to_keep=keep,
        gather_index=gather_index.to(device),
        response_ids=response_ids.to(device),
        mask=mask.to(device),
        loss_mask=loss_mask.to(device),
        versions=versions.to(device),
    )


def response_logprobs(
    model: torch.nn.Module, batch: MicroBatch, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs [rows, R] of the response tokens (with grad if enabled) and their entropy (detached)."""
    logits = model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=batch.logits_to_keep
    ).logits
    vocab = logits.shape[-1]
    index = batch.gather_index.unsqueeze(-1).expand(-1, -1, vocab)
    logp = torch.log_softmax(logits.float().gather(1, index) / temperature, dim=-1)
    token_logp = logp.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1) * batch.mask
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1) * batch.mask
    return token_logp, entropy
