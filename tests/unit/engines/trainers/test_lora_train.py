"""TorchTrainEngine with a LoRA adapter: only the adapter trains, syncs and is checkpointed; the
reference is the base with the adapter disabled; resume is exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.algorithms.batch import LossInputs
from tandem.core.config import LoraConfig
from tandem.core.protocols import LogProbEngine
from tandem.engines.shared.lora import lora_settings
from tandem.engines.trainers.state import TRAINER_STATE_FILE
from tandem.engines.trainers.torch_train import TorchLogProbEngine, TorchTrainEngine
from tests.unit.engines.trainers.test_torch_train import Objective, make_batch, pg, pg_loss

pytest.importorskip("peft", reason="LoRA needs the lora extra (peft)")


def lora_trainer(model_dir: Path, **lora: object) -> TorchTrainEngine:
    return TorchTrainEngine(str(model_dir), lr=1e-2, lora=lora_settings(LoraConfig(rank=4, **lora), model_dir))


def adapter_names(trainer: TorchTrainEngine) -> set[str]:
    return {name for name, _ in trainer.named_tensors_for_sync()}


async def test_only_the_adapter_gets_gradients_and_optimizer_state(model_dir: Path) -> None:
    grads: dict[str, torch.Tensor | None] = {}
    async with lora_trainer(model_dir) as trainer:
        named = dict(trainer.model.named_parameters())

        def spy(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
            loss, metrics = pg(inputs)
            loss.backward(retain_graph=True)  # a look at the gradient this micro-batch makes
            grads.update({n: None if p.grad is None else p.grad.clone() for n, p in named.items()})
            for p in named.values():
                p.grad = None
            return loss, metrics

        await trainer.train_step(make_batch(), Objective(spy))
        trained = {n for n, p in named.items() if p.requires_grad}
        assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
        assert {n for n, g in grads.items() if g is not None} == trained  # the base gets none
        assert any(g is not None and g.abs().sum() > 0 for n, g in grads.items() if ".lora_B." in n)
        state = trainer.state_dict()["optimizer"]["state"]
        adapter_numel = sum(t.numel() for _, t in trainer.named_tensors_for_sync())
        assert sum(s["exp_avg"].numel() + s["exp_avg_sq"].numel() for s in state.values()) == 2 * adapter_numel
        assert adapter_numel < sum(p.numel() for p in named.values()) / 10
        assert len(adapter_names(trainer)) == len(trained)  # what syncs: the adapter, under peft's names
        assert all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in adapter_names(trainer))


async def test_the_reference_is_the_base_model_with_the_adapter_disabled(model_dir: Path) -> None:
    batch = make_batch()
    async with lora_trainer(model_dir) as trainer, TorchLogProbEngine(str(model_dir)) as base:
        for seed in range(2):
            await trainer.train_step(make_batch(seed), pg_loss)
        reference = trainer.base_reference()
        assert isinstance(reference, LogProbEngine) and reference.version == 0
        assert await reference.logprobs(batch) == await base.logprobs(batch)
        assert await trainer.logprobs(batch) != await base.logprobs(batch)  # the adapter trained


async def test_a_checkpoint_holds_the_adapter_and_resumes_exactly(model_dir: Path, tmp_path: Path) -> None:
    async with lora_trainer(model_dir) as whole:
        for seed in range(2):
            await whole.train_step(make_batch(seed), pg_loss)
        await whole.save_state(tmp_path)
        saved = torch.load(tmp_path / TRAINER_STATE_FILE, weights_only=True)
        assert set(saved["model"]) == adapter_names(whole)  # the adapter, not the base
        for seed in range(2, 4):
            await whole.train_step(make_batch(seed), pg_loss)
        async with lora_trainer(model_dir) as resumed:
            await resumed.load_state(tmp_path)
            assert resumed.version == 2
            for seed in range(2, 4):
                await resumed.train_step(make_batch(seed), pg_loss)
            # The same computations replayed on the same machine from the restored adapter and
            # Adam moments: the log-probs agree bit for bit.
            assert resumed.version == whole.version == 4
            assert await resumed.logprobs(make_batch(9)) == await whole.logprobs(make_batch(9))


async def test_a_full_checkpoint_does_not_load_into_an_adapter(model_dir: Path, tmp_path: Path) -> None:
    async with TorchTrainEngine(str(model_dir), lr=1e-2) as full:
        await full.save_state(tmp_path)
    async with lora_trainer(model_dir) as trainer:
        with pytest.raises(ValueError, match="saved with other engines.lora settings, or without an adapter"):
            await trainer.load_state(tmp_path)


async def test_dropout_drops_in_the_gradient_forward_only(model_dir: Path) -> None:
    batch = make_batch()
    seen: list[torch.Tensor] = []

    def spy(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        seen.append(inputs.logprobs.detach())
        return pg(inputs)

    async with lora_trainer(model_dir, dropout=0.5) as trainer:
        await trainer.train_step(batch, pg_loss)  # B moves off zero: the adapter now changes outputs
        scored = await trainer.logprobs(batch)
        assert await trainer.logprobs(batch) == scored  # scoring never drops
        await trainer.train_step(batch[:1], Objective(spy))
        [row] = seen
        assert not torch.allclose(row[0, : len(scored[0])], torch.tensor(scored[0]), atol=1e-6)
