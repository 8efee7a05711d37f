"""Per-token response log-probs from a megatron-core ``GPTModel``, the quantity ``engines.shared.microbatch`` computes.

What it owns: one forward of a (tensor-parallel) ``GPTModel`` over a right-padded batch of
prompt + response rows (:class:`ResponseBatch`: ``engines.shared.microbatch.MicroBatch`` is one),
and the log-prob and entropy of each response token read from its vocabulary-parallel logits.

Invariants:
- the result is ``engines.shared.microbatch.response_logprobs``'s: ``log_softmax(logits.float() /
  temperature)`` at the position that predicted each response token, float32, ``[rows, R]``,
  aligned with ``batch.response_ids`` and zero past each row's response; the entropy is detached;
- rows are right-padded: positions are ``0..length-1`` in every row, and the attention mask hides
  the future and the padding (under right padding causality alone already hides the padding from
  every real token, so real tokens see exactly what the HF model gives them);
- with tensor parallel size ``T`` each rank holds ``vocab / T`` logits per position and no rank
  gathers the full vocabulary: the normaliser is all-reduced over the tensor-parallel group
  (megatron's ``vocab_parallel_cross_entropy``), so every rank of the group must call this with
  the same batch, and every rank returns the same values;
- gradients flow to this rank's shard of the weights as megatron's tensor-parallel layers define
  them: after ``backward`` on every rank, the shards' gradients are those of the whole model.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

__all__ = ["ResponseBatch", "attention_mask", "response_logprobs"]


class ResponseBatch(Protocol):
    """Right-padded rows, as ``engines.shared.microbatch.collate`` builds them.

    ``input_ids``/``attention_mask`` [rows, length] (mask 1 on real tokens); ``gather_index``
    [rows, R] the position predicting each response token, counted from position
    ``length - logits_to_keep``; ``response_ids``/``mask`` [rows, R] (mask 1.0 on real tokens).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    logits_to_keep: int
    gather_index: torch.Tensor
    response_ids: torch.Tensor
    mask: torch.Tensor


def attention_mask(padding_mask: torch.Tensor) -> torch.Tensor:
    """megatron's boolean mask [rows, 1, length, length], True where a query may not attend a key:
    later keys and padding keys. ``padding_mask`` [rows, length] is 1 on real tokens."""
    length = padding_mask.shape[1]
    future = torch.triu(torch.ones(length, length, dtype=torch.bool, device=padding_mask.device), diagonal=1)
    padding = ~padding_mask.bool()[:, None, None, :]
    return future[None, None] | padding


def _vocab_parallel_entropy(scaled: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Entropy of ``softmax(scaled)`` over the whole vocabulary, ``scaled`` holding this rank's slice.

    H = log Z - Σ p z, with the max, Z and Σ e^(z-max) z all-reduced over the vocabulary shards.
    """
    peak = scaled.max(dim=-1).values
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    shifted = scaled - peak.unsqueeze(-1)
    exp = shifted.exp()
    sums = torch.stack([exp.sum(-1), (exp * shifted).sum(-1)])
    dist.all_reduce(sums, group=group)
    normaliser, weighted = sums
    return normaliser.log() - weighted / normaliser


def response_logprobs(model: GPTModel, batch: ResponseBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs [rows, R] of the response tokens (with grad if enabled) and their entropy (detached)."""
    rows, length = batch.input_ids.shape
    position_ids = torch.arange(length, device=batch.input_ids.device).expand(rows, -1)
    logits = model(batch.input_ids, position_ids, attention_mask(batch.attention_mask))  # [rows, length, vocab / T]
    # ``gather_index`` counts from the first kept position; megatron's forward keeps every position.
    positions = batch.gather_index + (length - batch.logits_to_keep)
    picked = logits.gather(1, positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    scaled = picked.float() / temperature
    with torch.no_grad():
        entropy = _vocab_parallel_entropy(scaled, parallel_state.get_tensor_model_parallel_group()) * batch.mask
    # Last use of ``scaled``: megatron's cross entropy overwrites its input with the softmax.
    token_logp = -vocab_parallel_cross_entropy(scaled, batch.response_ids) * batch.mask
    return token_logp, entropy
