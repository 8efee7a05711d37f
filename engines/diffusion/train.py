"""The image train engine: Flow-GRPO's per-step log-probs recomputed under the current weights, trained in micro-batches.

What it owns: the trained transformer of a flow-matching generator (``engines.diffusion.model``),
its AdamW optimizer and LR schedule, optionally a frozen copy of the initial transformer (the
KL reference), the probe's record (``engines.diffusion.probe``) when its syncs are probed, and
one dedicated worker thread with its own CPU thread budget. Every method that touches the
models runs on that thread; ``async`` methods await its future.

Each denoising step of an image trajectory is an action. Scoring a step ``i`` of a trajectory
recomputes the guided velocity at ``(latents[i], sigmas[i])`` under the current weights, the
mean and std of Flow-GRPO's SDE transition, and the log-prob of the recorded ``latents[i +
1]`` (``algorithms.flow_grpo``), with the noise level and guidance scale the trajectory was
sampled with (its payload). A train step batches (sample, step) pairs into forwards of at most
``max_pairs_per_micro_batch`` pairs (each pair two transformer rows under guidance) and hands
the objective :class:`~algorithms.batch.LossInputs` of ``[samples, steps]`` tensors whose
``mask`` is the trained steps, so ``algorithms.PolicyObjective`` (PPO's clip on the per-step
ratio with GRPO's advantages) is the Flow-GRPO objective. With a reference, ``LossInputs.kl``
is the exact per-step KL to it, the closed form between the two Gaussian transitions
(``algorithms.flow_grpo.transition_kl``), for ``algorithm.kl_estimator: exact``.

Invariants:
- ODE steps (``payload.sde[i]`` False) have no log-prob: they score 0.0 and are never trained
  (a trajectory whose ``loss_mask`` trains one is refused);
- one ``train_step`` is one version: an optimizer step per mini-batch of its plan
  (``engines.trainers.optimizer_steps``; Flow-GRPO's reference trains several inner epochs too),
  whatever the number of micro-batches: each micro-batch loss is weighted by its share of the
  optimizer step's trained steps (``mean_over == "tokens"``) or of its trajectories with a
  trained step (``"sequences"``);
- the transformer stays in ``eval()`` mode: dropout would make recomputed log-probs disagree
  with the ones the losses compare them to;
- the weights and ``version`` change together, only under the weights lock (held from a train
  step's first optimizer step until its version is published, and by a restore), so
  ``weights_for_sync`` (held by the param-sync gather, ``engines.shared.weight_sync``) sees one
  whole version and knows which; with a probe record, the probe's log-probs at the new version
  are recorded under that lock too;
- with a LoRA adapter (``lora``: peft's layers injected by diffusers, ``engines.shared.lora``)
  only the adapter trains: it alone requires grad, sits in the optimizer, is synced, and fills
  the checkpoints (under peft's names); the KL reference is the same transformer with the
  adapter disabled (no second copy of the base); the export is diffusers' LoRA file.
"""

from __future__ import annotations

import asyncio
import copy
import shutil
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from tandem.algorithms.batch import LossInputs
from tandem.algorithms.flow_grpo import sde_transition, transition_kl, transition_log_prob
from tandem.algorithms.metrics import accumulate_metrics
from tandem.core.protocols import LossObjective
from tandem.core.records import Trajectory
from tandem.engines.diffusion.model import MODEL_INDEX, guided_velocity, load_generator
from tandem.engines.diffusion.payload import ImagePayload, image_payload
from tandem.engines.diffusion.probe import DenoisingProbe, denoising_probe, probe_logprobs
from tandem.engines.shared.lora import (
    TrainedWeights,
    adapter_dropout,
    merged_transformer,
    save_diffusers_adapter,
    with_diffusers_adapter,
)
from tandem.engines.shared.probe import ProbeRecord
from tandem.engines.shared.threads import ClosesOnAThread, budgeted_executor
from tandem.engines.trainers.optimizer_steps import InProcessSteps, step_parts
from tandem.engines.trainers.state import TRAINER_STATE_FILE, load_trainer_state, restore_trainer_state, save_trainer_state

if TYPE_CHECKING:
    import peft

__all__ = ["TRAINER_STATE_FILE", "DiffusionTrainEngine"]

_T = TypeVar("_T")


@dataclass(slots=True)
class _Pairs:
    """(sample, step) pairs of some trajectories, as tensors for one forward."""

    rows: torch.Tensor  # [P] row of each pair in the micro-batch
    steps: torch.Tensor  # [P] its step
    latents: torch.Tensor  # [P, C, H, W] latents before the step
    drawn: torch.Tensor  # [P, C, H, W] the recorded sample after it
    sigma: torch.Tensor  # [P]
    sigma_next: torch.Tensor  # [P]
    prompts: list[str]  # [P]


@dataclass(slots=True, frozen=True)
class _Scored:
    logprobs: torch.Tensor  # [P] under the current weights (with grad when enabled)
    kl: torch.Tensor | None  # [P] exact KL to the reference, when there is one


class DiffusionTrainEngine(ClosesOnAThread):
    """The trained transformer of a flow-matching generator; implements ``core.protocols.TrainEngine``.

    ``kl_reference=True`` fills ``LossInputs.kl`` with the exact per-step KL to the initial
    transformer: a frozen copy of it, or with ``lora`` (a peft LoRA adapter trained on the frozen
    base instead of every weight) the base itself, adapter disabled. ``probe``: record the probe's
    log-probs at every version in :attr:`probe` (the sync's proof of arrival, ``engines.shared.probe``).
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        lr: float,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        max_grad_norm: float = 1.0,
        max_pairs_per_micro_batch: int = 256,
        num_threads: int = 1,
        kl_reference: bool = False,
        start_version: int = 0,
        lora: peft.LoraConfig | None = None,
        probe: bool = False,
    ) -> None:
        if max_pairs_per_micro_batch < 1:
            raise ValueError(f"max_pairs_per_micro_batch must be >= 1, got {max_pairs_per_micro_batch}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm}")
        self.model_path = Path(model_path)
        self._generator = load_generator(model_path, device=device, dtype=dtype, with_vae=False)
        self._device = self._generator.device
        transformer = self._generator.transformer
        self._lora = lora
        self._model = transformer.requires_grad_(True) if lora is None else with_diffusers_adapter(transformer, lora)
        self._weights = TrainedWeights(self._model, adapted=lora is not None)
        self._kl_reference = kl_reference
        copied = kl_reference and lora is None  # an adapter's reference is its base: no copy
        self._reference = copy.deepcopy(self._model).requires_grad_(False) if copied else None
        self._uncond = self._generator.encode([""])
        self._max_pairs = max_pairs_per_micro_batch
        self._version = start_version
        # Held while the weights change (optimizer step, restore) and by a sync reading them
        # from another thread (``weights_for_sync``): that reader never sees a torn step.
        self._weights_lock = threading.Lock()
        trained = [p for p in self._model.parameters() if p.requires_grad]  # all of them without an adapter
        self._optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=weight_decay)
        self._scheduler = torch.optim.lr_scheduler.LambdaLR(
            self._optimizer, lambda step: 1.0 if warmup_steps == 0 else min(1.0, (step + 1) / warmup_steps)
        )
        self._steps = InProcessSteps(self._model, self._optimizer, self._scheduler, max_grad_norm)
        self.probe: ProbeRecord[DenoisingProbe] | None = ProbeRecord(denoising_probe(self._generator)) if probe else None
        self._record_probe()
        self._executor = budgeted_executor("diffusion-train", num_threads)

    # ----------------------------------------------------------------------------- public API

    @property
    def version(self) -> int:
        return self._version

    @property
    def model(self) -> torch.nn.Module:
        """The trained transformer, for inspection; mutate it only through the engine's methods."""
        return self._model

    async def logprobs(self, trajectories: Sequence[Trajectory]) -> list[list[float]]:
        """Per-step log-probs of each trajectory under the current weights (0.0 on ODE steps)."""
        return await self._on_worker(self._score_all, list(trajectories))

    async def train_step(
        self, batch: Sequence[Trajectory], objective: LossObjective, mini_batches: Sequence[Sequence[int]] | None = None
    ) -> dict[str, float]:
        """One version trained on the trained steps of ``batch``: an optimizer step per entry of
        ``mini_batches`` (indices into ``batch``, in order), or one on all; returns its metrics.

        Every trajectory must carry its ``advantage``; ``prox_logprobs`` are passed to the
        objective when every trajectory has them (refused when only some do).
        """
        mean_over = objective.mean_over
        if mean_over not in ("tokens", "sequences"):
            raise ValueError(f"objective.mean_over must be 'tokens' or 'sequences', got {mean_over!r}")
        return await self._on_worker(self._train_step, list(batch), objective, mini_batches)

    def named_tensors_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) per weight of the transformer, tied storage once, or with an adapter
        the adapter's tensors only (``engines.shared.lora.adapter_tensors``); live and unguarded."""
        yield from self._weights.synced().items()

    @contextmanager
    def weights_for_sync(self) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """Hold the weights still and yield (their version, the live tensors by name); any thread."""
        with self._weights_lock:
            yield self._version, self._weights.synced()

    async def save_state(self, folder: Path) -> None:
        """Write ``trainer.pt`` (transformer or adapter, optimizer, schedule, version, torch's CPU RNG) into ``folder``."""
        await self._on_worker(self._save, Path(folder) / TRAINER_STATE_FILE)

    async def load_state(self, folder: Path) -> None:
        """Restore what :meth:`save_state` wrote; ``version`` is then the saved one."""
        await self._on_worker(self._load, Path(folder) / TRAINER_STATE_FILE)

    async def export(self, folder: Path) -> None:
        """Write the current generator as a model folder the diffusion engines load: the trained
        ``transformer/`` plus the source folder's other components and ``model_index.json``; with
        an adapter, the adapter alone as diffusers' LoRA file (``pytorch_lora_weights.safetensors``,
        which ``load_lora_weights(folder)`` of a pipeline over the base loads)."""
        await self._on_worker(self._export, Path(folder))

    async def export_merged(self, folder: Path) -> None:
        """Write the generator with the adapter merged into its transformer as a model folder (as
        :meth:`export` writes one without an adapter)."""
        if self._lora is None:
            raise ValueError("export_merged() needs an adapter: without one, export() writes the trained generator")
        await self._on_worker(lambda: self._write_generator(Path(folder), merged_transformer(self._model)))

    def close(self) -> None:
        """Finish queued work and stop the worker thread."""
        self._executor.shutdown(wait=True)


    async def _on_worker(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.wrap_future(self._executor.submit(fn, *args))

    # ------------------------------------------------------------------ worker thread only

    def _pairs(self, payloads: Sequence[ImagePayload], steps: Sequence[Sequence[int]]) -> _Pairs:
        rows = [r for r, row_steps in enumerate(steps) for _ in row_steps]
        flat = [s for row_steps in steps for s in row_steps]
        latents = np.stack([payloads[r].latents[s] for r, s in zip(rows, flat, strict=True)])
        drawn = np.stack([payloads[r].latents[s + 1] for r, s in zip(rows, flat, strict=True)])
        device = self._device
        return _Pairs(
            rows=torch.tensor(rows, device=device),
            steps=torch.tensor(flat, device=device),
            latents=torch.from_numpy(latents).to(device),
            drawn=torch.from_numpy(drawn).to(device),
            sigma=torch.tensor([payloads[r].sigmas[s] for r, s in zip(rows, flat, strict=True)], device=device),
            sigma_next=torch.tensor([payloads[r].sigmas[s + 1] for r, s in zip(rows, flat, strict=True)], device=device),
            prompts=[payloads[r].prompt for r in rows],
        )

    def _score(self, pairs: _Pairs, noise_level: float, guidance_scale: float, with_kl: bool) -> _Scored:
        """Log-probs of the recorded steps under the current weights (and the exact KL to the reference)."""
        gen = self._generator
        cond = gen.encode(pairs.prompts)

        def velocity(model: torch.nn.Module) -> torch.Tensor:
            return guided_velocity(
                model, pairs.latents, pairs.sigma, cond, self._uncond, guidance_scale, gen.num_train_timesteps
            )

        mean, std = sde_transition(pairs.latents, velocity(self._model), pairs.sigma, pairs.sigma_next, noise_level)
        logprobs = transition_log_prob(pairs.drawn, mean, std)
        kl = None
        if with_kl and self._kl_reference:
            with torch.no_grad(), self._reference_model() as reference:
                ref_mean, _ = sde_transition(pairs.latents, velocity(reference), pairs.sigma, pairs.sigma_next, noise_level)
            kl = transition_kl(mean, ref_mean, std)
        return _Scored(logprobs, kl)

    @contextmanager
    def _reference_model(self) -> Iterator[torch.nn.Module]:
        """The KL reference: the frozen initial transformer, or the base (the adapter disabled for the block)."""
        if self._reference is not None:
            yield self._reference
            return
        self._model.disable_adapters()  # type: ignore[operator]
        try:
            yield self._model
        finally:
            self._model.enable_adapters()  # type: ignore[operator]

    def _score_all(self, trajectories: list[Trajectory]) -> list[list[float]]:
        payloads = [image_payload(t) for t in trajectories]
        out = [[0.0] * p.num_steps for p in payloads]
        pending = [(r, s) for r, p in enumerate(payloads) for s in range(p.num_steps) if p.sde[s]]
        with torch.no_grad():
            for start in range(0, len(pending), self._max_pairs):
                chunk = pending[start : start + self._max_pairs]
                rows = sorted({r for r, _ in chunk})
                steps = [[s for r, s in chunk if r == row] for row in rows]
                chosen = [payloads[r] for r in rows]
                noise_level, guidance_scale = _sampling_settings(chosen)
                scored = self._score(self._pairs(chosen, steps), noise_level, guidance_scale, with_kl=False)
                for (r, s), value in zip(chunk, scored.logprobs.tolist(), strict=True):
                    out[r][s] = value
        return out

    def _micro_batches(self, trained: list[list[int]]) -> list[list[int]]:
        """Rows grouped in order so each group's trained steps fit the pair budget (a row over it alone)."""
        plan: list[list[int]] = []
        pairs = 0
        for row, steps in enumerate(trained):
            if plan and pairs + len(steps) <= self._max_pairs:
                plan[-1].append(row)
                pairs += len(steps)
            else:
                plan.append([row])
                pairs = len(steps)
        return plan

    def _train_step(
        self, batch: list[Trajectory], objective: LossObjective, mini_batches: Sequence[Sequence[int]] | None
    ) -> dict[str, float]:
        _check_trainable(batch)
        parts = step_parts(batch, mini_batches)
        noise_level, guidance_scale = _sampling_settings([image_payload(batch[i]) for part in parts for i in part])

        def accumulate_step(part: list[int], progress: float) -> tuple[dict[str, float], int]:
            with adapter_dropout(self._model):  # a no-op without an adapter or its dropout
                return self._accumulate([batch[i] for i in part], objective, noise_level, guidance_scale, progress)

        metrics = self._steps.train(
            parts, accumulate_step, weights_lock=self._weights_lock, version=self._version, publish=self._publish
        )
        # Trained (sample, step) pairs are this workload's actions.
        return {**metrics, "tokens": float(sum(t.num_trained for t in batch)), "samples": float(len(batch))}

    def _publish(self) -> None:
        """The train step's optimizer steps are taken: its weights are the next version (under the weights lock)."""
        self._version += 1
        self._record_probe()

    def _record_probe(self) -> None:
        """The probe's log-probs at the current version (under the weights lock, or before any thread runs)."""
        if self.probe is not None:
            self.probe.record(self._version, probe_logprobs(self._generator, self.probe.inputs))

    def _accumulate(
        self, samples: list[Trajectory], objective: LossObjective, noise_level: float, guidance_scale: float, progress: float
    ) -> tuple[dict[str, float], int]:
        """Add the gradient of one optimizer step's trajectories, micro-batch by micro-batch, each
        loss weighted by its share of the step; returns the weighted metric sums and micro-batches."""
        payloads = [image_payload(t) for t in samples]
        trained = [[i for i, m in enumerate(_mask(t)) if m] for t in samples]
        total_pairs = sum(len(steps) for steps in trained)
        has_prox = samples[0].prox_logprobs is not None  # uniform over the batch (_check_trainable)
        sums: dict[str, float] = {}
        plan = self._micro_batches(trained)
        for group in plan:
            rows = [samples[i] for i in group]
            steps = [trained[i] for i in group]
            width = max(t.num_actions for t in rows)
            pairs = self._pairs([payloads[i] for i in group], steps)
            scored = self._score(pairs, noise_level, guidance_scale, with_kl=True)
            mask = torch.zeros(len(rows), width, device=self._device)
            mask[pairs.rows, pairs.steps] = 1.0
            index = (pairs.rows, pairs.steps)
            inputs = LossInputs(
                logprobs=torch.zeros(len(rows), width, device=self._device).index_put(index, scored.logprobs),
                behaviour_logprobs=_padded([t.behaviour_logprobs for t in rows], width, self._device),
                advantages=torch.tensor([[t.advantage] for t in rows], device=self._device) * mask,
                mask=mask,
                prox_logprobs=_padded([t.prox_logprobs for t in rows], width, self._device) if has_prox else None,
                kl=None if scored.kl is None else torch.zeros(len(rows), width, device=self._device).index_put(index, scored.kl),
                versions=_padded([t.versions for t in rows], width, self._device, fill=-1.0),
                prox_version=self._version,
                current_version=self._version + progress,
            )
            loss, metrics = objective(inputs)
            share = len(pairs.prompts) / total_pairs if objective.mean_over == "tokens" else len(rows) / len(samples)
            (loss * share).backward()
            accumulate_metrics(sums, {**metrics, "loss": float(loss.detach())}, share)
        return sums, len(plan)

    def _save(self, path: Path) -> None:
        save_trainer_state(path, self._weights.state(), self._optimizer, self._scheduler, self._version)

    def _load(self, path: Path) -> None:
        state = load_trainer_state(path)
        with self._weights_lock:  # the weights and their version move together
            self._version = restore_trainer_state(state, self._weights.load, self._optimizer, self._scheduler)
            self._record_probe()

    def _export(self, folder: Path) -> None:
        if self._lora is None:
            self._write_generator(folder, self._model)
        else:
            save_diffusers_adapter(self._model, self._weights.synced(), folder)

    def _write_generator(self, folder: Path, transformer: torch.nn.Module) -> None:
        """``transformer`` with the source folder's other components and ``model_index.json``, as a model folder."""
        folder.mkdir(parents=True, exist_ok=True)
        transformer.save_pretrained(folder / "transformer")  # type: ignore[operator]
        for entry in self.model_path.iterdir():
            if entry.name != "transformer" and (entry.is_dir() or entry.name == MODEL_INDEX):
                copy_entry = shutil.copytree if entry.is_dir() else shutil.copy2
                copy_entry(entry, folder / entry.name, **({"dirs_exist_ok": True} if entry.is_dir() else {}))


def _mask(trajectory: Trajectory) -> list[int]:
    return [1] * trajectory.num_actions if trajectory.loss_mask is None else trajectory.loss_mask


def _sampling_settings(payloads: Sequence[ImagePayload]) -> tuple[float, float]:
    """The one (noise level, guidance scale) every payload was sampled with."""
    settings = {(p.noise_level, p.guidance_scale) for p in payloads}
    if len(settings) != 1:
        raise ValueError(f"trajectories sampled with different (noise level, guidance scale): {sorted(settings)}")
    return settings.pop()


def _check_trainable(samples: list[Trajectory]) -> None:
    if not samples:
        raise ValueError("train_step on no trajectories")
    present = {s.prox_logprobs is not None for s in samples}
    if len(present) > 1:
        raise ValueError("prox_logprobs is set on some trajectories and not on others")
    if samples[0].ref_logprobs is not None:
        raise ValueError("image trajectories take the exact KL from the engine's reference, not ref_logprobs")
    for s in samples:
        where = f"trajectory {s.prompt_id}/{s.index}"
        if s.advantage is None:
            raise ValueError(f"{where} has no advantage")
        payload = image_payload(s)
        for name in ("behaviour_logprobs", "prox_logprobs", "loss_mask"):
            values = getattr(s, name)
            if values is not None and len(values) != s.num_actions:
                raise ValueError(f"{where}: {len(values)} {name} for {s.num_actions} steps")
        if payload.num_steps != s.num_actions or len(payload.latents) != s.num_actions + 1:
            raise ValueError(f"{where}: a payload of {payload.num_steps} steps for {s.num_actions} actions")
        ode_trained = [i for i, m in enumerate(_mask(s)) if m and not payload.sde[i]]
        if ode_trained:
            raise ValueError(f"{where}: steps {ode_trained} are ODE steps (no log-prob) but the loss mask trains them")


def _padded(rows: Sequence[Sequence[float] | None], width: int, device: torch.device, fill: float = 0.0) -> torch.Tensor:
    """Per-step values right-padded with ``fill`` to ``width``."""
    out = torch.full((len(rows), width), fill, dtype=torch.float32)
    for b, values in enumerate(rows):
        assert values is not None  # _check_trainable: all present when this is called
        out[b, : len(values)] = torch.tensor(values, dtype=torch.float32)
    return out.to(device)
