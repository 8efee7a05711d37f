"""A LoRA adapter on a trainer group (FSDP2 and DDP ranks): only the adapter trains, sits in the
optimizer, syncs (under peft's names, proven by the probe) and fills checkpoints and exports; the
reference is the base with the adapter disabled; the first step is the one-process trainer's.

The equality with one process runs in float64 with one sample per micro-batch (as ``test_fsdp.py``):
only the order of summing per-sample gradients differs. It compares the first step's loss and
gradient norm, never weights after an Adam step (whose first step is the gradient's sign: any
float noise becomes a full-size step). A group start costs seconds: one group per engine, shared
by the module, restored to the untrained adapter before each test. Rank 3 over two ranks: FSDP2
splits each A's three rows unevenly, as a gather must undo.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch
from test_torch_train import make_batch, pg_loss

from tandem.core.config import LoraConfig
from tandem.engines.shared.lora import lora_settings
from tandem.engines.shared.probe import probed_in_process
from tandem.engines.text.rollout import HFRolloutEngine
from tandem.engines.trainers.group import RankSpec, TrainerGroup
from tandem.engines.trainers.torch_train import TorchLogProbEngine, TorchTrainEngine
from tandem.param_sync import TransferError
from tests.unit.engines.text.test_lora_sync import Dropping

pytest.importorskip("peft", reason="LoRA needs the lora extra (peft)")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ENGINES = ("fsdp2", "ddp")


def lora_spec(model_dir: Path, engine: str) -> RankSpec:
    return RankSpec(
        engine=engine, model_path=str(model_dir), device="cpu", dtype="float64", temperature=1.0, lr=1e-2,
        weight_decay=0.0, warmup_steps=0, max_grad_norm=1.0, max_tokens_per_micro_batch=1, num_threads=1,
        lora=lora_settings(LoraConfig(rank=3), model_dir),
    )  # fmt: skip


def flat(rows: list[list[float]]) -> list[float]:
    return [x for row in rows for x in row]


def staged(group: TrainerGroup) -> dict[str, torch.Tensor]:
    with group.weights_for_sync() as (_, tensors):
        return {name: t.clone() for name, t in tensors.items()}


@pytest.fixture(scope="module")
def groups(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[TrainerGroup, Path]]]:
    """Per engine: a two-rank LoRA group (its probe on) and a checkpoint of its untrained adapter."""
    made: dict[str, tuple[TrainerGroup, Path]] = {}
    try:
        for engine in ENGINES:
            group = TrainerGroup.local(lora_spec(model_dir, engine), 2)
            folder = tmp_path_factory.mktemp(f"untrained_{engine}")
            made[engine] = group, folder
            asyncio.run(group.save_state(folder))
        yield made
    finally:
        for group, _ in made.values():
            group.close()


@pytest.fixture(params=ENGINES)
async def group(request: pytest.FixtureRequest, groups: dict[str, tuple[TrainerGroup, Path]]) -> AsyncIterator[TrainerGroup]:
    trained, untrained = groups[request.param]
    await trained.load_state(untrained)
    yield trained


@pytest.fixture
async def single_process(model_dir: Path) -> AsyncIterator[TorchTrainEngine]:
    settings = lora_settings(LoraConfig(rank=3), model_dir)
    async with TorchTrainEngine(
        str(model_dir), lr=1e-2, dtype=torch.float64, max_tokens_per_micro_batch=1, lora=settings
    ) as engine:
        yield engine


async def test_the_first_step_is_the_one_process_lora_trainers(group: TrainerGroup, single_process: TorchTrainEngine) -> None:
    adapter = staged(group)
    assert adapter.keys() == dict(single_process.named_tensors_for_sync()).keys()  # peft's names, on both
    single_process.load_state_dict({**single_process.state_dict(), "model": adapter})  # the ranks' drawn A
    batch = make_batch()
    assert flat(await group.logprobs(batch)) == pytest.approx(flat(await single_process.logprobs(batch)), abs=1e-12)
    ours, theirs = await group.train_step(batch, pg_loss), await single_process.train_step(batch, pg_loss)
    assert ours["grad_norm"] > 0
    for metric in ("loss", "grad_norm"):
        assert ours[metric] == pytest.approx(theirs[metric], rel=1e-9, abs=1e-12), metric


async def test_only_the_adapter_trains_and_sits_in_the_optimizer(group: TrainerGroup, model_dir: Path, tmp_path: Path) -> None:
    before = staged(group)
    await group.train_step(make_batch(), pg_loss)
    after = staged(group)
    assert before.keys() == after.keys() and all(".lora_A." in n or ".lora_B." in n for n in after)
    assert any(not torch.equal(before[n], after[n]) for n in after if ".lora_B." in n)  # B moved off zero
    await group.save_state(tmp_path)
    [saved] = [torch.load(f, weights_only=True) for f in tmp_path.iterdir()]
    assert set(saved["model"]) == set(after)  # the checkpoint holds the adapter, not the base
    moments = list(saved["optimizer"]["state"].values())
    adapter_numel = sum(t.numel() for t in after.values())
    assert sum(s["exp_avg"].numel() + s["exp_avg_sq"].numel() for s in moments) == 2 * adapter_numel
    # The base never moved: scored with the adapter disabled, it is the untrained model.
    async with TorchLogProbEngine(str(model_dir), dtype=torch.float64) as untouched:
        reference = group.base_reference()
        assert reference.version == 0
        batch = make_batch(1)
        assert flat(await reference.logprobs(batch)) == pytest.approx(flat(await untouched.logprobs(batch)), abs=1e-12)
        assert flat(await group.logprobs(batch)) != pytest.approx(flat(await untouched.logprobs(batch)), abs=1e-6)


async def test_a_sync_carries_the_adapters_bytes_and_the_probe_catches_one_that_did_not_land(
    group: TrainerGroup, model_dir: Path
) -> None:
    await group.train_step(make_batch(), pg_loss)
    adapter_bytes = sum(t.numel() * t.element_size() for t in staged(group).values())
    assert group.probe is not None
    rollout = HFRolloutEngine(str(model_dir), dtype=torch.float64, lora=group.lora)
    rollout.target = Dropping(rollout.target, drop_from=group.version + 1)  # acknowledges the next, applies nothing
    sync = probed_in_process(
        group, rollout, group.probe, max_gap=1e-4, what="the adapter", produce_bucket_mb=1, consume_bucket_mb=1
    )
    try:
        report = await sync.sync(group.version)
        assert report.version == group.version
        assert report.metrics["bytes"] == adapter_bytes
        assert report.metrics["logprob_gap"] < 1e-9
        await group.train_step(make_batch(1), pg_loss)
        with pytest.raises(TransferError, match=rf"version {group.version} .*: the adapter did not land"):
            await sync.sync(group.version)
    finally:
        sync.close()
        rollout.close()


async def test_a_checkpoint_of_the_adapter_resumes_exactly(group: TrainerGroup, tmp_path: Path) -> None:
    for seed in range(2):
        await group.train_step(make_batch(seed), pg_loss)
    saved = staged(group)
    await group.save_state(tmp_path)
    for seed in range(2, 4):
        await group.train_step(make_batch(seed), pg_loss)
    whole = staged(group)
    await group.load_state(tmp_path)
    assert group.version == 2
    restored = staged(group)
    assert [n for n in saved if not torch.equal(saved[n], restored[n])] == []
    for seed in range(2, 4):
        await group.train_step(make_batch(seed), pg_loss)
    # The same computations replayed on the same machine from the restored adapter and moments.
    again = staged(group)
    assert group.version == 4 and [n for n in whole if not torch.equal(whole[n], again[n])] == []


async def test_the_export_is_a_peft_adapter_on_the_base(group: TrainerGroup, model_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    await group.train_step(make_batch(), pg_loss)
    await asyncio.to_thread(group.save_pretrained, tmp_path)
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64), tmp_path)
    loaded = {n: t for n, t in staged(group).items()}
    from tandem.engines.shared.lora import adapter_tensors

    exported = adapter_tensors(tuned)
    assert exported.keys() == loaded.keys()
    assert [n for n in loaded if not torch.equal(exported[n], loaded[n])] == []


async def test_a_ddp_groups_adapter_checkpoint_resumes_on_the_one_process_trainer(
    groups: dict[str, tuple[TrainerGroup, Path]], single_process: TorchTrainEngine, tmp_path: Path
) -> None:
    group, untrained = groups["ddp"]
    await group.load_state(untrained)
    await group.train_step(make_batch(), pg_loss)
    await group.save_state(tmp_path)  # trainer.pt, the one-process trainer's format
    await single_process.load_state(tmp_path)
    assert single_process.version == group.version == 1
    mine = dict(single_process.named_tensors_for_sync())
    assert [n for n, t in staged(group).items() if not torch.equal(t, mine[n])] == []
