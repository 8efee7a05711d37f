"""The embedded torch engines: the trained policy (``TorchTrainEngine``) and a frozen scorer (``TorchLogProbEngine``).

What they own: one transformers causal LM each (plus, for training, its AdamW optimizer and
LR schedule) and one dedicated worker thread with its own CPU thread budget. Every method
that touches the model runs on that thread, so the model needs no locks and the event loop
never computes; ``async`` methods await the worker's future.

Invariants:
- log-probs are ``log_softmax(logits / temperature)`` of each response token, float32,
  aligned with the trajectory's ``TokenPayload.response_ids``; the rollout engine samples at
  the same temperature and returns the same quantity, so on equal weights the two agree to
  float rounding;
- ``TorchTrainEngine.version`` counts train steps (plus the ``start_version`` it resumed at);
- one ``train_step`` is one optimizer step per mini-batch of its plan
  (``engines.trainers.optimizer_steps``; one over all its trajectories without a plan), whatever
  the number of micro-batches: each micro-batch loss (a mean over its trained tokens or its
  sequences, as the objective's ``mean_over`` says) is weighted by the micro-batch's share of
  the optimizer step's trained tokens or sequences, so the accumulated gradient equals that of
  the same mean over the whole mini-batch; tokens a trajectory's ``loss_mask`` leaves out (an
  episode's environment tokens) carry no gradient; each optimizer step is clipped on its own
  and moves the LR schedule once;
- the model stays in ``eval()`` mode while training: dropout would make the recomputed
  log-probs disagree with the ones the losses compare them to;
- the weights and ``version`` change together, only under ``TorchTrainEngine``'s weights lock
  (held from a train step's first optimizer step until its version is published, and by a
  checkpoint restore), so a reader holding that lock (``weights_for_sync``) sees one whole
  version and knows which, never the weights between two optimizer steps of one train step;
  with a probe record, the probe's log-probs at the new version are recorded under that lock too;
- with a LoRA adapter (``lora``: peft wraps the model, ``engines.shared.lora``) only the
  adapter trains: it alone requires grad, sits in the optimizer, is synced, and fills the
  checkpoints (``state_dict()["model"]`` holds the adapter's tensors under peft's names); the
  base stays frozen and is scored, adapter disabled, by :meth:`TorchTrainEngine.base_reference`
  (the KL reference without a second copy of the base).

One process, one rank: data parallelism over several ranks is a trainer group of
``engines.trainers.ddp`` ranks (``engines.trainers.group``), which runs the same loss loop
(``engines.trainers.loss_loop``) and reads and writes this engine's checkpoints.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from transformers import AutoModelForCausalLM

from tandem.algorithms.objective import LossMeanOver
from tandem.core.protocols import LossObjective
from tandem.core.records import Trajectory
from tandem.engines.shared.lora import BaseModelReference, TrainedWeights, adapter_dropout, with_adapter
from tandem.engines.shared.microbatch import MicroBatch, response_logprobs
from tandem.engines.shared.probe import ProbeRecord, probe_logprobs, probe_sequence
from tandem.engines.shared.threads import ClosesOnAThread, budgeted_executor
from tandem.engines.trainers.loss_loop import StepTotals, accumulate, check_trainable, score
from tandem.engines.trainers.optimizer_steps import InProcessSteps, step_parts
from tandem.engines.trainers.state import TRAINER_STATE_FILE, load_trainer_state, save_trainer_state

if TYPE_CHECKING:
    import peft

__all__ = [
    "REFERENCE_STATE_FILE",
    "TEACHER_STATE_FILE",
    "TRAINER_STATE_FILE",
    "TorchLogProbEngine",
    "TorchTrainEngine",
]

_T = TypeVar("_T")
# What a frozen scorer's save_state writes into a checkpoint, one file per scorer of a run.
REFERENCE_STATE_FILE = "reference.pt"
TEACHER_STATE_FILE = "teacher.pt"


class _TorchModelEngine(ClosesOnAThread):
    """A model on a dedicated worker thread that scores samples in token-budget micro-batches."""

    def __init__(
        self,
        model_path: str,
        *,
        device: str | torch.device,
        dtype: torch.dtype,
        temperature: float,
        max_tokens_per_micro_batch: int,
        num_threads: int,
        version: int,
        thread_name: str,
    ) -> None:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if max_tokens_per_micro_batch < 1:
            raise ValueError(f"max_tokens_per_micro_batch must be >= 1, got {max_tokens_per_micro_batch}")
        self._device = torch.device(device)
        self._temperature = temperature
        self._max_tokens = max_tokens_per_micro_batch
        self._version = version
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        self._model = model.to(self._device).eval()
        self._executor = budgeted_executor(thread_name, num_threads)

    @property
    def version(self) -> int:
        return self._version

    @property
    def model(self) -> torch.nn.Module:
        """The model, for inspection; mutate it only through the engine's methods."""
        return self._model

    async def logprobs(self, trajectories: Sequence[Trajectory]) -> list[list[float]]:
        """Per-token log-probs of each trajectory's response tokens, aligned with ``response_ids``."""
        logprobs, _ = await self.logprobs_and_entropy(trajectories)
        return logprobs

    async def logprobs_and_entropy(
        self, trajectories: Sequence[Trajectory]
    ) -> tuple[list[list[float]], list[list[float]]]:
        """Per-token log-probs and entropies of each trajectory's response tokens."""
        return await self._on_worker(self._score, trajectories)

    def close(self) -> None:
        """Finish queued work and stop the worker thread."""
        self._executor.shutdown(wait=True)


    async def _on_worker(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.wrap_future(self._executor.submit(fn, *args))

    def _forward(self, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return response_logprobs(self._model, batch, self._temperature)

    def _score(self, trajectories: Sequence[Trajectory]) -> tuple[list[list[float]], list[list[float]]]:
        return score(trajectories, self._forward, max_tokens=self._max_tokens, device=self._device)


class TorchLogProbEngine(_TorchModelEngine):
    """A frozen model (the KL reference, distillation's teacher) that only scores; implements
    ``LogProbEngine``. ``state_file`` names its file in a checkpoint (one per scorer of a run)."""

    def __init__(
        self,
        model_path: str,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        temperature: float = 1.0,
        max_tokens_per_micro_batch: int = 4096,
        num_threads: int = 1,
        version: int = 0,
        state_file: str = REFERENCE_STATE_FILE,
    ) -> None:
        super().__init__(
            model_path,
            device=device,
            dtype=dtype,
            temperature=temperature,
            max_tokens_per_micro_batch=max_tokens_per_micro_batch,
            num_threads=num_threads,
            version=version,
            thread_name="torch-logprob",
        )
        self._model.requires_grad_(False)
        self._state_file = state_file

    async def save_state(self, folder: Path) -> None:
        """Write the weights into ``folder`` (``state_file``): a checkpoint then holds the
        scorer a run started with, whatever happens to the model files."""
        state = {k: v.detach().cpu() for k, v in self._model.state_dict().items()}
        await self._on_worker(torch.save, state, Path(folder) / self._state_file)

    async def load_state(self, folder: Path) -> None:
        """Load the weights :meth:`save_state` wrote."""
        state = torch.load(Path(folder) / self._state_file, map_location="cpu", weights_only=True)
        await self._on_worker(self._model.load_state_dict, state)


class TorchTrainEngine(_TorchModelEngine):
    """The trained policy: AdamW with linear warmup to a constant LR; implements ``TrainEngine``.

    ``lora``: train a peft LoRA adapter on the frozen base instead of every weight. ``probe``:
    record the probe's log-probs at every version in :attr:`probe` (the sync's proof of
    arrival, ``engines.shared.probe``).
    """

    def __init__(
        self,
        model_path: str,
        *,
        lr: float,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        temperature: float = 1.0,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        max_grad_norm: float = 1.0,
        max_tokens_per_micro_batch: int = 4096,
        num_threads: int = 1,
        start_version: int = 0,
        lora: peft.LoraConfig | None = None,
        probe: bool = False,
    ) -> None:
        super().__init__(
            model_path,
            device=device,
            dtype=dtype,
            temperature=temperature,
            max_tokens_per_micro_batch=max_tokens_per_micro_batch,
            num_threads=num_threads,
            version=start_version,
            thread_name="torch-train",
        )
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm}")
        self._lora = lora
        if lora is not None:
            self._model = with_adapter(self._model, lora)
        self._trained = [p for p in self._model.parameters() if p.requires_grad]  # all of them without an adapter
        self._weights = TrainedWeights(self._model, adapted=lora is not None)
        # Held while the weights change (optimizer steps, restore) and by a sync reading them
        # from another thread (``weights_for_sync``): that reader never sees a torn step.
        self._weights_lock = threading.Lock()
        self._optimizer = torch.optim.AdamW(self._trained, lr=lr, weight_decay=weight_decay)
        self._scheduler = torch.optim.lr_scheduler.LambdaLR(
            self._optimizer, lambda step: 1.0 if warmup_steps == 0 else min(1.0, (step + 1) / warmup_steps)
        )
        self._steps = InProcessSteps(self._model, self._optimizer, self._scheduler, max_grad_norm)
        self.probe = ProbeRecord(probe_sequence(self._model.config.vocab_size)) if probe else None
        self._record_probe()

    async def train_step(
        self, batch: Sequence[Trajectory], objective: LossObjective, mini_batches: Sequence[Sequence[int]] | None = None
    ) -> dict[str, float]:
        """One version trained on ``batch``: an optimizer step per entry of ``mini_batches``
        (indices into ``batch``, in order), or one on every trajectory; returns its metrics.

        ``objective`` gets one :class:`LossInputs` per micro-batch (its ``mask`` is the trained
        tokens) and returns a loss that is a mean over that micro-batch's trained tokens or
        (``objective.mean_over == "sequences"``) its sequences with trained tokens, plus float
        metrics, averaged here with the same weights, then over the optimizer steps. Trajectories
        without trained tokens are left out. Every trajectory must carry its ``advantage``, or
        per-action ``token_advantages`` (GAE), which then take its place; ``prox_logprobs``,
        ``ref_logprobs`` and ``token_advantages`` are used when every trajectory has them, and
        refused when only some do.
        """
        mean_over = objective.mean_over
        if mean_over not in ("tokens", "sequences"):
            raise ValueError(f"objective.mean_over must be 'tokens' or 'sequences', got {mean_over!r}")
        return await self._on_worker(self._train_step, list(batch), objective, mean_over, mini_batches)

    @property
    def lora(self) -> peft.LoraConfig | None:
        """The adapter's settings; None when every weight trains."""
        return self._lora

    def named_tensors_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) per weight, tied storage once (``param_sync.unique_weights``); with
        an adapter, the adapter's tensors only (``engines.shared.lora.adapter_tensors``).

        These are the live tensors, unguarded: read them between train steps, or from another
        thread inside ``weights_for_sync``, and copy what must outlive the next step.
        """
        yield from self._weights.synced().items()

    @contextmanager
    def weights_for_sync(self) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """Hold the weights still and yield (their version, the live tensors by name).

        Callable from any thread: while the block runs no optimizer step or restore can change
        the weights (the worker waits at its next one), so a reader in another thread (the
        param-sync gather) copies one whole version. Keep the block short: training waits.
        """
        with self._weights_lock:
            yield self._version, self._weights.synced()

    def base_reference(self) -> BaseModelReference:
        """The base model, scored with the adapter disabled: the KL reference of a LoRA run."""
        if self._lora is None:
            raise ValueError("base_reference() needs an adapter: without one the trained model is no reference")
        return BaseModelReference(self._base_logprobs)

    def state_dict(self) -> dict[str, Any]:
        """A deep copy of model, optimizer, schedule and version, taken after queued work finishes.

        Blocks the caller until then; from an event loop, call it through ``asyncio.to_thread``.
        """
        return self._executor.submit(self._snapshot).result()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (after queued work finishes; blocks like it)."""
        self._executor.submit(self._restore, state).result()

    async def save_state(self, folder: Path) -> None:
        """Write ``trainer.pt`` into ``folder``: model, optimizer, schedule, version and torch's
        CPU RNG state, on the worker thread after queued work (no step can interleave)."""
        await self._on_worker(self._save, Path(folder) / TRAINER_STATE_FILE)

    async def load_state(self, folder: Path) -> None:
        """Restore what :meth:`save_state` wrote."""
        await self._on_worker(self._load, Path(folder) / TRAINER_STATE_FILE)

    async def _base_logprobs(self, trajectories: Sequence[Trajectory]) -> list[list[float]]:
        logprobs, _ = await self._on_worker(self._score_base, trajectories)
        return logprobs

    # ------------------------------------------------------------------ worker thread only

    def _record_probe(self) -> None:
        """The probe's log-probs at the current version (under the weights lock, or before any thread runs)."""
        if self.probe is not None:
            self.probe.record(self._version, probe_logprobs(self._model, self.probe.inputs))

    def _score_base(self, trajectories: Sequence[Trajectory]) -> tuple[list[list[float]], list[list[float]]]:
        with self._model.disable_adapter():
            return self._score(trajectories)

    def _snapshot(self) -> dict[str, Any]:
        return copy.deepcopy(
            {
                "model": self._weights.state(),
                "optimizer": self._optimizer.state_dict(),
                "scheduler": self._scheduler.state_dict(),
                "version": self._version,
            }
        )

    def _save(self, path: Path) -> None:
        save_trainer_state(path, self._weights.state(), self._optimizer, self._scheduler, self._version)

    def _load(self, path: Path) -> None:
        state = load_trainer_state(path)
        self._restore(state)
        torch.set_rng_state(state["rng"])

    def _restore(self, state: dict[str, Any]) -> None:
        with self._weights_lock:
            self._weights.load(state["model"])
            # The optimizer keeps the tensors it is given: a copy keeps our steps out of the
            # caller's dict (which may be loaded into another engine too).
            self._optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
            self._scheduler.load_state_dict(state["scheduler"])
            self._version = state["version"]
            self._record_probe()

    def _train_step(
        self,
        samples: list[Trajectory],
        loss_fn: LossObjective,
        loss_mean_over: LossMeanOver,
        mini_batches: Sequence[Sequence[int]] | None,
    ) -> dict[str, float]:
        check_trainable(samples)

        def accumulate_step(part: list[int], progress: float) -> tuple[dict[str, float], int]:
            trained = [samples[i] for i in part]
            with adapter_dropout(self._model):  # a no-op without an adapter or its dropout
                return accumulate(
                    trained, self._forward, loss_fn, StepTotals.of(trained, loss_mean_over), max_tokens=self._max_tokens,
                    device=self._device, version=self._version, progress=progress,
                )  # fmt: skip

        metrics = self._steps.train(
            step_parts(samples, mini_batches), accumulate_step,
            weights_lock=self._weights_lock, version=self._version, publish=self._publish,
        )  # fmt: skip
        return {**metrics, "tokens": float(sum(s.num_trained for s in samples)), "samples": float(len(samples))}

    def _publish(self) -> None:
        """The train step's optimizer steps are taken: its weights are the next version (under the weights lock)."""
        self._version += 1
        self._record_probe()

