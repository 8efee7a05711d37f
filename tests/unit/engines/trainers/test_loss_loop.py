"""The one micro-batch loss loop (``engines.trainers.loss_loop``): what every trainer's step is made of.

Every trainer (plain torch and its DDP ranks, FSDP2 and megatron-core ranks) runs these passes;
their equality with one process is in ``test_fsdp.py``, ``test_megatron_engine.py`` and
``test_ddp.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_torch_train import make_batch, pg
from transformers import AutoModelForCausalLM

from tandem.core.records import Trajectory
from tandem.engines.shared.microbatch import MicroBatch, collate, response_logprobs
from tandem.engines.trainers.loss_loop import StepTotals, accumulate, check_trainable, loss_inputs, micro_batch_plan, score

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()


class CountingForward:
    """The model's response log-probs, counting the passes."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.calls = 0

    def __call__(self, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        return response_logprobs(self.model, batch, 1.0)


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_filler_passes_run_to_the_count_and_add_nothing(model: torch.nn.Module) -> None:
    samples = make_batch(0)
    totals = StepTotals.of(samples, "tokens")
    planned = len(micro_batch_plan(samples, 32))
    results = []
    for passes in (0, planned + 3):
        model.zero_grad(set_to_none=True)
        forward = CountingForward(model)
        sums, micro_batches = accumulate(
            samples, forward, pg_objective, totals, max_tokens=32, device=CPU, version=0, passes=passes
        )
        assert forward.calls == max(passes, planned) and micro_batches == planned
        scored = score(samples, forward, max_tokens=32, device=CPU, passes=passes)
        results.append((sums, gradients(model), scored))
    (sums, grads, scored), (padded_sums, padded_grads, padded_scored) = results
    assert padded_sums == sums and padded_scored == scored
    assert all(torch.equal(padded_grads[name], grads[name]) for name in grads)


def test_an_objective_that_raises_still_runs_every_pass_then_raises(model: torch.nn.Module) -> None:
    samples = make_batch(1)
    totals = StepTotals.of(samples, "tokens")
    calls = 0

    def second_call_raises(inputs: object) -> tuple[torch.Tensor, dict[str, float]]:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise ValueError("loss exploded")
        return pg(inputs)  # type: ignore[arg-type]

    second_call_raises.mean_over = "tokens"  # type: ignore[attr-defined]
    forward = CountingForward(model)
    with pytest.raises(ValueError, match="loss exploded"):
        accumulate(samples, forward, second_call_raises, totals, max_tokens=32, device=CPU, version=0, passes=9)  # type: ignore[arg-type]
    assert forward.calls == 9 and calls == 2  # the other ranks' collectives are met; no loss after the failure


def pg_objective(inputs: object) -> tuple[torch.Tensor, dict[str, float]]:
    return pg(inputs)  # type: ignore[arg-type]


pg_objective.mean_over = "tokens"  # type: ignore[attr-defined]


def test_per_token_advantages_reach_the_objective_token_by_token() -> None:
    samples = make_batch(2, groups=1, n=3)
    for s in samples:
        s.token_advantages = [float(10 * s.index + t) for t in range(s.num_actions)]
        s.advantage = None
    check_trainable(samples)
    batch = collate(samples, [0, 1, 2], CPU)
    zeros = torch.zeros(batch.loss_mask.shape)
    inputs = loss_inputs(samples, batch, zeros, zeros, version=0)
    for row, s in enumerate(samples):
        assert inputs.advantages[row, : s.num_actions].tolist() == s.token_advantages
        assert inputs.advantages[row, s.num_actions :].abs().sum() == 0  # padding is not trained


def test_per_sequence_advantages_are_spread_over_the_trained_tokens() -> None:
    samples = make_batch(3, groups=1, n=2)
    batch = collate(samples, [0, 1], CPU)
    zeros = torch.zeros(batch.loss_mask.shape)
    inputs = loss_inputs(samples, batch, zeros, zeros, version=0)
    for row, s in enumerate(samples):
        assert inputs.advantages[row, : s.num_actions].tolist() == [s.advantage] * s.num_actions


def test_a_step_mixing_per_token_and_per_sequence_advantages_is_refused() -> None:
    samples: list[Trajectory] = make_batch(4, groups=1, n=2)
    samples[0].token_advantages = [1.0] * samples[0].num_actions
    with pytest.raises(ValueError, match="token_advantages is set on some trajectories and not on others"):
        check_trainable(samples)
