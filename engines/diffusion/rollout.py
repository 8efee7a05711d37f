"""The image rollout engine: Flow-GRPO's SDE sampler over a flow-matching transformer, with continuous batching.

What it owns: one generator (``engines.diffusion.model``), one dedicated denoising thread
(started in the constructor, stopped by ``close()``), the batch of images being denoised and
the FIFO of requests waiting for a row. Everything touching the model runs on that thread;
callers on any event loop submit work and receive trajectories through
``loop.call_soon_threadsafe``.

Continuous batching: each image is a row at its own step of its own schedule; every
denoising step advances every row by one step in a single (guided) transformer forward with
per-row sigmas, a finished row leaves at once (decoded, delivered) and a waiting request
takes the freed row at the next step. So concurrent ``generate()`` calls share one batch of
at most ``max_batch_size`` images, and training, evaluation (more steps, ODE only) and
Flow-GRPO-Fast rows (SDE on a window, ODE elsewhere) mix freely.

Invariants:
- each step of a row is one action: ``mean, std`` of Flow-GRPO's SDE transition
  (``algorithms.flow_grpo.sde_transition`` with the engine's noise level ``a``) and, on an SDE
  step, the draw ``mean + std·ε`` and its log-prob (``transition_log_prob``); on an ODE step
  the Euler step and a recorded log-prob of 0.0; the train engine recomputes the same
  quantities from the recorded latents, so on equal weights they agree to float rounding;
- a row's randomness is its request's alone: one generator seeded by ``request.seed`` draws the
  starting noise ``[C, H, W]`` (as ``torch.randn`` with that seed would) and then one ``ε`` per
  SDE step (none on ODE steps), on the host, so an image does not depend on the batch it
  shared, nor on the device;
- weights change only between denoising steps, all tensors at once: they arrive through
  param_sync into ``target`` (a :class:`~param_sync.ModuleTarget` over the transformer) and
  every step runs inside the target's step gate; each step is stamped with the version that
  computed it, so a sync landing mid-image shows in the trajectory's ``versions`` (and its
  ``version_span`` metric). No state other than the latents is carried across steps, so
  nothing computed by old weights outlives an update;
- with a LoRA adapter (``lora``) peft's layers are injected into the transformer and the target
  holds the adapter's tensors only (unmerged, under the trainer's names): an update replaces the
  whole adapter, the base is never written, and until the commit the previous adapter serves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from tandem.algorithms.flow_grpo import ode_step, sde_transition, transition_log_prob
from tandem.core.records import FinishReason, Trajectory
from tandem.engines.diffusion.model import Conditioning, FlowMatchingGenerator, guided_velocity, load_generator
from tandem.engines.diffusion.payload import ImagePayload
from tandem.engines.diffusion.probe import DenoisingProbe, probe_logprobs
from tandem.engines.shared.batching import Call, ContinuousBatcher, EngineClosedError
from tandem.engines.shared.lora import adapter_tensors, with_diffusers_adapter
from tandem.param_sync import LoadMode, ModuleTarget

if TYPE_CHECKING:
    import peft

__all__ = ["DenoiseRequest", "DiffusionRolloutEngine", "EngineClosedError"]


@dataclass(slots=True, frozen=True)
class DenoiseRequest:
    """One image to sample: sample ``index`` of prompt group ``prompt_id``.

    ``sde[i]`` says whether step ``i`` is stochastic (Flow-GRPO's SDE step, trained) or a
    deterministic Euler step; ``len(sde)`` is the number of denoising steps.
    """

    prompt_id: int
    index: int
    prompt: str
    seed: int
    sde: tuple[bool, ...]


@dataclass(slots=True)
class _Row:
    """A request from submission to delivery; mutated only by the denoising thread."""

    request: DenoiseRequest
    call: Call[_Row]
    sigmas: list[float] = field(default_factory=list)
    rng: torch.Generator | None = None
    cond: Conditioning | None = None
    x: torch.Tensor | None = None  # the current latents [C, H, W], float32, on the engine's device
    chain: list[np.ndarray] = field(default_factory=list)  # latents so far, host float32
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    # Set from the caller's thread when it stops listening; the row leaves at the next step boundary.
    cancelled: bool = False

    @property
    def step(self) -> int:
        return len(self.versions)

    @property
    def done(self) -> bool:
        return self.step == len(self.request.sde)


def _validate(request: DenoiseRequest) -> None:
    if not request.sde:
        raise ValueError(f"request {request.prompt_id}/{request.index}: no denoising steps")


class DiffusionRolloutEngine(ContinuousBatcher[DenoiseRequest, _Row, list[_Row]]):
    """Samples images with Flow-GRPO's SDE sampler on one dedicated denoising thread.

    ``generate(requests)`` streams one image :class:`~core.records.Trajectory` per request
    (payload :class:`~engines.diffusion.payload.ImagePayload`) as each finishes. New weights
    reach it through ``target`` (a :class:`~param_sync.ModuleTarget` over the transformer, in
    ``load_mode``), fed by a param_sync :class:`~param_sync.Receiver`; with ``lora``, a peft
    adapter's tensors only.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        noise_level: float,
        guidance_scale: float,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_size: int = 64,
        num_threads: int = 1,
        load_mode: LoadMode = "swap",
        start_version: int = 0,
        lora: peft.LoraConfig | None = None,
    ) -> None:
        if noise_level <= 0:
            raise ValueError(f"noise_level must be > 0 (SDE steps need noise), got {noise_level}")
        super().__init__(max_batch_size=max_batch_size, num_threads=num_threads)
        self.noise_level = noise_level
        self.guidance_scale = guidance_scale
        self._generator = load_generator(model_path, device=device, dtype=dtype)
        transformer = self._generator.transformer
        if lora is not None:
            with_diffusers_adapter(transformer, lora).requires_grad_(False)
        self._uncond = self._generator.encode([""]) if guidance_scale != 1.0 else None
        self._sigmas: dict[int, list[float]] = {}  # schedule per number of steps (decode thread only)
        weights = None if lora is None else adapter_tensors(transformer)
        self.target = ModuleTarget(transformer, load_mode=load_mode, version=start_version, weights=weights)
        self._serving = start_version  # decode thread only: the version its last step computed with
        self._start("diffusion-rollout")

    # ----------------------------------------------------------------------------- public API

    @property
    def version(self) -> int:
        """The weight version serving new steps (committed into ``target``)."""
        return self.target.loaded_version

    @property
    def generator(self) -> FlowMatchingGenerator:
        """The served generator, for inspection; change weights only through ``target``."""
        return self._generator

    def probe_logprobs(self, probe: DenoisingProbe) -> list[float]:
        """Log-probs of the probe's steps under the weights serving now (the sync's probe,
        ``engines.diffusion.probe``), computed on the caller's thread inside the step gate, so no
        update lands midway. Blocking; not from an event loop."""
        with self.target.decode_step():
            return probe_logprobs(self._generator, probe)

    # ----------------------------------------------------------------------- the batching loop's hooks

    def _validate(self, request: DenoiseRequest) -> None:
        _validate(request)

    def _new_row(self, request: DenoiseRequest, call: Call[_Row]) -> _Row:
        return _Row(request, call)

    def _empty(self) -> list[_Row]:
        return []

    def _rows(self, batch: list[_Row]) -> list[_Row]:
        return batch

    def _advance(self, batch: list[_Row], joining: list[_Row]) -> list[_Row]:
        self._serving = self.target.loaded_version
        batch = [row for row in batch if not row.cancelled]
        if joining:
            self._start_rows(joining)
            batch = batch + joining
        return self._step(batch) if batch else batch

    def _schedule(self, num_steps: int) -> list[float]:
        if num_steps not in self._sigmas:
            self._sigmas[num_steps] = self._generator.sigmas(num_steps)
        return self._sigmas[num_steps]

    def _start_rows(self, rows: list[_Row]) -> None:
        """Give joining rows their schedule, conditioning and starting noise."""
        shape = self._generator.latent_shape
        conditioning = self._generator.encode([row.request.prompt for row in rows])
        for i, row in enumerate(rows):
            row.sigmas = self._schedule(len(row.request.sde))
            row.rng = torch.Generator().manual_seed(row.request.seed)
            noise = torch.randn(shape, generator=row.rng)
            row.chain.append(noise.numpy())
            row.x = noise.to(self._generator.device)
            row.cond = conditioning.rows(torch.tensor([i], device=self._generator.device))

    def _step(self, rows: list[_Row]) -> list[_Row]:
        """One denoising step of every row; deliver the rows that finish, return the rest."""
        gen = self._generator
        device = gen.device
        x = torch.stack([row.x for row in rows])  # type: ignore[misc]
        sigma = torch.tensor([row.sigmas[row.step] for row in rows], device=device)
        sigma_next = torch.tensor([row.sigmas[row.step + 1] for row in rows], device=device)
        cond = Conditioning.cat([row.cond for row in rows])  # type: ignore[misc]
        velocity = guided_velocity(
            gen.transformer, x, sigma, cond, self._uncond, self.guidance_scale, gen.num_train_timesteps
        )
        mean, std = sde_transition(x, velocity, sigma, sigma_next, self.noise_level)
        stochastic = [row.request.sde[row.step] for row in rows]
        shape = x.shape[1:]
        # Drawn on the host from each row's own generator, and only on SDE steps (an ODE step draws nothing).
        noise = torch.stack(
            [torch.randn(shape, generator=row.rng) if sde else torch.zeros(shape)
             for row, sde in zip(rows, stochastic, strict=True)]
        ).to(device)
        is_sde = torch.tensor(stochastic, device=device).view(-1, *([1] * (x.ndim - 1)))
        drawn = torch.where(is_sde, mean + std * noise, ode_step(x, velocity, sigma, sigma_next))
        logprobs = transition_log_prob(drawn, mean, std).tolist()
        host = drawn.cpu().numpy()
        running: list[_Row] = []
        finished: list[_Row] = []
        for i, (row, sde) in enumerate(zip(rows, stochastic, strict=True)):
            row.x = drawn[i]
            row.chain.append(host[i].copy())  # a view would keep the whole batch's array alive
            row.logprobs.append(logprobs[i] if sde else 0.0)
            row.versions.append(self._serving)
            (finished if row.done else running).append(row)
        if finished:
            images = gen.decode(torch.stack([row.x for row in finished]))  # type: ignore[misc]
            for row, image in zip(finished, images, strict=True):
                row.call.deliver(self._to_trajectory(row, image))
        return running

    def _to_trajectory(self, row: _Row, image: np.ndarray) -> Trajectory:
        request = row.request
        payload = ImagePayload(
            prompt=request.prompt,
            latents=np.stack(row.chain),
            sigmas=list(row.sigmas),
            sde=list(request.sde),
            noise_level=self.noise_level,
            guidance_scale=self.guidance_scale,
            image=image.copy(),  # not a view of the decoded batch
        )
        return Trajectory(
            prompt_id=request.prompt_id,
            index=request.index,
            behaviour_logprobs=row.logprobs,
            versions=row.versions,
            start_version=row.versions[0],
            finish_reason=FinishReason.LENGTH,  # a denoising run always ends at its step budget
            payload=payload,
            loss_mask=[int(sde) for sde in request.sde],
            metrics={"version_span": float(row.versions[-1] - row.versions[0])},
        )
