"""The embedded critic: a value model built from the policy's own checkpoint, trained on its own thread.

What it owns: :class:`ValueModel`, the causal LM's decoder (the transformer body of the same
Hugging Face checkpoint the policy starts from, without its LM head) with a scalar head on the
last hidden state, and :class:`TorchValueEngine`, which scores and trains it on a dedicated worker
thread with its own AdamW optimizer and version (``core.protocols.ValueEngine``).

The value of action ``t`` is the value of the state *before* it: the head reads the hidden state
at the position whose logits predict token ``t`` (the same positions the policy's log-probs are
read at, ``engines.shared.microbatch``), so values, log-probs and GAE line up action by action.
The head starts at zero (every value 0 until the critic has trained): a neutral baseline, and
the body starts from the pretrained weights (verl and OpenRLHF initialise their critics from
the policy's checkpoint too). No dropout: the model stays in ``eval()`` mode while training, as
the policy does.

With a LoRA adapter (``lora``: ``engines.lora``) the critic trains an adapter of its own, with
the policy's settings, on its own frozen copy of the decoder, plus the head. It does not share the
policy's base: it never has (it loads the checkpoint itself, to score and train on its own thread
beside a policy that may live in other processes, a trainer group's ranks), and one model serving
two adapters from two threads would switch adapters under a running forward. What a user with
``engines.lora`` is after is memory: a fully trained critic would carry gradients and two AdamW
moments of the whole model beside the policy's adapter; this one's gradients, optimizer state
and checkpoints are the adapter's and the head's size, its frozen copy of the base is the cost left.

Invariants: ``version`` counts train steps (plus a restored checkpoint's): one per policy step
trained on, however many optimizer steps; weights and version change together on the worker
thread; one ``train_step`` is one optimizer step per mini-batch of its plan, the policy's
(``engines.trainers.optimizer_steps``), whatever its micro-batches (each micro-batch loss
weighted by its share of the optimizer step's trained actions or sequences, as
``objective.mean_over`` says); with an adapter only the adapter and the head require grad,
sit in the optimizer and fill the checkpoints, the decoder's base weights staying as loaded.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from transformers import AutoModelForCausalLM

from tandem.algorithms.gae import ValueInputs
from tandem.algorithms.metrics import accumulate_metrics
from tandem.core.protocols import LossObjective
from tandem.core.records import Trajectory
from tandem.engines.shared.lora import adapter_dropout, with_injected_adapter
from tandem.engines.shared.microbatch import MicroBatch, collate, plan_micro_batches, token_payload
from tandem.engines.shared.threads import budgeted_executor
from tandem.engines.trainers.loss_loop import StepTotals, padded
from tandem.engines.trainers.optimizer_steps import step_parts, take_optimizer_steps

if TYPE_CHECKING:
    import peft

__all__ = ["CRITIC_STATE_FILE", "TorchValueEngine", "ValueModel"]

CRITIC_STATE_FILE = "critic.pt"  # what the critic's save_state writes into a checkpoint folder
_T = TypeVar("_T")


class ValueModel(torch.nn.Module):
    """A causal LM's decoder with a scalar value head (zero-initialised) on its last hidden state;
    with ``lora``, a fresh adapter injected into the decoder, whose base is then frozen."""

    def __init__(self, model_path: str, dtype: torch.dtype = torch.float32, lora: peft.LoraConfig | None = None) -> None:
        super().__init__()
        lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        self.body = lm.get_decoder() if lora is None else with_injected_adapter(lm.get_decoder(), lora)
        self.head = torch.nn.Linear(lm.config.hidden_size, 1, dtype=dtype)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, batch: MicroBatch) -> torch.Tensor:
        """Values ``[rows, R]`` (float32) of the state before each response token; 0 on padding."""
        hidden = self.body(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
        kept = hidden[:, -batch.logits_to_keep :, :]
        index = batch.gather_index.unsqueeze(-1).expand(-1, -1, kept.shape[-1])
        return self.head(kept.gather(1, index)).squeeze(-1).float() * batch.mask


class TorchValueEngine:
    """The critic of ``algorithm.advantage: gae`` on the embedded torch engines; ``lora``: train an
    adapter on its decoder, and the head, instead of every weight."""

    def __init__(
        self,
        model_path: str,
        *,
        lr: float,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        weight_decay: float = 0.0,
        max_grad_norm: float = 1.0,
        max_tokens_per_micro_batch: int = 4096,
        num_threads: int = 1,
        lora: peft.LoraConfig | None = None,
    ) -> None:
        if max_grad_norm <= 0 or max_tokens_per_micro_batch < 1:
            raise ValueError("max_grad_norm must be > 0 and max_tokens_per_micro_batch >= 1")
        self._device = torch.device(device)
        self._max_tokens = max_tokens_per_micro_batch
        self._max_grad_norm = max_grad_norm
        self._model = ValueModel(model_path, dtype, lora).to(self._device).eval()
        self._adapted = lora is not None
        # Every parameter, or the adapter's and the head's.
        self._trained = {name: p for name, p in self._model.named_parameters() if p.requires_grad}
        self._optimizer = torch.optim.AdamW(self._trained.values(), lr=lr, weight_decay=weight_decay)
        self._version = 0
        self._optimizer_steps = 0
        self._executor = budgeted_executor("torch-critic", num_threads)

    @property
    def version(self) -> int:
        return self._version

    @property
    def model(self) -> ValueModel:
        """The model, for inspection; mutate it only through the engine's methods."""
        return self._model

    async def values(self, trajectories: Sequence[Trajectory]) -> list[list[float]]:
        return await self._on_worker(self._values, list(trajectories))

    async def train_step(
        self, batch: Sequence[Trajectory], objective: LossObjective, mini_batches: Sequence[Sequence[int]] | None = None
    ) -> dict[str, float]:
        """One version trained on ``batch``, an optimizer step per entry of ``mini_batches`` (or one):
        each trajectory's ``values`` (those its ``returns`` were computed with) and ``returns`` go
        to ``objective`` as :class:`ValueInputs`."""
        if objective.mean_over not in ("tokens", "sequences"):
            raise ValueError(f"objective.mean_over must be 'tokens' or 'sequences', got {objective.mean_over!r}")
        return await self._on_worker(self._train_step, list(batch), objective, mini_batches)

    async def save_state(self, folder: Path) -> None:
        """Write ``critic.pt`` (weights, optimizer, version, optimizer steps) into ``folder``, after queued work."""
        await self._on_worker(self._save, Path(folder) / CRITIC_STATE_FILE)

    async def load_state(self, folder: Path) -> None:
        await self._on_worker(self._load, Path(folder) / CRITIC_STATE_FILE)

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    async def _on_worker(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.wrap_future(self._executor.submit(fn, *args))

    # ------------------------------------------------------------------ worker thread only

    def _micro_batches(self, trajectories: Sequence[Trajectory], indices: list[int]) -> Iterator[MicroBatch]:
        lengths = [len(token_payload(trajectories[i]).prompt_ids) + trajectories[i].num_actions for i in indices]
        for group in plan_micro_batches(lengths, self._max_tokens):
            yield collate(trajectories, [indices[j] for j in group], self._device)

    def _values(self, trajectories: list[Trajectory]) -> list[list[float]]:
        out: list[list[float]] = [[] for _ in trajectories]
        scored = [i for i, t in enumerate(trajectories) if t.num_actions > 0]
        with torch.no_grad():
            for batch in self._micro_batches(trajectories, scored):
                values = self._model(batch)
                for row, i in enumerate(batch.indices):
                    out[i] = values[row, : trajectories[i].num_actions].tolist()
        return out

    def _train_step(
        self, samples: list[Trajectory], objective: LossObjective, mini_batches: Sequence[Sequence[int]] | None
    ) -> dict[str, float]:
        for s in samples:
            for name in ("values", "returns"):
                values = getattr(s, name)
                if values is None or len(values) != s.num_actions:
                    raise ValueError(f"trajectory {s.prompt_id}/{s.index}: {name} missing or not one per action")

        def optimizer_step(part: list[int], progress: float) -> dict[str, float]:
            trained = [samples[i] for i in part]
            totals = StepTotals(objective.mean_over, sum(s.num_trained for s in trained), len(trained))  # type: ignore[arg-type]
            self._optimizer.zero_grad(set_to_none=True)
            sums: dict[str, float] = {}
            with adapter_dropout(self._model):  # a no-op without an adapter or its dropout
                for batch in self._micro_batches(samples, part):
                    rows = [samples[i] for i in batch.indices]
                    mask = batch.loss_mask
                    inputs = ValueInputs(
                        values=self._model(batch),
                        old_values=padded([s.values for s in rows], mask),
                        returns=padded([s.returns for s in rows], mask),
                        mask=mask,
                    )
                    loss, metrics = objective(inputs)
                    weight = totals.weight(batch)
                    (loss * weight).backward()
                    accumulate_metrics(sums, metrics, weight)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self._trained.values(), self._max_grad_norm))
            if not math.isfinite(grad_norm):
                self._optimizer.zero_grad(set_to_none=True)
                raise FloatingPointError(f"critic: non-finite gradient norm {grad_norm} at version {self._version}")
            self._optimizer.step()
            self._optimizer.zero_grad(set_to_none=True)
            self._optimizer_steps += 1
            return {**sums, "grad_norm": grad_norm}

        metrics = take_optimizer_steps(step_parts(samples, mini_batches), optimizer_step, version=self._version)
        self._version += 1
        return {**metrics, "optimizer_steps_total": float(self._optimizer_steps)}

    def _save(self, path: Path) -> None:
        state = {
            "model": self._trained_state() if self._adapted else self._model.state_dict(),
            "optimizer": self._optimizer.state_dict(),
            "version": self._version,
            "optimizer_steps": self._optimizer_steps,
        }
        torch.save(state, path)

    def _load(self, path: Path) -> None:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if self._adapted:
            self._load_trained(state["model"])
        else:
            self._model.load_state_dict(state["model"])
        self._optimizer.load_state_dict(state["optimizer"])
        self._version = state["version"]
        # A checkpoint from before mini-batches took one optimizer step per version.
        self._optimizer_steps = state.get("optimizer_steps", state["version"])

    def _trained_state(self) -> dict[str, torch.Tensor]:
        """The adapter's and the head's tensors, under the model's own names (a critic syncs and
        exports nothing, so peft's saved names are not needed here)."""
        return {name: p.detach() for name, p in self._trained.items()}

    def _load_trained(self, state: dict[str, torch.Tensor]) -> None:
        if state.keys() != self._trained.keys():
            raise ValueError(
                f"critic: {len(state)} tensors given for an adapter and head of {len(self._trained)} "
                f"(e.g. {sorted(state.keys() ^ self._trained.keys())[:2]}): saved with other engines.lora settings, "
                "or without an adapter"
            )
        with torch.no_grad():
            for name, p in self._trained.items():
                p.copy_(state[name])
