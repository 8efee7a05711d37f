"""What the pretraining scripts of the shipped small models share: batches and the training loop.

Supervised next-token training with the loss on the response only (a prompt's operands are
random and cannot be predicted), stopped early, as soon as a check the task supplies reaches a
target, so RL starts from a model that is right only part of the time. Seeded end to end: the
same arguments give the same weights on the same machine.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

import torch

__all__ = ["BatchStream", "Example", "train_until"]

Example = tuple[list[int], list[int]]  # (prompt ids, response ids ending in the stop token)


class BatchStream:
    """An endless, seeded stream of (input_ids, attention_mask, labels) training batches of the
    examples ``sample(rng)`` draws.

    Sorting a pool of several batches by length before cutting it keeps the rare long examples
    together, so short sequences are not padded to the long tail's length.
    """

    POOL_BATCHES = 8

    def __init__(self, sample: Callable[[random.Random], Example], pad_id: int, batch_size: int, rng: random.Random) -> None:
        self._sample = sample
        self._pad_id = pad_id
        self._batch_size = batch_size
        self._rng = rng
        self._ready: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self._ready:
            self._refill()
        return self._ready.pop()

    def _refill(self) -> None:
        examples = [self._sample(self._rng) for _ in range(self._batch_size * self.POOL_BATCHES)]
        examples.sort(key=lambda e: len(e[0]) + len(e[1]))
        batches = [self._collate(examples[i : i + self._batch_size]) for i in range(0, len(examples), self._batch_size)]
        self._rng.shuffle(batches)
        self._ready = batches

    def _collate(self, examples: Sequence[Example]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        width = max(len(p) + len(r) for p, r in examples)
        input_ids = torch.full((len(examples), width), self._pad_id)
        attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
        labels = torch.full((len(examples), width), -100)  # -100 is ignored by the loss
        for row, (prompt_ids, response_ids) in enumerate(examples):
            ids = prompt_ids + response_ids
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention_mask[row, : len(ids)] = 1
            labels[row, len(prompt_ids) : len(ids)] = torch.tensor(response_ids)
        return input_ids, attention_mask, labels


def train_until(
    model: torch.nn.Module,
    batches: BatchStream,
    check: Callable[[int], tuple[float, str]],
    *,
    lr: float,
    warmup_steps: int,
    max_steps: int,
    eval_every: int,
    target: float,
) -> int:
    """Train ``model`` until ``check(step)`` (its accuracy, and a line to print) reaches
    ``target`` or ``max_steps`` are done; the steps taken."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    # Linear warm-up, then constant: where training stops is decided by accuracy, not a schedule.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup_steps))
    started = time.perf_counter()
    accuracy, step = 0.0, 0
    while step < max_steps and accuracy < target:
        input_ids, attention_mask, labels = next(batches)
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % eval_every == 0:
            accuracy, line = check(step)
            print(f"step {step:5d}  loss {loss.item():.4f}  {line}  {time.perf_counter() - started:.0f}s", flush=True)
    return step
