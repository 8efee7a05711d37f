"""A megatron-core train rank: a Llama/Qwen2 ``GPTModel`` converted from the HF checkpoint, one rank of a trainer group.

What it owns: one rank of an ``engines.trainers.group`` group (``engines.train: megatron``): its
place in megatron's parallel state (``engines.trainers.megatron.parallel.model_parallel``: tensor
parallel ``T`` from the spec, data parallel ``N / T``, pipeline parallel 1), its tensor-parallel
shard of the ``GPTModel`` (weights from the HF checkpoint, ``engines.trainers.megatron.convert``), and its
optimizer, AdamW with the linear warm-up of ``TorchTrainEngine``, in one of two forms:

- **CUDA**: megatron's own: ``DistributedDataParallel`` (gradients in contiguous buffers,
  reduce-scattered over the data-parallel group) and its distributed optimizer (each data-parallel
  rank keeps the fp32 main weights and Adam moments of its ``1/N`` of the buffer);
- **CPU**: megatron's DDP wrapper and distributed optimizer allocate their buffers on CUDA, so here
  a torch AdamW steps this rank's tensor-parallel shards, after one flat all-reduce of the
  gradients over the data-parallel group (``engines.trainers.ddp.all_reduce_gradients``). Every
  data-parallel replica then holds the same weights and moments: the arithmetic is the
  distributed optimizer's, its memory saving is not.

Invariants:
- gradients are summed over data-parallel ranks (the micro-batch weights already make the sum the
  step's gradient): megatron's DDP is told the loss is per token (``calculate_per_token_loss``), so
  it does not divide by the data-parallel size;
- the gradient norm is the whole model's: sharded tensors count on every tensor-parallel rank,
  replicated ones (norms) once, summed over the tensor-parallel group; clipping scales by
  ``max_norm / (norm + 1e-6)`` as ``torch.nn.utils.clip_grad_norm_`` does;
- gathered weights (param sync, export) are full HF-named tensors, all-gathered over the first
  data-parallel replica's tensor-parallel group (other replicas hold the same weights and skip it);
- checkpoints hold full HF-named weights and Adam moments plus the step count, written by rank 0
  and loadable by a group of any data- and tensor-parallel size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from transformers import AutoModelForCausalLM

from tandem.core.protocols import LossObjective
from tandem.core.records import Trajectory
from tandem.engines.shared.microbatch import MicroBatch
from tandem.engines.trainers.ddp import all_reduce_gradients
from tandem.engines.trainers.group import RankSpec
from tandem.engines.trainers.loss_loop import StepTotals, accumulate, score
from tandem.engines.trainers.megatron.convert import build_gpt_model, gather_hf_tensors, hf_to_megatron, load_hf_weights
from tandem.engines.trainers.megatron.model import response_logprobs
from tandem.engines.trainers.megatron.parallel import model_parallel

__all__ = ["MegatronRank"]

_MOMENTS = ("exp_avg", "exp_avg_sq")


class MegatronRank:
    """One megatron-core rank (a ``engines.trainers.group.RankEngine``)."""

    state_file = "trainer_megatron.pt"

    def __init__(self, spec: RankSpec, *, rank: int, world_size: int, init_method: str, device: torch.device) -> None:
        self._spec = spec
        self._rank = rank
        self._device = device
        self.version = 0
        self._steps = 0  # optimizer steps taken: the LR schedule's position
        self._undo = ExitStack()
        try:
            self._undo.enter_context(
                model_parallel(
                    rank=rank, world_size=world_size, init_method=init_method,
                    tensor_parallel_size=spec.tensor_parallel_size, seed=spec.seed, device=device,
                )
            )  # fmt: skip
            hf = AutoModelForCausalLM.from_pretrained(spec.model_path, dtype=spec.torch_dtype)
            model, self._layout = build_gpt_model(hf.config, dtype=spec.torch_dtype, device=device)
            load_hf_weights(model, hf.state_dict(), self._layout)
            del hf
            self._model = model.eval()
            self._optimizer = _DistributedOptimizer(model, spec) if device.type == "cuda" else _ShardOptimizer(model, spec)
        except BaseException:
            self._undo.close()
            raise

    def _forward(self, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return response_logprobs(self._optimizer.module, batch, self._spec.temperature)

    def score(self, samples: list[Trajectory], passes: int) -> tuple[list[list[float]], list[list[float]]]:
        # No collective spans ranks of different replicas in a forward: no filler passes.
        return score(samples, self._forward, max_tokens=self._spec.max_tokens_per_micro_batch, device=self._device)

    @property
    def optimizer_steps(self) -> int:
        return self._steps

    def accumulate(
        self, samples: list[Trajectory], objective: LossObjective, totals: StepTotals, passes: int, progress: float
    ) -> tuple[dict[str, float], int]:
        return accumulate(
            samples, self._forward, objective, totals, max_tokens=self._spec.max_tokens_per_micro_batch,
            device=self._device, version=self.version, progress=progress,
        )

    def step(self) -> float:
        lr = self._spec.lr * self._spec.lr_factor(self._steps)
        grad_norm = self._optimizer.step(lr)
        if not math.isfinite(grad_norm):
            raise FloatingPointError(f"non-finite gradient norm {grad_norm} at version {self.version}")
        self._steps += 1
        return grad_norm

    def drop_gradients(self) -> None:
        self._optimizer.zero_grad()

    def gather(self) -> Iterator[tuple[str, torch.Tensor]]:
        if parallel_state.get_data_parallel_rank() == 0:
            yield from gather_hf_tensors(dict(self._model.named_parameters()), self._layout)

    def save(self, path: Path) -> None:
        weights = dict(self._hf_named(self._optimizer.main_weights()))
        moments = {key: dict(self._hf_named(self._optimizer.moments(key))) for key in _MOMENTS} if self._steps else {}
        if self._rank == 0:
            state = {"model": weights, **moments, "steps": self._steps, "version": self.version, "rng": torch.get_rng_state()}
            torch.save(state, path)

    def load(self, path: Path) -> None:
        state = torch.load(path, map_location="cpu", weights_only=True)
        shard = {
            "rank": parallel_state.get_tensor_model_parallel_rank(),
            "size": parallel_state.get_tensor_model_parallel_world_size(),
        }
        moments = {key: hf_to_megatron(state[key], self._layout, **shard) for key in _MOMENTS if key in state}
        self._optimizer.load(hf_to_megatron(state["model"], self._layout, **shard), moments, state["steps"])
        self._steps = state["steps"]
        self.version = state["version"]
        torch.set_rng_state(state["rng"])

    def _hf_named(self, local: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """``local`` (megatron-named, this rank's shards) as full HF-named CPU tensors; a collective
        of every rank, kept by rank 0 only."""
        for name, tensor in gather_hf_tensors(local, self._layout):
            if self._rank == 0:
                yield name, tensor.detach().cpu().clone()

    def close(self) -> None:
        self._undo.close()


def _grad_norm(params: list[torch.nn.Parameter]) -> float:
    """The whole model's gradient norm from this rank's shards: see the module docstring."""
    dtype = torch.promote_types(torch.float32, params[0].dtype)  # no narrower than the weights
    squares = torch.zeros((), dtype=dtype, device=params[0].device)
    for p in params:
        if p.grad is not None and param_is_not_tensor_parallel_duplicate(p):
            squares += p.grad.to(dtype).pow(2).sum()
    dist.all_reduce(squares, group=parallel_state.get_tensor_model_parallel_group())
    return float(squares.sqrt())


class _ShardOptimizer:
    """CPU: torch AdamW over this rank's tensor-parallel shards, gradients all-reduced over the replicas."""

    def __init__(self, model: torch.nn.Module, spec: RankSpec) -> None:
        self.module = model
        self._params = list(model.parameters())
        self._names = {p: name for name, p in model.named_parameters()}
        self._max_norm = spec.max_grad_norm
        self._adam = torch.optim.AdamW(self._params, lr=spec.lr, weight_decay=spec.weight_decay)

    def step(self, lr: float) -> float:
        if parallel_state.get_data_parallel_world_size() > 1:
            all_reduce_gradients(self.module, parallel_state.get_data_parallel_group())
        norm = _grad_norm(self._params)
        if not math.isfinite(norm):
            self.zero_grad()
            return norm
        scale = min(1.0, self._max_norm / (norm + 1e-6))
        for p in self._params:
            if p.grad is not None:
                p.grad.mul_(scale)
        for group in self._adam.param_groups:
            group["lr"] = lr
        self._adam.step()
        self.zero_grad()
        return norm

    def zero_grad(self) -> None:
        self._adam.zero_grad(set_to_none=True)

    def main_weights(self) -> dict[str, torch.Tensor]:
        return dict(self.module.named_parameters())

    def moments(self, key: str) -> dict[str, torch.Tensor]:
        return {self._names[p]: self._adam.state[p][key] for p in self._params}

    def load(self, weights: Mapping[str, torch.Tensor], moments: Mapping[str, Mapping[str, torch.Tensor]], steps: int) -> None:
        with torch.no_grad():
            for name, p in self.module.named_parameters():
                p.copy_(weights[name])
        self._adam.state.clear()
        if moments:
            for name, p in self.module.named_parameters():
                self._adam.state[p] = {
                    "step": torch.tensor(float(steps)),
                    **{key: moments[key][name].to(p.device, p.dtype).clone() for key in _MOMENTS},
                }


class _DistributedOptimizer:
    """CUDA: megatron's ``DistributedDataParallel`` and distributed optimizer (see the module docstring).

    Full per-parameter tensors for checkpoints come from each data-parallel rank's range of every
    parameter, summed over the data-parallel group (each element is owned by one rank).
    """

    def __init__(self, model: Any, spec: RankSpec) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        model.config.calculate_per_token_loss = True  # sum over data-parallel ranks (module docstring)
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
        self.module = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
        self._model = model
        self._optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=spec.lr, weight_decay=spec.weight_decay, clip_grad=spec.max_grad_norm,
                bf16=spec.torch_dtype == torch.bfloat16, params_dtype=spec.torch_dtype, use_distributed_optimizer=True,
            ),
            [self.module],
        )  # fmt: skip
        self._parts = list(getattr(self._optimizer, "chained_optimizers", [self._optimizer]))

    def step(self, lr: float) -> float:
        self.module.finish_grad_sync()  # reduce-scatter the summed gradients into each rank's range
        self._optimizer.prepare_grads()
        norm = float(self._optimizer.get_grad_norm())
        if not math.isfinite(norm):
            self.zero_grad()
            return norm
        for group in self._optimizer.param_groups:
            group["lr"] = lr
        self._optimizer.step()  # clips by the same norm, steps, gathers the updated weights
        self.zero_grad()
        return norm

    def zero_grad(self) -> None:
        self.module.zero_grad_buffer()
        self._optimizer.zero_grad()

    def _owner(self, param: torch.nn.Parameter) -> Any:
        return next(part for part in self._parts if param in part.model_param_gbuf_map)

    def _full(self, key: str) -> dict[str, torch.Tensor]:
        """Each parameter's fp32 main weight (``param``) or Adam moment, whole on every replica."""
        out = {}
        for name, p in self._model.named_parameters():
            part = self._owner(p)
            piece = part._get_model_param_range_map(p)["param"]
            flat = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
            flat[piece.start : piece.end] = part._get_main_param_and_optimizer_states(p)[key].detach().float()
            dist.all_reduce(flat, group=parallel_state.get_data_parallel_group())
            out[name] = flat.view(p.shape)
        return out

    def main_weights(self) -> dict[str, torch.Tensor]:
        return self._full("param")

    def moments(self, key: str) -> dict[str, torch.Tensor]:
        return self._full(key)

    def load(self, weights: Mapping[str, torch.Tensor], moments: Mapping[str, Mapping[str, torch.Tensor]], steps: int) -> None:
        for part in self._parts:
            if part.init_state_fn is not None:  # Adam's moments exist before its first step
                part.init_state_fn(part.optimizer, part.config)
        with torch.no_grad():
            for name, p in self._model.named_parameters():
                p.copy_(weights[name])
                part = self._owner(p)
                piece = part._get_model_param_range_map(p)["param"]
                for key, live in part._get_main_param_and_optimizer_states(p).items():
                    if key == "param" or moments:
                        full = weights[name] if key == "param" else moments[key][name]
                        live.copy_(full.reshape(-1)[piece.start : piece.end])
                    else:  # a checkpoint from before the first step: fresh moments
                        live.zero_()
        for part in self._parts:
            for group in part.optimizer.param_groups:
                if "step" in group:  # Transformer Engine's and apex's Adam count per group
                    group["step"] = steps
                for main in group["params"]:
                    if "step" in part.optimizer.state[main]:
                        part.optimizer.state[main]["step"] = torch.tensor(float(steps))
