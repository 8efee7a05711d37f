"""TorchTrainEngine / TorchLogProbEngine: micro-batched scoring, one version per call (an optimizer
step per mini-batch of its plan), checkpoints."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tiny_lm import save_tiny_model
from transformers import AutoModelForCausalLM

from tandem.algorithms import PolicyObjective, plan_mini_batches
from tandem.algorithms.batch import LossInputs
from tandem.algorithms.objective import LossMeanOver
from tandem.core.config import AlgorithmConfig
from tandem.core.protocols import (
    GenerationRequest,
    LogProbEngine,
    LossObjective,
    PartialTrainStep,
    SamplingParams,
    TrainEngine,
)
from tandem.core.records import FinishReason, Trajectory, token_trajectory
from tandem.engines.shared.microbatch import plan_micro_batches, response_logprobs
from tandem.engines.shared.threads import budgeted_executor
from tandem.engines.text.rollout import HFRolloutEngine
from tandem.engines.trainers.loss_loop import StepTotals, accumulate
from tandem.engines.trainers.torch_train import TorchLogProbEngine, TorchTrainEngine
from tests.unit.engines.weights_for_tests import push

LossFn = Callable[[LossInputs], tuple[torch.Tensor, dict[str, float]]]


@dataclass(frozen=True)
class Objective:
    """A loss function as a train step's objective: a mean over ``mean_over`` in each micro-batch."""

    fn: LossFn
    mean_over: LossMeanOver = "tokens"

    def __call__(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        return self.fn(inputs)


def pg(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """Plain policy gradient, token mean over the micro-batch."""
    loss = -(inputs.logprobs * inputs.advantages * inputs.mask).sum() / inputs.mask.sum()
    return loss, {"pg_loss": float(loss.detach())}


pg_loss = Objective(pg)


def make_batch(seed: int = 0, groups: int = 3, n: int = 4) -> list[Trajectory]:
    """Random token sequences of varied lengths with alternating-sign advantages, ``n`` per group."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(2, 20) for _ in range(rng.randint(2, 7))]
        for i in range(n):
            response = [rng.randrange(2, 20) for _ in range(rng.randint(1, 12))]
            trajectory = token_trajectory(g, i, prompt, response, [-1.0] * len(response), [0] * len(response),
                                          FinishReason.LENGTH)
            trajectory.advantage = 1.0 if i % 2 == 0 else -1.0
            out.append(trajectory)
    return out


@pytest.fixture
async def trainer(model_dir: Path) -> AsyncIterator[TorchTrainEngine]:
    async with TorchTrainEngine(str(model_dir), lr=1e-2, max_tokens_per_micro_batch=64) as eng:
        yield eng


def test_plan_micro_batches_respects_the_budget_longest_first() -> None:
    lengths = [5, 17, 3, 9, 9, 40, 2, 11]
    plan = plan_micro_batches(lengths, max_tokens=24)
    assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
    for mb in plan:
        longest = max(lengths[i] for i in mb)
        assert lengths[mb[0]] == longest
        assert len(mb) * longest <= 24 or len(mb) == 1  # an over-long sample rides alone
    assert [lengths[mb[0]] for mb in plan] == sorted((lengths[mb[0]] for mb in plan), reverse=True)
    assert plan[0] == [5]


def test_implements_protocols(trainer: TorchTrainEngine) -> None:
    assert isinstance(trainer, TrainEngine) and isinstance(trainer, LogProbEngine)


async def test_micro_batched_logprobs_equal_one_batch(model_dir: Path) -> None:
    samples = make_batch()
    async with (
        TorchLogProbEngine(str(model_dir), max_tokens_per_micro_batch=1) as alone,
        TorchLogProbEngine(str(model_dir), max_tokens_per_micro_batch=100_000) as together,
    ):
        lp_a, ent_a = await alone.logprobs_and_entropy(samples)
        lp_b, ent_b = await together.logprobs_and_entropy(samples)
    for s, a, b, ea, eb in zip(samples, lp_a, lp_b, ent_a, ent_b, strict=True):
        assert len(a) == len(b) == len(ea) == s.num_actions
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5
        assert max(abs(x - y) for x, y in zip(ea, eb, strict=True)) < 1e-5
        assert all(x < 0 for x in a) and all(0 < e < 3.0 for e in ea)  # entropy of 20 tokens <= ln 20


async def test_train_step_raises_logprobs_of_positive_advantage_tokens(trainer: TorchTrainEngine) -> None:
    samples = make_batch()
    before_weights = {n: p.detach().clone() for n, p in trainer.named_tensors_for_sync()}
    before = await trainer.logprobs(samples)
    metrics = await trainer.train_step(samples, pg_loss)
    after = await trainer.logprobs(samples)

    assert trainer.version == 1
    assert any(not torch.equal(before_weights[n], p) for n, p in trainer.named_tensors_for_sync())
    for s, b, a in zip(samples, before, after, strict=True):
        change = sum(a) - sum(b)
        assert change > 0 if s.advantage > 0 else change < 0
    assert metrics["tokens"] == sum(s.num_actions for s in samples)
    assert metrics["micro_batches"] > 1 and metrics["lr"] == pytest.approx(1e-2)
    assert metrics["loss"] == pytest.approx(metrics["pg_loss"])
    assert metrics["grad_norm"] > 0 and 0 < metrics["entropy"] < 3.0


async def capture_grads(
    trainer: TorchTrainEngine, batch: list[Trajectory], objective: LossObjective = pg_loss
) -> tuple[dict[str, torch.Tensor], float]:
    """The accumulated (pre-clip) gradient of one train step, read as it completes."""
    grads: dict[str, torch.Tensor] = {}
    handles = [
        p.register_post_accumulate_grad_hook(lambda p, name=name: grads.__setitem__(name, p.grad.clone()))
        for name, p in trainer.model.named_parameters()
    ]
    metrics = await trainer.train_step(batch, objective)
    for handle in handles:
        handle.remove()
    return grads, metrics["loss"]


@pytest.mark.parametrize(
    ("aggregation", "mean_over"),
    [("token-mean", "tokens"), ("seq-mean-token-mean", "sequences"), ("seq-mean-token-sum", "sequences")],
)
async def test_token_budget_micro_batches_give_the_one_batch_gradient(
    model_dir: Path, aggregation: str, mean_over: LossMeanOver
) -> None:
    batch = make_batch()
    objective = PolicyObjective(AlgorithmConfig(decoupled=False, aggregation=aggregation))
    assert objective.mean_over == mean_over
    async with (
        TorchTrainEngine(str(model_dir), lr=1e-2, max_tokens_per_micro_batch=16) as small,
        TorchTrainEngine(str(model_dir), lr=1e-2, max_tokens_per_micro_batch=100_000) as big,
    ):
        small_grads, small_loss = await capture_grads(small, batch, objective)
        big_grads, big_loss = await capture_grads(big, batch, objective)
    assert small_loss == pytest.approx(big_loss, abs=1e-6)
    for name, grad in big_grads.items():
        assert torch.allclose(small_grads[name], grad, atol=1e-5, rtol=0), name


async def test_state_dict_round_trip_restores_model_optimizer_schedule_and_version(model_dir: Path) -> None:
    groups = make_batch()
    async with TorchTrainEngine(str(model_dir), lr=1e-2, warmup_steps=3) as trainer:
        await trainer.train_step(groups, pg_loss)
        state = trainer.state_dict()
        second = await trainer.train_step(groups, pg_loss)
        after_second = {n: p.detach().clone() for n, p in trainer.named_tensors_for_sync()}

        trainer.load_state_dict(state)
        assert trainer.version == 1
        assert all(torch.equal(state["model"][n], p) for n, p in trainer.named_tensors_for_sync())
        replay = await trainer.train_step(groups, pg_loss)
        assert trainer.version == 2
        assert replay["lr"] == second["lr"] == pytest.approx(1e-2 * 2 / 3)
        for name, p in trainer.named_tensors_for_sync():
            assert torch.equal(p, after_second[name]), name  # same Adam moments, same update


async def test_linear_warmup_then_constant(model_dir: Path) -> None:
    async with TorchTrainEngine(str(model_dir), lr=0.1, warmup_steps=2) as trainer:
        lrs = [(await trainer.train_step(make_batch(), pg_loss))["lr"] for _ in range(3)]
    assert lrs == pytest.approx([0.05, 0.1, 0.1])


async def test_trainer_and_reference_see_the_losses_extra_inputs(trainer: TorchTrainEngine) -> None:
    groups = make_batch()
    for s in groups:
        s.prox_logprobs = [-2.0] * s.num_actions
        s.ref_logprobs = [-3.0] * s.num_actions
    seen: list[LossInputs] = []

    def spy(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        seen.append(inputs)
        return pg_loss(inputs)

    await trainer.train_step(groups, Objective(spy))
    for inputs in seen:
        mask = inputs.mask
        assert inputs.logprobs.requires_grad and not inputs.behaviour_logprobs.requires_grad
        assert inputs.prox_logprobs is not None and torch.equal(inputs.prox_logprobs, -2.0 * mask)
        assert inputs.ref_logprobs is not None and torch.equal(inputs.ref_logprobs, -3.0 * mask)
        assert torch.equal(inputs.behaviour_logprobs, -1.0 * mask)
        assert torch.equal(inputs.advantages.abs(), mask)
        assert inputs.entropy is not None and inputs.entropy.shape == mask.shape


async def test_train_step_refuses_incomplete_samples(trainer: TorchTrainEngine) -> None:
    batch = make_batch()
    batch[1].advantage = None
    with pytest.raises(ValueError, match="no advantage"):
        await trainer.train_step(batch, pg_loss)
    groups = make_batch()
    groups[0].prox_logprobs = [0.0] * groups[0].num_actions
    with pytest.raises(ValueError, match="some trajectories"):
        await trainer.train_step(groups, pg_loss)
    assert trainer.version == 0


@pytest.mark.parametrize("tied", [False, True])
async def test_synced_weights_make_rollout_and_trainer_agree(tmp_path: Path, tied: bool) -> None:
    model_dir = save_tiny_model(tmp_path, seed=0, eos=False, tied=tied)
    async with TorchTrainEngine(str(model_dir), lr=1e-2) as trainer, HFRolloutEngine(str(model_dir)) as rollout:
        await trainer.train_step(make_batch(), pg_loss)
        names = [name for name, _ in trainer.named_tensors_for_sync()]
        assert ("lm_head.weight" in names) is not tied  # a tied weight travels once
        await push(rollout.target, dict(trainer.named_tensors_for_sync()), trainer.version)
        request = GenerationRequest(0, 0, [3, 4, 12], SamplingParams(max_new_tokens=10))
        samples = [s async for s in rollout.generate([request])]
        [logprobs] = await trainer.logprobs(samples)
    assert samples[0].versions == [1] * 10
    assert max(abs(a - b) for a, b in zip(samples[0].behaviour_logprobs, logprobs, strict=True)) < 1e-4


# ---------------------------------------------------------------- mini-batches and epochs


def plan(batch: list[Trajectory], mini_batches: int, epochs: int = 1, step: int = 0) -> list[list[int]]:
    """The train role's plan for ``batch`` (trajectories group by group), run seed 0."""
    return plan_mini_batches([t.prompt_id for t in batch], mini_batches, epochs, seed=0, step=step)


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def one_optimizer_step_by_hand(model_dir: Path, batch: list[Trajectory]) -> dict[str, torch.Tensor]:
    """The train step before mini-batches, written out: the one loss loop over every trajectory,
    clipped at norm 1, one AdamW step at lr 1e-2 (on a one-thread worker, as the engine's)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    totals = StepTotals.of(batch, pg_loss.mean_over)
    accumulate(
        batch, lambda mb: response_logprobs(model, mb, 1.0), pg_loss, totals,
        max_tokens=64, device=torch.device("cpu"), version=0,
    )  # fmt: skip
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return weights_of(model)


async def test_one_mini_batch_of_one_epoch_is_the_train_step_before_mini_batches_bit_for_bit(
    trainer: TorchTrainEngine, model_dir: Path
) -> None:
    batch = make_batch()
    metrics = await trainer.train_step(batch, pg_loss, plan(batch, 1))
    worker = budgeted_executor("reference", 1)
    try:
        expected = worker.submit(one_optimizer_step_by_hand, model_dir, batch).result()
    finally:
        worker.shutdown()
    assert trainer.version == 1 and metrics["optimizer_steps"] == metrics["optimizer_steps_total"] == 1.0
    trained = weights_of(trainer.model)
    assert all(torch.equal(trained[name], expected[name]) for name in expected)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
async def test_each_mini_batch_is_an_optimizer_step_of_its_own_inside_one_version(model_dir: Path, aggregation: str) -> None:
    # Two mini-batches in one train step train exactly as two train steps on them would: each
    # its own loss aggregated over its own tokens or sequences (DAPO's token mean included), its
    # own clipping, its own LR-schedule step; only the version counts one.
    batch = make_batch(groups=4)
    halves = plan(batch, 2)
    objective = PolicyObjective(AlgorithmConfig(decoupled=False, aggregation=aggregation))
    async with (
        TorchTrainEngine(str(model_dir), lr=1e-2, warmup_steps=4) as together,
        TorchTrainEngine(str(model_dir), lr=1e-2, warmup_steps=4) as apart,
    ):
        metrics = await together.train_step(batch, objective, halves)
        separate = [await apart.train_step([batch[i] for i in half], objective) for half in halves]
        assert (together.version, apart.version) == (1, 2)
        assert weights_of(together.model).keys() == weights_of(apart.model).keys()
        assert all(torch.equal(p, weights_of(apart.model)[n]) for n, p in weights_of(together.model).items())
    assert metrics["optimizer_steps"] == metrics["optimizer_steps_total"] == 2.0
    assert metrics["lr"] == pytest.approx(1e-2 * (1 / 4 + 2 / 4) / 2)  # the warm-up moved once per optimizer step
    assert metrics["grad_norm"] == pytest.approx(sum(m["grad_norm"] for m in separate) / 2)
    assert metrics["loss"] == pytest.approx(sum(m["loss"] for m in separate) / 2)
    assert metrics["tokens"] == sum(s.num_actions for s in batch) and metrics["samples"] == len(batch)
    assert metrics["micro_batches"] == sum(m["micro_batches"] for m in separate)


async def test_epochs_pass_over_the_step_again_and_each_optimizer_step_knows_where_its_weights_stand(
    trainer: TorchTrainEngine,
) -> None:
    batch = make_batch(groups=4)
    for s in batch:
        s.versions = [0] * s.num_actions  # sampled at the step's own version: fresh at its first optimizer step
    seen: list[tuple[LossInputs, bool]] = []

    def spy(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        seen.append((inputs, trainer._weights_lock.locked()))
        return pg_loss(inputs)

    mini_batches = plan(batch, 2, epochs=2)
    metrics = await trainer.train_step(batch, Objective(spy), mini_batches)
    assert trainer.version == 1 and metrics["optimizer_steps"] == 4.0
    for inputs, locked in seen:
        assert inputs.prox_version == 0 and inputs.current_version in (0.0, 0.25, 0.5, 0.75)
        assert inputs.versions is not None and torch.equal(inputs.versions[inputs.mask > 0], torch.zeros(int(inputs.mask.sum())))
        # Only the first optimizer step's weights are a version's: its tokens are fresh, and until
        # then a sync may read the weights; from then until the version moves on, none can.
        first = inputs.current_version == 0.0
        assert (inputs.fresh is not None) is first and locked is not first
    rows = [sum(len(i.mask) for i, _ in seen if i.current_version == k / 4) for k in range(4)]
    assert rows == [len(part) for part in mini_batches]
    await trainer.train_step(batch, pg_loss, plan(batch, 2, epochs=2, step=1))
    assert trainer.version == 2


def failing_from(version: float) -> Objective:
    """``pg_loss``, raising in every optimizer step whose weights stand at ``version`` or later."""

    def loss(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        assert inputs.current_version is not None
        if inputs.current_version >= version:
            raise ValueError("loss exploded")
        return pg(inputs)

    return Objective(loss)


async def test_a_failure_at_the_first_optimizer_step_steps_nothing_and_one_after_it_is_a_partial_train_step(
    trainer: TorchTrainEngine,
) -> None:
    batch = make_batch(groups=4)
    before = weights_of(trainer.model)
    with pytest.raises(ValueError, match="loss exploded"):
        await trainer.train_step(batch, failing_from(0.0), plan(batch, 2))
    assert trainer.version == 0
    assert all(torch.equal(p, before[n]) for n, p in weights_of(trainer.model).items())
    with pytest.raises(PartialTrainStep, match="after 1 of its 2 optimizer steps") as info:
        await trainer.train_step(batch, failing_from(0.5), plan(batch, 2))
    assert isinstance(info.value.__cause__, ValueError) and trainer.version == 0
    assert any(not torch.equal(p, before[n]) for n, p in weights_of(trainer.model).items())  # no version's weights
