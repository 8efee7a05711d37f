"""The critic with ``engines.lora``: an adapter of its own on its frozen copy of the decoder, plus
the head, is all that trains, sits in the optimizer and fills its checkpoint; it still learns its
returns and resumes exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_value import batch

from tandem.algorithms.objective import ValueObjective
from tandem.core.config import LoraConfig
from tandem.core.records import Trajectory
from tandem.engines.shared.lora import lora_settings
from tandem.engines.trainers.critic import CRITIC_STATE_FILE, TorchValueEngine

pytest.importorskip("peft", reason="LoRA needs the lora extra (peft)")

OBJECTIVE = ValueObjective(clip_eps=10.0)


def lora_critic(model_dir: Path) -> TorchValueEngine:
    torch.manual_seed(0)
    return TorchValueEngine(str(model_dir), lr=1e-2, lora=lora_settings(LoraConfig(rank=4), model_dir))


def with_values(samples: list[Trajectory], values: list[list[float]]) -> list[Trajectory]:
    for t, row in zip(samples, values, strict=True):
        t.values = row
    return samples


def squared_error(samples: list[Trajectory], values: list[list[float]]) -> float:
    return sum((r - v) ** 2 for t, row in zip(samples, values) for r, v in zip(t.returns or [], row))


async def test_only_the_adapter_and_the_head_train_and_sit_in_the_optimizer(model_dir: Path, tmp_path: Path) -> None:
    critic = lora_critic(model_dir)
    try:
        named = dict(critic.model.named_parameters())
        trained = {n for n, p in named.items() if p.requires_grad}
        assert trained and all(".lora_A." in n or ".lora_B." in n or n.startswith("head.") for n in trained)
        assert {"head.weight", "head.bias"} <= trained
        base = {n: p.detach().clone() for n, p in named.items() if n not in trained}
        samples = batch()
        assert all(v == 0.0 for row in await critic.values(samples) for v in row)  # the head starts at zero
        before = squared_error(samples, await critic.values(samples))
        for _ in range(5):
            await critic.train_step(with_values(samples, await critic.values(samples)), OBJECTIVE)
        assert squared_error(samples, await critic.values(samples)) < before  # it learns its returns
        assert all(torch.equal(p, base[n]) for n, p in critic.model.named_parameters() if n in base)  # the base stays
        assert any(not torch.equal(p, torch.zeros_like(p)) for n, p in named.items() if ".lora_B." in n)
        await critic.save_state(tmp_path)
        saved = torch.load(tmp_path / CRITIC_STATE_FILE, weights_only=True)
        assert set(saved["model"]) == trained  # the adapter and the head, not the decoder
        moments = saved["optimizer"]["state"].values()
        trained_numel = sum(named[n].numel() for n in trained)
        assert sum(s["exp_avg"].numel() + s["exp_avg_sq"].numel() for s in moments) == 2 * trained_numel
        assert trained_numel < sum(p.numel() for p in named.values()) / 5
    finally:
        critic.close()


async def test_a_lora_critic_resumes_exactly_and_refuses_a_full_critics_checkpoint(model_dir: Path, tmp_path: Path) -> None:
    whole, resumed = lora_critic(model_dir), lora_critic(model_dir)
    samples = batch()
    try:
        await whole.train_step(with_values(samples, await whole.values(samples)), OBJECTIVE)
        await whole.save_state(tmp_path)
        await resumed.load_state(tmp_path)
        assert resumed.version == whole.version == 1
        for critic in (whole, resumed):
            await critic.train_step(with_values(samples, await critic.values(samples)), OBJECTIVE)
        # The same computations replayed from the restored adapter, head and moments: equal bits.
        assert await resumed.values(samples) == await whole.values(samples)
    finally:
        whole.close()
        resumed.close()
    full = TorchValueEngine(str(model_dir), lr=1e-2)
    try:
        await full.save_state(tmp_path)
    finally:
        full.close()
    critic = lora_critic(model_dir)
    try:
        with pytest.raises(ValueError, match="saved with other engines.lora settings, or without an adapter"):
            await critic.load_state(tmp_path)
    finally:
        critic.close()
