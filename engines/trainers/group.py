"""Trainer groups: N train ranks behind one ``TrainEngine``, as processes spawned here or as Ray actors.

What it owns: the driver side of a group of train ranks (:class:`TrainerGroup`, the train engine
the flow sees), the rank side that serves it (:class:`RankServer`), the messages between them,
and the two ways to host ranks: processes spawned by this process (:class:`LocalRanks`) or Ray
actors placed one per slot (:class:`RayRanks`). Each rank's model, optimizer and collectives are
a :class:`RankEngine` the rank builds from a :class:`RankSpec`: torch FSDP2 over any
transformers model (``engines.trainers.fsdp.FSDPRank``) or megatron-core (``engines.trainers.megatron.engine.
MegatronRank``). The driver holds no weights and joins no process group: every rank is a
process of its own, with ``torch.distributed``'s default group over the ranks (gloo on CPU,
NCCL on GPU).

A train step takes one optimizer step per mini-batch of its plan (``engines.trainers.
optimizer_steps``); an optimizer step, as the driver runs it:
1. the mini-batch's trained trajectories are split across the data-parallel replicas balanced
   by tokens (:func:`balance`); the tensor-parallel ranks of one replica get the same share;
   every rank is told ``passes``, the most micro-batches any rank has, so an engine whose
   forward is a collective (FSDP2 all-gathers weights in it) runs equally many on every rank;
2. every rank accumulates its share's gradient, each micro-batch loss weighted by its share of
   the whole mini-batch's trained tokens or sequences (``StepTotals``), so the sum over ranks is
   the one-process gradient; it replies with its weighted metric sums;
3. only when every rank has replied does the driver send :class:`Step`: ``proceed`` when all
   succeeded (every rank reduces the gradients, clips by the same global norm and steps), else
   every rank drops its gradient and the step raises, naming the rank that failed;
4. every rank replies its gradient norm; they must be equal.
After the train step's last optimizer step, :class:`Publish` moves every rank's version on by one.

Weights for param sync: :class:`Gather` makes every rank take part in gathering full Hugging
Face-named tensors (FSDP2 unshards, megatron all-gathers its tensor-parallel shards); global
rank 0 copies them into its *staging* buffer, allocated at the first gather. Ranks spawned here
put the staging in shared memory, so the driver's ``weights_for_sync`` reads it without a copy;
on Ray, rank 0's actor sends the staging to the rollout actors itself.

With a LoRA adapter (``RankSpec.lora``; FSDP2 and DDP ranks, :class:`AdapterRank`) every rank
wraps its model with peft before sharding it, the adapter's A drawn from ``RankSpec.seed`` on
every rank; only the adapter trains and sits in the optimizer; a gather, the staging, the
checkpoints and the export hold the adapter's tensors alone, under peft's saved names
(``engines.shared.lora``). The KL reference is the base with the adapter disabled, scored by the
ranks (:meth:`TrainerGroup.base_reference`); the driver records the probe's log-probs at every
version the group reaches (:attr:`TrainerGroup.probe`), as the one-process trainer does under its
weights lock, for the sync's proof of arrival (``engines.shared.probe``).

Invariants:
- one version for the group: it moves by one per train step, only after every rank took the
  step's last optimizer step;
- no rank enters a collective unless every rank will: gradient reduction starts after all
  ranks reported, and a failure before it, at a train step's first optimizer step, leaves the
  group usable (a failure after it leaves the weights between versions: the group is broken);
- a rank that dies fails the call in progress with ``TrainRankError`` naming it (a death is
  blamed before the collective errors it causes on other ranks), and so does a rank of a local
  group still silent ``ANSWER_AFTER_FAILURE_S`` after another rank's failure (a live rank
  reaches its next collective and fails there within ``RANK_TIMEOUT``; one that does not is
  hung, and the error quotes where: each rank writes its threads' stacks on ``SIGUSR1``); the
  group is broken from then on: the dead rank's shard of the optimizer state is gone, so a run
  goes on only from a checkpoint, with any number of ranks (checkpoints hold full, unsharded
  tensors);
- the driver talks to the ranks from one worker thread, so steps, scoring, gathers and
  checkpoints never interleave and the flow's event loop only awaits; a probe record of a
  version is written on that thread in the job that made the version (a train step, a restore),
  so no gather of the version can run before it is there.
"""

from __future__ import annotations

import asyncio
import faulthandler
import json
import math
import multiprocessing as mp
import os
import pickle
import signal
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import torch
import torch.distributed as dist

from tandem.algorithms.metrics import merge_metric_sums
from tandem.core.config import TandemConfig, TorchEnginesConfig, import_named
from tandem.core.protocols import LossObjective
from tandem.core.records import Trajectory
from tandem.engines.shared.lora import BaseModelReference, save_adapter, with_adapter
from tandem.engines.shared.microbatch import token_payload
from tandem.engines.shared.probe import ProbeRecord, probe_sequence
from tandem.engines.shared.threads import ClosesOnAThread, apply_thread_budget
from tandem.engines.trainers.loss_loop import StepTotals, check_trainable, micro_batch_plan
from tandem.engines.trainers.optimizer_steps import step_parts, take_optimizer_steps

if TYPE_CHECKING:
    import peft

__all__ = [
    "RANK_ENGINES",
    "AdapterRank",
    "LocalRanks",
    "RankEngine",
    "RankServer",
    "RankSpec",
    "RayRanks",
    "Staging",
    "TrainRankError",
    "TrainerGroup",
    "balance",
    "free_address",
    "join_rank_group",
    "preloaded_modules",
    "rank_device",
    "rank_optimizer",
    "save_hf_folder",
    "start_rank",
]

_T = TypeVar("_T")
# Bounds a rank's collectives when another rank hangs without dying (a dead rank is seen at once).
RANK_TIMEOUT = timedelta(seconds=120)
# How long the driver waits for the other ranks once one has replied Failed: a live rank gets to
# its next collective, finds the failed rank absent and fails within RANK_TIMEOUT; twice that
# leaves it the time to reach the collective. A rank silent past it is hung.
ANSWER_AFTER_FAILURE_S = 2 * RANK_TIMEOUT.total_seconds()
# The rank engines by the config's name for them ("module:Class", imported in the rank only).
RANK_ENGINES = {
    "ddp": "tandem.engines.trainers.ddp:DDPRank",
    "fsdp2": "tandem.engines.trainers.fsdp:FSDPRank",
    "megatron": "tandem.engines.trainers.megatron.engine:MegatronRank",
}
# How long close() lets a rank leave on end-of-file (or a broken group's rank, stuck in a
# collective, be) before killing it.
_EXIT_TIMEOUT_S = 10.0
_BROKEN_EXIT_TIMEOUT_S = 1.0
_STACKS_TIMEOUT_S = 5.0  # how long a rank may take to write its stacks on SIGUSR1
_ALIGN = 64  # byte alignment of each tensor in the staging buffer
# How long Ray rank actors may take to be placed, load the model and join the group.
_RAY_START_TIMEOUT_S = 600.0


class TrainRankError(RuntimeError):
    """A train rank of a group failed or died; ``rank`` names it."""

    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(f"train rank {rank} {detail}")
        self.rank = rank


def balance(costs: list[int], parts: int) -> list[list[int]]:
    """Split indices of ``costs`` into ``parts`` lists of near-equal total cost (longest first, each
    to the least loaded part, ties to the lowest part): a step waits for its slowest rank."""
    loads = [0] * parts
    shares: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        part = min(range(parts), key=loads.__getitem__)
        shares[part].append(i)
        loads[part] += costs[i]
    return shares


@dataclass(frozen=True, slots=True)
class RankSpec:
    """Everything a rank needs to build its engine (picklable: it travels to processes and actors)."""

    engine: str  # a key of RANK_ENGINES
    model_path: str
    device: str  # "cpu", or "cuda": each rank then takes the GPU of its local rank
    dtype: str  # "float32" | "bfloat16" | "float16" (and "float64": tests comparing steps exactly)
    temperature: float
    lr: float
    weight_decay: float
    warmup_steps: int
    max_grad_norm: float
    max_tokens_per_micro_batch: int
    num_threads: int
    tensor_parallel_size: int = 1
    seed: int = 0  # also draws a LoRA adapter's A, the same on every rank
    lora: peft.LoraConfig | None = None  # train this adapter on the frozen base (an AdapterRank engine)

    @classmethod
    def from_config(
        cls, config: TandemConfig, model_path: str, num_threads: int, lora: peft.LoraConfig | None = None
    ) -> RankSpec:
        """The ranks a torch config describes (``engines.trainers.group`` names their engine);
        ``lora``: peft's settings for ``engines.lora``, trained at ``engines.lora.lr``."""
        spec = config.engines
        assert isinstance(spec, TorchEnginesConfig) and spec.trainer_group is not None
        lr = spec.lora.lr if lora is not None and spec.lora is not None and spec.lora.lr is not None else spec.lr
        return cls(
            engine=spec.trainer_group, model_path=model_path, device=spec.device, dtype=spec.dtype,
            temperature=config.rollout.temperature, lr=lr, weight_decay=spec.weight_decay,
            warmup_steps=spec.warmup_steps, max_grad_norm=spec.max_grad_norm,
            max_tokens_per_micro_batch=spec.max_tokens_per_micro_batch, num_threads=num_threads,
            tensor_parallel_size=spec.tensor_parallel_size, seed=config.run.seed, lora=lora,
        )  # fmt: skip

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def lr_factor(self, step: int) -> float:
        """Linear warm-up to the full LR over optimizer steps, as ``TorchTrainEngine``'s schedule."""
        return 1.0 if self.warmup_steps == 0 else min(1.0, (step + 1) / self.warmup_steps)


def join_rank_group(*, rank: int, world_size: int, init_method: str, device: torch.device) -> None:
    """Join the group's default process group (NCCL on a GPU, which this rank then uses; gloo on
    CPU), with a bounded collective timeout: a rank that hangs without dying fails the others."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=RANK_TIMEOUT)


def rank_optimizer(spec: RankSpec, model: torch.nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW and the warm-up schedule of ``TorchTrainEngine``, from the spec, over ``model``'s
    trained parameters (all of them, or an adapter's alone: its state stays the adapter's size)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=spec.lr, weight_decay=spec.weight_decay)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: spec.lr_factor(step))


def rank_device(device: str, local_rank: int) -> torch.device:
    """A rank's device: ``cuda`` means the GPU numbered by the rank on its machine (a Ray actor
    sees only its own GPU, as number 0); anything else is taken as it is."""
    return torch.device(f"cuda:{local_rank}") if device == "cuda" else torch.device(device)


class RankEngine(Protocol):
    """One rank's model, optimizer and collectives; every method that is a collective must be
    called on every rank of the group, in the same order."""

    version: int  # train steps taken: the rank server moves it on once a train step's optimizer steps are taken
    state_file: str  # the file its checkpoints write into a checkpoint folder

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps taken (checkpointed): the LR schedule's position."""
        ...

    def score(self, samples: list[Trajectory], passes: int) -> tuple[list[list[float]], list[list[float]]]:
        """Log-probs and entropies of ``samples``' response tokens (``passes``: as ``accumulate``)."""
        ...

    def accumulate(
        self, samples: list[Trajectory], objective: LossObjective, totals: StepTotals, passes: int, progress: float
    ) -> tuple[dict[str, float], int]:
        """Add the weighted gradient of ``samples``; returns metric sums and micro-batches. ``passes``
        is the most micro-batches any rank runs (engines in lockstep pad to it); ``progress`` the
        share of the train step's optimizer steps taken (``loss_loop.loss_inputs``)."""
        ...

    def step(self) -> float:
        """Reduce gradients over the group, clip, take the optimizer step (and the LR schedule's),
        zero; returns the pre-clip norm. A non-finite norm drops the gradient and raises
        ``FloatingPointError`` (on every rank). The version is not the engine's to move."""
        ...

    def drop_gradients(self) -> None: ...

    def gather(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named weights (each storage once, ``param_sync.unique_weights``' names), or with
        ``RankSpec.lora`` the adapter's whole tensors under peft's saved names, walked by every
        rank to the end; ranks that take no part in the gather yield nothing. A yielded tensor is
        valid until the next one is asked for (an engine may free it then): copy what must stay."""
        ...

    def save(self, path: Path) -> None:
        """Write full (unsharded) weights (an adapter's alone), optimizer state, schedule and version
        to ``path`` (rank 0 writes)."""
        ...

    def load(self, path: Path) -> None:
        """Load what ``save`` wrote, from a group of any size."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class AdapterRank(Protocol):
    """A rank engine that trains a LoRA adapter (``RankSpec.lora``): its ``gather``, ``save`` and
    ``load`` carry the adapter alone; it also scores the base and the weight probe."""

    def score_base(self, samples: list[Trajectory], passes: int) -> tuple[list[list[float]], list[list[float]]]:
        """As ``score``, with the adapter disabled: the KL reference."""
        ...

    def probe(self, token_ids: list[int]) -> list[float]:
        """The probe's log-probs under the current weights (``engines.shared.probe.probe_logprobs``);
        a collective where a forward is (every rank calls it)."""
        ...


def save_hf_folder(
    model_path: str, tensors: dict[str, torch.Tensor], folder: Path, lora: peft.LoraConfig | None = None
) -> None:
    """Write ``tensors`` (full HF-named weights) as a Hugging Face model folder with ``model_path``'s
    config, loadable by ``from_pretrained``; with ``lora``, ``tensors`` is the adapter (peft's saved
    names), written in peft's format (``PeftModel.from_pretrained`` on the base). The architecture
    is built on the meta device (no copy)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    folder.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().cpu() for name, t in tensors.items()}
    if lora is None:
        model.save_pretrained(folder, state_dict=state)
    else:
        save_adapter(with_adapter(model, lora), state, folder)


# ---------------------------------------------------------------- messages: driver -> rank


@dataclass(slots=True)
class Score:
    samples: list[Trajectory]
    passes: int
    base: bool = False  # with the adapter disabled (an AdapterRank's KL reference)


@dataclass(slots=True)
class Accumulate:
    samples: list[Trajectory]
    passes: int
    objective: bytes  # pickled once per train step for every rank
    totals: StepTotals
    progress: float  # the share of the train step's optimizer steps taken before this one


@dataclass(slots=True)
class Step:
    """``proceed``: reduce and step; otherwise a rank failed: drop this step's gradient."""

    proceed: bool


@dataclass(slots=True)
class Publish:
    """The train step's optimizer steps are all taken: the version moves on by one."""


@dataclass(slots=True)
class Gather:
    """Gather the full weights; rank 0 copies them into its staging."""


@dataclass(slots=True)
class Probe:
    """Score the weight probe's token ids under the current weights (an AdapterRank)."""

    token_ids: list[int]


@dataclass(slots=True)
class Save:
    folder: str


@dataclass(slots=True)
class Load:
    folder: str


@dataclass(slots=True)
class Export:
    """Gather the full weights; rank 0 writes them as a Hugging Face folder."""

    folder: str


# ---------------------------------------------------------------- messages: rank -> driver


@dataclass(slots=True)
class Ready:
    version: int
    state_file: str  # the engine's file in a checkpoint folder


@dataclass(slots=True)
class Scored:
    logprobs: list[list[float]]
    entropies: list[list[float]]


@dataclass(slots=True)
class Accumulated:
    sums: dict[str, float]
    micro_batches: int


@dataclass(slots=True)
class Stepped:
    """The pre-clip global gradient norm (NaN/inf: every rank dropped the step) and the optimizer
    steps taken after it."""

    grad_norm: float
    optimizer_steps: int


@dataclass(slots=True)
class Gathered:
    """Rank 0: the version gathered and, the first time (ranks spawned here), its staging buffer."""

    version: int
    staging: Staging | None = None


@dataclass(slots=True)
class Done:
    version: int


@dataclass(slots=True)
class Probed:
    logprobs: list[float]


@dataclass(slots=True)
class Failed:
    """The rank raised; ``traceback`` is its formatted traceback."""

    traceback: str


# ---------------------------------------------------------------- the staging buffer


@dataclass(slots=True)
class Staging:
    """Full HF-named weights in one flat byte buffer (shared memory when a driver in another
    process reads it): ``layout`` is (name, dtype, shape, byte offset) per tensor, in gather order."""

    buffer: torch.Tensor
    layout: list[tuple[str, torch.dtype, tuple[int, ...], int]]
    _views: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def allocate(cls, tensors: Sequence[tuple[str, torch.Tensor]], *, shared: bool) -> Staging:
        layout, offset = [], 0
        for name, tensor in tensors:
            layout.append((name, tensor.dtype, tuple(tensor.shape), offset))
            offset += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
        buffer = torch.empty(offset, dtype=torch.uint8)
        return cls(buffer.share_memory_() if shared else buffer, layout)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Views of the buffer, by name."""
        if not self._views:
            for name, dtype, shape, offset in self.layout:
                nbytes = math.prod(shape) * dtype.itemsize
                self._views[name] = self.buffer[offset : offset + nbytes].view(dtype).view(shape)
        return self._views

    def __getstate__(self) -> tuple[torch.Tensor, list[tuple[str, torch.dtype, tuple[int, ...], int]]]:
        return self.buffer, self.layout  # the views are rebuilt on the other side

    def __setstate__(self, state: tuple[torch.Tensor, list[tuple[str, torch.dtype, tuple[int, ...], int]]]) -> None:
        self.buffer, self.layout = state
        self._views = {}


# ---------------------------------------------------------------- the rank side


class RankServer:
    """A rank: builds its engine from the spec, joins the group, and answers the driver's messages.

    ``share_staging``: rank 0 hands its staging buffer (in shared memory) to a driver in another
    process; on Ray it keeps it and sends it to the rollout actors itself (:meth:`weights_for_sync`).
    """

    def __init__(
        self, spec: RankSpec, *, rank: int, world_size: int, init_method: str, local_rank: int, share_staging: bool
    ) -> None:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a rank's loads and exports would interleave bars with the run's display
        apply_thread_budget(spec.num_threads)
        engine_class = import_named(RANK_ENGINES[spec.engine], "engines.train")
        if spec.lora is not None and not issubclass(engine_class, AdapterRank):
            raise ValueError(
                f"engines.lora: {spec.engine} ranks train no adapter (engines.train=torch with engines.data_parallel=fsdp2 "
                "or ddp do)"
            )
        self.spec = spec
        self.rank = rank
        self.engine: RankEngine = engine_class(
            spec, rank=rank, world_size=world_size, init_method=init_method, device=rank_device(spec.device, local_rank)
        )
        self._share = share_staging
        self._staging: Staging | None = None
        self._staged_version = -1
        self._staging_lock = threading.Lock()

    def handle(self, message: object) -> object:
        """The reply to one message; an exception becomes :class:`Failed` (the rank lives on)."""
        try:
            return self._handle(message)
        except Exception:
            return Failed(traceback.format_exc())

    def _handle(self, message: object) -> object:
        engine = self.engine
        if isinstance(message, Score) and message.base:
            return Scored(*self._adapter_rank().score_base(message.samples, message.passes))
        if isinstance(message, Score):
            return Scored(*engine.score(message.samples, message.passes))
        if isinstance(message, Probe):
            return Probed(self._adapter_rank().probe(message.token_ids))
        if isinstance(message, Accumulate):
            engine.drop_gradients()
            objective = pickle.loads(message.objective)
            return Accumulated(
                *engine.accumulate(message.samples, objective, message.totals, message.passes, message.progress)
            )
        if isinstance(message, Step):
            if not message.proceed:
                engine.drop_gradients()
                return Stepped(math.nan, engine.optimizer_steps)
            try:
                norm = engine.step()
            except FloatingPointError:  # every rank sees the same norm; the driver raises it
                norm = math.nan
            return Stepped(norm, engine.optimizer_steps)
        if isinstance(message, Publish):
            engine.version += 1
            return Done(engine.version)
        if isinstance(message, Gather):
            return self._gather()
        if isinstance(message, Save):
            engine.save(Path(message.folder) / engine.state_file)
            return Done(engine.version)
        if isinstance(message, Load):
            engine.load(Path(message.folder) / engine.state_file)
            return Done(engine.version)
        if isinstance(message, Export):
            # Every rank walks the gather; rank 0 keeps copies (a yielded tensor lives one item).
            tensors = {name: t.detach().cpu().clone() for name, t in engine.gather() if self.rank == 0}
            if self.rank == 0:
                save_hf_folder(self.spec.model_path, tensors, Path(message.folder), self.spec.lora)
            return Done(engine.version)
        raise TypeError(f"rank {self.rank}: unexpected message {message!r}")

    def _adapter_rank(self) -> AdapterRank:
        if self.spec.lora is None:
            raise TypeError(f"rank {self.rank}: {type(self.engine).__name__} trains no LoRA adapter here")
        assert isinstance(self.engine, AdapterRank)  # checked at the start
        return self.engine

    def _gather(self) -> Gathered:
        with self._staging_lock:
            walked = self.engine.gather()
            if self.rank != 0:
                for _ in walked:  # take part in the collectives
                    pass
                return Gathered(self.engine.version)
            first = self._staging is None
            if first:
                tensors = [(name, t.detach().cpu().clone()) for name, t in walked]
                self._staging = Staging.allocate(tensors, shared=self._share)
                walked = iter(tensors)
            views = self._staging.tensors()  # type: ignore[union-attr]
            for name, tensor in walked:
                views[name].copy_(tensor)
            self._staged_version = self.engine.version
            return Gathered(self._staged_version, self._staging if first and self._share else None)

    # ------------------------------------------------------------ rank 0's staging as a sync source (Ray)

    @property
    def version(self) -> int:
        """The version of the staged weights (what a sync from the staging sends)."""
        return self._staged_version

    @contextmanager
    def weights_for_sync(self) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """The staged weights and their version; no gather overwrites them during the block."""
        with self._staging_lock:
            if self._staging is None:
                raise RuntimeError("nothing is staged: gather the group's weights first")
            yield self._staged_version, self._staging.tensors()

    def close(self) -> None:
        self.engine.close()


def start_rank(
    spec: RankSpec, *, rank: int, world_size: int, init_method: str, local: bool
) -> tuple[RankServer | None, Ready | Failed]:
    """Build rank ``rank`` (joining the group) and its first reply. ``local``: in a process spawned
    by the driver's machine (the GPU of the local rank; staging shared with the driver), else a
    Ray actor (its one GPU; staging kept)."""
    try:
        server = RankServer(
            spec, rank=rank, world_size=world_size, init_method=init_method, local_rank=rank if local else 0, share_staging=local
        )
    except Exception:
        return None, Failed(traceback.format_exc())
    return server, Ready(server.engine.version, server.engine.state_file)


def _serve_process(
    spec: RankSpec, rank: int, world_size: int, init_method: str, conn: Connection, stacks: str
) -> None:
    """A rank process: build the engine, report, serve the driver until end-of-file. ``SIGUSR1``
    writes every thread's stack to the file ``stacks`` (where a rank that does not answer is)."""
    # Ctrl-C reaches the whole process group; the driver decides when ranks stop (end-of-file).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stack_file = open(stacks, "w")  # open for the process's life: the handler writes to its descriptor
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    server, reply = start_rank(spec, rank=rank, world_size=world_size, init_method=init_method, local=True)
    conn.send(reply)
    if server is None:
        return
    try:
        while True:
            conn.send(server.handle(conn.recv()))
    except (EOFError, OSError):  # the driver closed the group or died (a reset pipe is an OSError)
        pass
    finally:
        server.close()


# ---------------------------------------------------------------- where the ranks live


class RankSet(Protocol):
    """The ranks of a group, as the driver reaches them."""

    @property
    def size(self) -> int: ...

    def exchange(self, messages: Sequence[object]) -> list[object]:
        """Send rank ``r`` ``messages[r]`` and return every reply (``Failed`` ones included); raises
        ``TrainRankError`` naming a rank that died, as soon as its death is seen."""
        ...

    def close(self, *, broken: bool) -> None: ...


@dataclass(slots=True)
class _Process:
    rank: int
    process: BaseProcess
    conn: Connection


def _rank_context(spec: RankSpec) -> BaseContext:
    """Where rank processes come from: forks of one fork server (``forkserver``) that imported the
    rank engine's module, and with it torch and transformers, once, and the transformers module
    of the model's architecture.

    A spawned rank spends most of its start importing them: measured on 2 cores, six fsdp2 ranks
    took 44 CPU-s spawned, against 16 forked (the server's start included). The architecture's
    module is not among the engine's imports (``from_pretrained`` imports it on first use, and with
    it torch._dynamo and transformers' generation code): it was most of a forked rank's start, the
    two ranks of an fsdp2 group of the tiny test model took 4 CPU-s to start, 0.5 with it preloaded.
    A fork is safe there and only there: the server is a fresh interpreter that imported modules and
    never ran torch, while a torch that has computed (this process) keeps OpenMP and thread pools a
    forked child cannot use. The server starts with the first group and lives as long as this
    process, its modules fixed then: a later group of another engine or architecture imports them in
    each rank. A rank has the environment variables of the server's start; its sys.path and working
    folder are this process's at the rank's start, as with ``spawn``."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(preloaded_modules(spec))  # no effect once the server runs
    return context


def preloaded_modules(spec: RankSpec) -> list[str]:
    """The modules a fork server for ``spec``'s ranks imports: the rank engine's, and the
    transformers module that defines the architecture of the model folder's ``config.json``. A
    model it cannot read here (no such folder, a Hub name) or one that transformers does not ship
    (its own code) preloads no architecture: the ranks import what they need, or report why not."""
    engine = RANK_ENGINES[spec.engine].split(":")[0] if spec.engine in RANK_ENGINES else __name__  # else the rank names the error
    try:
        model_type = json.loads((Path(spec.model_path) / "config.json").read_text())["model_type"]
    except (OSError, ValueError, KeyError, TypeError):
        return [engine]
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    name = model_type_to_module_name(model_type)
    return [engine, f"transformers.models.{name}.modeling_{name}"]  # the server skips one that fails to import


class LocalRanks:
    """Rank processes started here (forked from a fork server, see :func:`_rank_context`;
    daemonic: they end with this process), one pipe each, rendezvousing through a file in a
    temporary folder this object owns."""

    def __init__(self, spec: RankSpec, world_size: int) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="tandem-train-group-")
        init_method = f"file://{Path(self._folder.name) / 'rendezvous'}"
        context = _rank_context(spec)
        self._ranks: list[_Process] = []
        for rank in range(world_size):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=_serve_process,
                args=(spec, rank, world_size, init_method, theirs, str(self._stacks_file(rank))),
                name=f"tandem-train-rank{rank}",
                daemon=True,
            )
            process.start()
            theirs.close()  # else our copy keeps the pipe open and hides the rank's death
            self._ranks.append(_Process(rank, process, ours))

    @property
    def size(self) -> int:
        return len(self._ranks)

    @property
    def processes(self) -> list[BaseProcess]:
        return [r.process for r in self._ranks]

    def started(self) -> list[object]:
        """Every rank's first reply: :class:`Ready`, or :class:`Failed` if it could not build its engine."""
        return self._collect()

    def exchange(self, messages: Sequence[object]) -> list[object]:
        for r, message in zip(self._ranks, messages, strict=True):
            try:
                r.conn.send(message)
            except OSError:  # BrokenPipeError and kin: the rank is gone
                raise self._died(r) from None
        return self._collect()

    def _collect(self) -> list[object]:
        replies: dict[int, object] = {}
        failure: tuple[int, Failed] | None = None  # the first rank that replied Failed, and its reply
        deadline = math.inf  # for the others' replies, once a rank has failed
        while len(replies) < len(self._ranks):
            # Only ranks still owing a reply can die mid-exchange: one that replied is done with
            # this phase (a death after that shows at the next exchange).
            pending = [r for r in self._ranks if r.rank not in replies]
            timeout = None if failure is None else max(0.0, deadline - time.monotonic())
            ready = wait([r.conn for r in pending] + [r.process.sentinel for r in pending], timeout)
            if not ready:
                assert failure is not None
                raise self._silent(pending[0], *failure)
            for r in pending:
                if r.conn in ready:  # a reply sent just before dying counts
                    try:
                        reply = replies[r.rank] = r.conn.recv()
                    except EOFError:
                        raise self._died(r) from None
                    if failure is None and isinstance(reply, Failed):
                        failure, deadline = (r.rank, reply), time.monotonic() + ANSWER_AFTER_FAILURE_S
                elif r.process.sentinel in ready:
                    raise self._died(r)
        return [replies[r.rank] for r in self._ranks]

    def _died(self, r: _Process) -> TrainRankError:
        r.process.join(_EXIT_TIMEOUT_S)
        return TrainRankError(r.rank, f"died (exit code {r.process.exitcode})")

    def _silent(self, r: _Process, failed_rank: int, failure: Failed) -> TrainRankError:
        return TrainRankError(
            r.rank,
            f"did not answer within {ANSWER_AFTER_FAILURE_S:g} s of rank {failed_rank}'s failure: it is hung. Where it "
            f"is:\n{self.stacks(r.rank)}\nRank {failed_rank} failed with:\n{failure.traceback}",
        )

    def stacks(self, rank: int) -> str:
        """Where rank ``rank``'s threads are now (their stacks, which it writes on ``SIGUSR1``)."""
        r = self._ranks[rank]
        if not r.process.is_alive():
            return f"(rank {rank} has exited)"
        path = self._stacks_file(rank)
        if not path.is_file():
            return f"(rank {rank} has not set up its stack dump yet: it is starting)"
        start = path.stat().st_size
        pid = r.process.pid
        assert pid is not None  # started
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:  # it exited since is_alive()
            return f"(rank {rank} has exited)"
        # The rank's signal handler appends to the file: read once it has stopped growing.
        deadline, size = time.monotonic() + _STACKS_TIMEOUT_S, start
        while time.monotonic() < deadline:
            time.sleep(0.1)
            grown, size = size, path.stat().st_size
            if size > start and size == grown:
                break
        with path.open() as f:
            f.seek(start)
            return f.read() or f"(rank {rank} wrote no stacks within {_STACKS_TIMEOUT_S:g} s)"

    def _stacks_file(self, rank: int) -> Path:
        return Path(self._folder.name) / f"rank{rank}.stacks"

    def close(self, *, broken: bool) -> None:
        """End-of-file to every rank, then a kill after a grace period (short when ``broken``:
        its healthy ranks may wait in a collective for a dead one)."""
        for r in self._ranks:
            r.conn.close()
        grace = _BROKEN_EXIT_TIMEOUT_S if broken else _EXIT_TIMEOUT_S
        for r in self._ranks:
            r.process.join(grace)
            if r.process.is_alive():
                r.process.kill()
                r.process.join()
        self._folder.cleanup()


class RayRanks:
    """Rank actors (``engines.ray.actors.TrainRankActor``), one per slot, rank ``r`` the ``r``-th.

    Called from the group's worker thread only, so blocking on Ray here never blocks an event loop.
    """

    def __init__(self, actors: Sequence[Any], spec: RankSpec) -> None:
        import ray

        self._actors = list(actors)
        self._spec = spec
        self._ray = ray
        self._refs: list[Any] = []

    @property
    def size(self) -> int:
        return len(self._actors)

    def started(self) -> list[object]:
        """Rank 0 names the rendezvous, then every actor builds its rank and joins; a rank not
        started within ``_RAY_START_TIMEOUT_S`` (an actor Ray cannot place) is named."""
        address = self._ray.get(self._actors[0].address.remote(), timeout=_RAY_START_TIMEOUT_S)
        self._refs = [a.start.remote(self._spec, rank, len(self._actors), address) for rank, a in enumerate(self._actors)]
        return self._collect(timeout=_RAY_START_TIMEOUT_S)

    def exchange(self, messages: Sequence[object]) -> list[object]:
        self._refs = [a.handle.remote(m) for a, m in zip(self._actors, messages, strict=True)]
        return self._collect()

    def _collect(self, timeout: float | None = None) -> list[object]:
        ray = self._ray
        replies: dict[int, object] = {}
        pending = dict(enumerate(self._refs))
        while pending:
            done, _ = ray.wait(list(pending.values()), num_returns=1, timeout=timeout)
            if not done:
                rank = min(pending)
                raise TrainRankError(rank, f"did not start within {timeout:g} s (can Ray place its actor?)")
            for rank, ref in list(pending.items()):
                if ref in done:
                    del pending[rank]
                    try:
                        replies[rank] = ray.get(ref)
                    except ray.exceptions.RayActorError as exc:
                        raise TrainRankError(rank, f"died: {str(exc).splitlines()[0]}") from exc
        return [replies[rank] for rank in range(len(self._actors))]

    def close(self, *, broken: bool) -> None:
        for actor in self._actors:
            self._ray.kill(actor, no_restart=True)


# ---------------------------------------------------------------- the driver


class TrainerGroup(ClosesOnAThread):
    """The train engine of a group of ranks (implements ``TrainEngine``); see the module docstring.

    ``ranks`` are started here: the constructor waits until every rank has built its engine
    and joined the group (it raises ``TrainRankError`` naming a rank that could not). ``close()``
    stops them. With an adapter (``spec.lora``) it records the probe's log-probs at every version
    in :attr:`probe` (the sync's proof of arrival; None without).
    """

    def __init__(self, ranks: LocalRanks | RayRanks, spec: RankSpec) -> None:
        if ranks.size % spec.tensor_parallel_size:
            raise ValueError(f"{ranks.size} ranks do not split into tensor-parallel groups of {spec.tensor_parallel_size}")
        self._ranks = ranks
        self._spec = spec
        self._replicas = ranks.size // spec.tensor_parallel_size
        self._version = 0
        self._broken: Exception | None = None
        self._closed = False
        self._staging: Staging | None = None
        self._staging_lock = threading.Lock()
        self._state_file = ""  # the rank engine's, from the ranks' first replies
        self.probe = ProbeRecord(probe_sequence(_vocab_size(spec.model_path))) if spec.lora is not None else None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="train-group")
        try:
            self._on_worker_now(self._start)
        except BaseException:
            self.close()
            raise

    @classmethod
    def local(cls, spec: RankSpec, world_size: int) -> TrainerGroup:
        """A group of ``world_size`` rank processes spawned by this process."""
        return cls(LocalRanks(spec, world_size), spec)

    @property
    def size(self) -> int:
        return self._ranks.size

    @property
    def version(self) -> int:
        return self._version

    @property
    def lora(self) -> peft.LoraConfig | None:
        """The adapter's settings; None when every weight trains."""
        return self._spec.lora

    def base_reference(self) -> BaseModelReference:
        """The base model, scored by the ranks with the adapter disabled: the KL reference of a LoRA run."""
        if self._spec.lora is None:
            raise ValueError("base_reference() needs an adapter: without one the trained model is no reference")
        return BaseModelReference(self._base_logprobs)

    async def logprobs(self, trajectories: Sequence[Trajectory]) -> list[list[float]]:
        logprobs, _ = await self.logprobs_and_entropy(trajectories)
        return logprobs

    async def logprobs_and_entropy(self, trajectories: Sequence[Trajectory]) -> tuple[list[list[float]], list[list[float]]]:
        """Per-token log-probs and entropies of each trajectory's response tokens, scored by the ranks' shares."""
        return await self._on_worker(self._score, list(trajectories))

    async def train_step(
        self, batch: Sequence[Trajectory], objective: LossObjective, mini_batches: Sequence[Sequence[int]] | None = None
    ) -> dict[str, float]:
        """One version of the group trained on ``batch``, an optimizer step per mini-batch (the
        contract of ``TorchTrainEngine.train_step``); a rank that fails or dies raises
        ``TrainRankError`` naming it."""
        if objective.mean_over not in ("tokens", "sequences"):
            raise ValueError(f"objective.mean_over must be 'tokens' or 'sequences', got {objective.mean_over!r}")
        return await self._on_worker(self._train_step, list(batch), objective, mini_batches)

    async def save_state(self, folder: Path) -> None:
        """Write the engine's state file into ``folder`` (full tensors: loadable by any number of ranks)."""
        await self._on_worker(self._all, lambda: Save(str(folder)), "save the checkpoint")

    async def load_state(self, folder: Path) -> None:
        """Load the state file :meth:`save_state` wrote (by a group of any size) into every rank."""
        path = Path(folder) / self._state_file
        if not path.is_file():
            raise FileNotFoundError(
                f"{folder} has no {path.name}: it was written by another train engine (engines.train, engines.data_parallel)"
            )
        await self._on_worker(self._load, str(folder))

    def save_pretrained(self, folder: Path) -> None:
        """Export the weights as a Hugging Face model folder (rank 0 writes it). Blocks: from an event
        loop, call it through ``asyncio.to_thread``."""
        self._on_worker_now(self._all, lambda: Export(str(folder)), "export the weights")

    async def stage(self) -> int:
        """Gather the full weights into rank 0's staging; returns their version (Ray: rank 0 sends them)."""
        return await self._on_worker(self._gather)

    @contextmanager
    def weights_for_sync(self) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """Gather the group's weights (between two steps) and yield (their version, full HF-named
        tensors). Callable from any thread but the group's worker; the tensors stay unchanged
        during the block (the next gather waits for it), while training goes on."""
        with self._staging_lock:
            version = self._on_worker_now(self._gather)
            if self._staging is None:
                raise RuntimeError("a group of Ray rank actors keeps its staged weights in rank 0: sync from there")
            yield version, self._staging.tensors()

    def named_tensors_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) per weight, gathered from the ranks now."""
        with self.weights_for_sync() as (_, tensors):
            yield from tensors.items()

    def rank_stacks(self) -> dict[int, str]:
        """Where each rank's threads are now, by rank (local ranks write their stacks on
        ``SIGUSR1``): the first question about a run that stopped moving. Any thread may ask."""
        if not isinstance(self._ranks, LocalRanks):
            raise NotImplementedError("Ray rank actors: ask Ray (`ray stack`) where they are")
        return {rank: self._ranks.stacks(rank) for rank in range(self.size)}

    def close(self) -> None:
        """Finish queued work, then stop every rank; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=True)
        self._ranks.close(broken=self._broken is not None)


    async def _base_logprobs(self, trajectories: Sequence[Trajectory]) -> list[list[float]]:
        logprobs, _ = await self._on_worker(self._score, list(trajectories), True)
        return logprobs

    # ------------------------------------------------------------ worker thread only

    async def _on_worker(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.wrap_future(self._submit(fn, *args))

    def _on_worker_now(self, fn: Callable[..., _T], *args: Any) -> _T:
        return self._submit(fn, *args).result()

    def _submit(self, fn: Callable[..., _T], *args: Any) -> Future[_T]:
        if self._closed:
            raise RuntimeError("the trainer group is closed")
        return self._executor.submit(fn, *args)

    def _start(self) -> None:
        replies = self._ranks.started()
        for rank, reply in enumerate(replies):
            if isinstance(reply, Failed):
                self._broken = TrainRankError(rank, f"failed to start:\n{reply.traceback}")
                raise self._broken
            assert isinstance(reply, Ready)
            self._state_file = reply.state_file
        self._record_probe()

    def _record_probe(self) -> None:
        """The probe's log-probs at the group's current version, from rank 0 (every rank runs the
        forward: it may be a collective)."""
        if self.probe is None:
            return
        replies = self._exchange([Probe(self.probe.inputs) for _ in range(self.size)])
        for rank, reply in enumerate(replies):
            if isinstance(reply, Failed):  # the version has moved without its record: no sync could prove it
                raise self._lost(rank, f"failed to score the weight probe:\n{reply.traceback}")
        assert isinstance(replies[0], Probed)
        self.probe.record(self._version, replies[0].logprobs)

    def _load(self, folder: str) -> None:
        self._all(lambda: Load(folder), "load the checkpoint")
        self._record_probe()

    def _exchange(self, messages: Sequence[object]) -> list[object]:
        if self._broken is not None:
            raise RuntimeError(f"the trainer group is out of step since: {self._broken}") from self._broken
        try:
            return self._ranks.exchange(messages)
        except TrainRankError as exc:
            self._broken = exc
            raise

    def _lost(self, rank: int, detail: str) -> TrainRankError:
        """A rank failed where the ranks may have diverged: the group refuses to go on."""
        self._broken = TrainRankError(rank, detail)
        return self._broken

    def _all(self, message: Callable[[], object], what: str) -> None:
        """Send every rank the same message; any failure breaks the group (ranks may differ now)."""
        replies = self._exchange([message() for _ in range(self.size)])
        for rank, reply in enumerate(replies):
            if isinstance(reply, Failed):
                raise self._lost(rank, f"failed to {what}:\n{reply.traceback}")
        versions = {reply.version for reply in replies}  # type: ignore[attr-defined]
        if len(versions) != 1:
            raise self._lost(0, f"ranks disagree on the version after trying to {what}: {sorted(versions)}")
        self._version = versions.pop()

    def _shares(self, samples: list[Trajectory], indices: list[int]) -> tuple[list[list[int]], int]:
        """Indices of ``samples`` per data-parallel replica (balanced by tokens) and the most
        micro-batches any replica has."""
        costs = [len(token_payload(samples[i]).prompt_ids) + samples[i].num_actions for i in indices]
        shares = [[indices[j] for j in share] for share in balance(costs, self._replicas)]
        budget = self._spec.max_tokens_per_micro_batch
        passes = max(len(micro_batch_plan([samples[i] for i in share], budget)) for share in shares)
        return shares, passes

    def _per_rank(self, per_replica: list[_T]) -> list[_T]:
        """Each rank gets its replica's item (tensor-parallel ranks are adjacent: megatron's order)."""
        return [per_replica[rank // self._spec.tensor_parallel_size] for rank in range(self.size)]

    def _score(self, samples: list[Trajectory], base: bool = False) -> tuple[list[list[float]], list[list[float]]]:
        logprobs: list[list[float]] = [[] for _ in samples]
        entropies: list[list[float]] = [[] for _ in samples]
        scored = [i for i, s in enumerate(samples) if s.num_actions > 0]
        if not scored:
            return logprobs, entropies
        shares, passes = self._shares(samples, scored)
        replies = self._exchange(self._per_rank([Score([samples[i] for i in share], passes, base) for share in shares]))
        for rank, reply in enumerate(replies):
            if isinstance(reply, Failed):
                raise TrainRankError(rank, f"failed to score:\n{reply.traceback}")
        for replica, share in enumerate(shares):
            reply = replies[replica * self._spec.tensor_parallel_size]
            assert isinstance(reply, Scored)
            for j, i in enumerate(share):
                logprobs[i], entropies[i] = reply.logprobs[j], reply.entropies[j]
        return logprobs, entropies

    def _train_step(
        self, samples: list[Trajectory], objective: LossObjective, mini_batches: Sequence[Sequence[int]] | None
    ) -> dict[str, float]:
        check_trainable(samples)
        parts = step_parts(samples, mini_batches)
        try:
            pickled = pickle.dumps(objective)
        except Exception as exc:
            raise TypeError(f"the objective must be picklable to reach the train ranks: {exc}") from exc
        micro_batches = 0
        optimizer_steps = 0

        def optimizer_step(part: list[int], progress: float) -> dict[str, float]:
            nonlocal micro_batches, optimizer_steps
            trained = [samples[i] for i in part]
            totals = StepTotals.of(trained, objective.mean_over)
            shares, passes = self._shares(samples, part)
            messages = [Accumulate([samples[i] for i in share], passes, pickled, totals, progress) for share in shares]
            sums, count = self._accumulate(self._per_rank(messages), first=progress == 0)
            grad_norm, optimizer_steps = self._step()
            micro_batches += count
            # The schedule's factor at the step just taken (the ranks count their steps, checkpointed).
            return {**sums, "grad_norm": grad_norm, "lr": self._spec.lr * self._spec.lr_factor(optimizer_steps - 1)}

        metrics = take_optimizer_steps(parts, optimizer_step, version=self._version)
        self._all(Publish, "publish the version")
        self._record_probe()
        return {
            **metrics,
            "tokens": float(sum(s.num_trained for s in samples)),
            "samples": float(len(samples)),
            "micro_batches": float(micro_batches),
            "optimizer_steps_total": float(optimizer_steps),
        }

    def _accumulate(self, messages: list[Accumulate], *, first: bool) -> tuple[dict[str, float], int]:
        """Every rank accumulates its share; returns the replicas' merged metric sums and micro-batches.
        A failure drops every rank's gradient and raises naming the rank; past the train step's
        first optimizer step the weights have moved, and the group is lost."""
        replies = self._exchange(messages)
        failed = [(rank, reply) for rank, reply in enumerate(replies) if isinstance(reply, Failed)]
        if failed:
            self._exchange([Step(proceed=False)] * self.size)
            rank, reply = failed[0]
            detail = f"failed:\n{reply.traceback}"  # type: ignore[union-attr]
            raise TrainRankError(rank, detail) if first else self._lost(rank, detail)
        # Tensor-parallel ranks of a replica computed the same share: count each replica once.
        replicas = replies[:: self._spec.tensor_parallel_size]
        assert all(isinstance(reply, Accumulated) for reply in replicas)
        micro_batches = sum(reply.micro_batches for reply in replicas)  # type: ignore[union-attr]
        return merge_metric_sums([reply.sums for reply in replicas]), micro_batches  # type: ignore[union-attr]

    def _step(self) -> tuple[float, int]:
        """Every rank reduces, clips and steps; returns the (common) pre-clip norm and the optimizer steps taken."""
        stepped = self._exchange([Step(proceed=True)] * self.size)
        for rank, reply in enumerate(stepped):
            if isinstance(reply, Failed):
                raise self._lost(rank, f"failed its optimizer step:\n{reply.traceback}")
        norms = [reply.grad_norm for reply in stepped]  # type: ignore[attr-defined]
        counts = {reply.optimizer_steps for reply in stepped}  # type: ignore[attr-defined]
        grad_norm = norms[0]
        if not math.isfinite(grad_norm):
            if any(math.isfinite(n) for n in norms):
                raise self._lost(norms.index(next(n for n in norms if math.isfinite(n))), f"diverged: gradient norms {norms}")
            raise FloatingPointError(f"non-finite gradient norm {grad_norm} at version {self._version}")
        # The norm is all-reduced: every rank holds the same bits, or the ranks have diverged.
        if any(n != grad_norm for n in norms) or len(counts) != 1:
            rank = next((r for r, n in enumerate(norms) if n != grad_norm), 0)
            raise self._lost(rank, f"diverged: gradient norms {norms}, optimizer steps {sorted(counts)}")
        return grad_norm, counts.pop()

    def _gather(self) -> int:
        replies = self._exchange([Gather() for _ in range(self.size)])
        for rank, reply in enumerate(replies):
            if isinstance(reply, Failed):
                raise self._lost(rank, f"failed to gather the weights:\n{reply.traceback}")
        head = replies[0]
        assert isinstance(head, Gathered)
        if head.staging is not None:
            self._staging = head.staging
        return head.version


def _vocab_size(model_path: str) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path).vocab_size


def free_address(host: str) -> str:
    """A ``tcp://`` rendezvous address on ``host`` with a port the OS just handed out (rank 0's)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return f"tcp://{host}:{probe.getsockname()[1]}"
