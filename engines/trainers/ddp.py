"""Data-parallel ranks for ``TorchTrainEngine``: worker processes, their protocol, the gradient all-reduce.

What it owns: ranks 1..N-1 of a data-parallel ``TorchTrainEngine`` (rank 0 is the engine's own
worker thread in the driver process). :class:`DataParallelRanks` is rank 0's handle: it starts
the rank processes (``spawn``, daemonic), rendezvouses a gloo process group with them on
127.0.0.1 (a TCPStore on a port the OS picks), and drives each step over one
``multiprocessing`` pipe per rank. Each rank process builds its replica as a single-process
``TorchTrainEngine`` from the same arguments, so model, optimizer, schedule, micro-batching,
loss weighting and thread budget are the same code as rank 0's.

A step, as the driver runs it (every message is a dataclass below):
1. the trained trajectories are split across ranks balanced by tokens (:func:`balance`); each
   rank gets its share, the pickled objective and the step's :class:`StepTotals`;
2. every rank accumulates its share's gradient, each micro-batch loss weighted by its share of
   the whole step's tokens or sequences, and replies :class:`Accumulated` or :class:`Failed`;
3. only when every rank has replied does the driver send :class:`ReduceGradients`: ``proceed``
   when all succeeded (the ranks all-reduce, SUM, clip by the same global norm and step
   identically), else every rank drops its gradient and the step raises, naming the rank;
4. each rank replies :class:`Stepped` with its gradient norm, which must equal rank 0's.

Invariants:
- every rank holds rank 0's weights and optimizer state: parameters are broadcast from rank 0
  at start (as torch DDP does), every step applies the same all-reduced gradient with the same
  thread budget, and ``restore`` sends every rank the checkpoint; equal gradient norms after
  each step check it;
- no rank enters a collective unless every rank will: the all-reduce starts only after all
  ranks have reported their gradients, so a failing loss leaves the group usable;
- nothing waits forever: the driver's receives end on the reply or on the rank's death (the
  process sentinel), collectives end within the process group's timeout, and a rank process
  exits on end-of-file on its pipe (``close()``, or the driver dying);
- a rank that dies, or fails where the ranks may have diverged (the all-reduce, the optimizer
  step, a restore), leaves the group broken: later calls raise instead of training on.
"""

from __future__ import annotations

import functools
import io
import math
import multiprocessing as mp
import pickle
import signal
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tandem.algorithms.metrics import merge_metric_sums
from tandem.core.protocols import LossObjective
from tandem.core.records import Trajectory
from tandem.engines.shared.microbatch import token_payload
from tandem.engines.shared.threads import apply_thread_budget

if TYPE_CHECKING:
    from tandem.engines.trainers.loss_loop import StepTotals
    from tandem.engines.trainers.torch_train import TorchTrainEngine

__all__ = ["DataParallelRanks", "TrainRankError", "all_reduce_gradients", "balance", "broadcast_parameters"]

_HOST = "127.0.0.1"
# Bounds a collective (and the rendezvous) when a rank hangs without dying; a dead rank is seen
# at once. Ranks enter the all-reduce together (step 3 above), so healthy waits are short.
_COLLECTIVE_TIMEOUT = timedelta(seconds=120)
# How long close() lets a rank exit on end-of-file before killing it.
_EXIT_TIMEOUT_S = 10.0


class TrainRankError(RuntimeError):
    """A data-parallel train rank failed or died; ``rank`` names it."""

    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(f"train rank {rank} {detail}")
        self.rank = rank


# ---------------------------------------------------------------- messages: driver -> rank


@dataclass(slots=True)
class TrainShare:
    """This rank's samples of a step, how to weigh them, and the loss (pickled once per step)."""

    samples: list[Trajectory]
    loss_fn: bytes
    totals: StepTotals


@dataclass(slots=True)
class ReduceGradients:
    """``proceed``: all-reduce and step; otherwise some rank failed: drop this step's gradient."""

    proceed: bool


@dataclass(slots=True)
class Restore:
    """A ``TorchTrainEngine.state_dict()`` as ``torch.save`` bytes."""

    state: bytes


# ---------------------------------------------------------------- messages: rank -> driver


@dataclass(slots=True)
class Loaded:
    """The replica is built; the rank joins the process group next."""


@dataclass(slots=True)
class Accumulated:
    """The rank's weighted metric sums and micro-batch count for its share."""

    sums: dict[str, float]
    micro_batches: int


@dataclass(slots=True)
class Stepped:
    """The pre-clip global gradient norm the rank saw (NaN/inf: it skipped the step, like rank 0)."""

    grad_norm: float


@dataclass(slots=True)
class Restored:
    """The rank loaded the checkpoint."""


@dataclass(slots=True)
class Failed:
    """The rank raised; ``traceback`` is its formatted traceback."""

    traceback: str


# ---------------------------------------------------------------- shared by every rank


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


def _process_group(store: dist.Store, rank: int, world_size: int) -> dist.ProcessGroup:
    # A private group object, not ``init_process_group``: that one is process-global, and the
    # driver may hold several engines (or a param-sync transport) with groups of their own.
    # The options spell out the loopback device, as ``init_process_group`` does for gloo.
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=_HOST)]
    options._timeout = _COLLECTIVE_TIMEOUT
    return dist.ProcessGroupGloo(store, rank, world_size, options)


def all_reduce_gradients(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Sum every rank's gradients into every rank, in one collective over a flat buffer.

    One buffer, not one collective per tensor: gloo pays a round trip per operation. It sums in
    the widest of float32 and the parameters' dtypes (half-precision sums would lose the small
    gradients). A rank with no samples has no gradients; a trailing slot per parameter counts
    the ranks that had one, so a parameter no rank touched keeps ``grad = None`` (and AdamW
    skips it) as in one process.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    total = sum(p.numel() for p in params)
    dtype = functools.reduce(torch.promote_types, (p.dtype for p in params), torch.float32)
    flat = torch.zeros(total + len(params), dtype=dtype, device=params[0].device)
    offset = 0
    for k, p in enumerate(params):
        if p.grad is not None:
            flat[offset : offset + p.numel()].copy_(p.grad.reshape(-1))
            flat[total + k] = 1.0
        offset += p.numel()
    group.allreduce([flat]).wait()
    present = flat[total:].tolist()
    offset = 0
    for k, p in enumerate(params):
        if present[k] == 0.0:
            p.grad = None
        else:
            if p.grad is None:
                p.grad = torch.empty_like(p)
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


def broadcast_parameters(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Overwrite every rank's parameters with rank 0's, in one collective (exact: the buffer's
    dtype is the widest of float32 and the parameters')."""
    params = list(model.parameters())
    dtype = functools.reduce(torch.promote_types, (p.dtype for p in params), torch.float32)
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1).to(dtype) for p in params])
        options = dist.BroadcastOptions()
        options.rootRank = 0
        group.broadcast([flat], options).wait()
        offset = 0
        for p in params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def _state_bytes(state: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


# ---------------------------------------------------------------- rank processes


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    engine_class: type[TorchTrainEngine],
    model_path: str,
    replica: dict[str, Any],
    conn: Connection,
) -> None:
    """A rank process: build the replica (rank 0's own class, so this module imports no trainer
    and no cycle forms), join the group, serve the driver until end-of-file."""
    # Ctrl-C reaches the whole process group; the driver decides when ranks stop (end-of-file).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # This thread computes (the replica's own worker thread stays unused): budget it first.
    apply_thread_budget(replica["num_threads"])
    try:
        engine = engine_class(model_path, **replica)
    except Exception:
        conn.send(Failed(traceback.format_exc()))
        return
    conn.send(Loaded())
    store = dist.TCPStore(_HOST, port, world_size, is_master=False, timeout=_COLLECTIVE_TIMEOUT)
    group = _process_group(store, rank, world_size)
    broadcast_parameters(engine.model, group)
    try:
        while True:
            message = conn.recv()
            if isinstance(message, TrainShare):
                _serve_step(engine, group, conn, message)
            elif isinstance(message, Restore):
                try:
                    engine._restore(torch.load(io.BytesIO(message.state), weights_only=True))
                    conn.send(Restored())
                except Exception:
                    conn.send(Failed(traceback.format_exc()))
            else:
                raise TypeError(f"rank {rank}: unexpected message {message!r}")
    except (EOFError, BrokenPipeError):  # the driver closed the engine or died
        return


def _serve_step(engine: TorchTrainEngine, group: dist.ProcessGroup, conn: Connection, share: TrainShare) -> None:
    engine._optimizer.zero_grad(set_to_none=True)
    try:
        loss_fn = pickle.loads(share.loss_fn)
        sums, micro_batches = engine._accumulate(share.samples, loss_fn, share.totals)
        conn.send(Accumulated(sums, micro_batches))
    except Exception:
        conn.send(Failed(traceback.format_exc()))
    order: ReduceGradients = conn.recv()
    if not order.proceed:
        engine._optimizer.zero_grad(set_to_none=True)
        return
    try:
        all_reduce_gradients(engine.model, group)
        try:
            grad_norm = engine._clip_and_step()
        except FloatingPointError:  # every rank sees the same norm; rank 0 raises it
            grad_norm = math.nan
        conn.send(Stepped(grad_norm))
    except Exception:
        conn.send(Failed(traceback.format_exc()))


# ---------------------------------------------------------------- rank 0's handle


@dataclass(slots=True)
class _Rank:
    rank: int
    process: BaseProcess
    conn: Connection


class DataParallelRanks:
    """Ranks 1..N-1 of a data-parallel ``TorchTrainEngine``, driven from rank 0's worker thread.

    Started (replicas built, group joined, weights broadcast) by the constructor; ``close()``
    stops them. ``train_step`` and ``restore`` run on rank 0's worker thread only.
    """

    def __init__(self, engine: TorchTrainEngine, model_path: str, replica: dict[str, Any], world_size: int) -> None:
        self._engine = engine
        self._ranks: list[_Rank] = []
        self._group: dist.ProcessGroup | None = None
        self._broken: Exception | None = None
        self._closed = False
        self._store = dist.TCPStore(
            _HOST, 0, world_size, is_master=True, timeout=_COLLECTIVE_TIMEOUT, wait_for_workers=False
        )
        context = mp.get_context("spawn")  # a forked torch (threads, OpenMP) is unsafe
        try:
            for rank in range(1, world_size):
                ours, theirs = context.Pipe()
                process = context.Process(
                    target=_rank_main,
                    args=(rank, world_size, self._store.port, type(engine), model_path, replica, theirs),
                    name=f"tandem-train-rank{rank}",
                    daemon=True,  # ended by multiprocessing when the driver exits
                )
                process.start()
                theirs.close()  # else our copy keeps the pipe open and hides the rank's death
                self._ranks.append(_Rank(rank, process, ours))
            for r in self._ranks:
                reply = self._receive(r)
                if isinstance(reply, Failed):
                    raise TrainRankError(r.rank, f"failed to build its replica:\n{reply.traceback}")
            self._group = _process_group(self._store, 0, world_size)
            broadcast_parameters(engine.model, self._group)
        except BaseException:
            self.close()
            raise

    def train_step(
        self, samples: list[Trajectory], loss_fn: LossObjective, totals: StepTotals
    ) -> tuple[dict[str, float], int, float]:
        """One data-parallel optimizer step over ``samples`` (each with trained tokens); returns
        (weighted metric sums, micro-batches, grad norm)."""
        self._check_usable()
        try:
            pickled = pickle.dumps(loss_fn)
        except Exception as exc:
            raise TypeError(f"loss_fn must be picklable to reach the other train ranks: {exc}") from exc
        costs = [len(token_payload(s).prompt_ids) + s.num_actions for s in samples]
        shares = balance(costs, len(self._ranks) + 1)
        for r, share in zip(self._ranks, shares[1:], strict=True):
            self._send(r, TrainShare([samples[i] for i in share], pickled, totals))

        engine = self._engine
        engine._optimizer.zero_grad(set_to_none=True)
        local_error: Exception | None = None
        sums: dict[str, float] = {}
        micro_batches = 0
        try:
            sums, micro_batches = engine._accumulate([samples[i] for i in shares[0]], loss_fn, totals)
        except Exception as exc:  # raised below, once every rank is told to drop the step
            local_error = exc
        replies = [self._receive(r) for r in self._ranks]
        failed = [(r, reply) for r, reply in zip(self._ranks, replies, strict=True) if isinstance(reply, Failed)]
        if local_error is not None or failed:
            engine._optimizer.zero_grad(set_to_none=True)
            for r in self._ranks:
                self._send(r, ReduceGradients(proceed=False))
            if local_error is not None:
                raise local_error
            r, reply = failed[0]
            raise TrainRankError(r.rank, f"failed:\n{reply.traceback}")
        for reply in replies:
            assert isinstance(reply, Accumulated)
            micro_batches += reply.micro_batches
        sums = merge_metric_sums([sums, *(reply.sums for reply in replies)])  # type: ignore[union-attr]

        for r in self._ranks:
            self._send(r, ReduceGradients(proceed=True))
        assert self._group is not None  # set by the constructor
        try:
            all_reduce_gradients(engine.model, self._group)
        except RuntimeError as exc:
            raise self._blame(exc) from exc
        step_error: FloatingPointError | None = None
        try:
            grad_norm = engine._clip_and_step()
        except FloatingPointError as exc:  # every rank saw it and skipped the step too
            step_error, grad_norm = exc, math.nan
        for r in self._ranks:
            reply = self._receive(r)
            if isinstance(reply, Failed):
                raise self._lost(r, f"failed its optimizer step:\n{reply.traceback}")
            assert isinstance(reply, Stepped)
            if reply.grad_norm != grad_norm and (math.isfinite(reply.grad_norm) or math.isfinite(grad_norm)):
                raise self._lost(r, f"diverged: gradient norm {reply.grad_norm}, rank 0's {grad_norm}")
        if step_error is not None:
            raise step_error
        return sums, micro_batches, grad_norm

    def restore(self, state: dict[str, Any]) -> None:
        """Load ``state`` into every other rank (rank 0 has loaded it already)."""
        self._check_usable()
        blob = _state_bytes(state)
        for r in self._ranks:
            self._send(r, Restore(blob))
        for r in self._ranks:
            reply = self._receive(r)
            if isinstance(reply, Failed):
                raise self._lost(r, f"failed to restore the checkpoint:\n{reply.traceback}")

    def close(self) -> None:
        """Stop every rank process (end-of-file, then a kill after a grace period); idempotent."""
        if self._closed:
            return
        self._closed = True
        for r in self._ranks:
            r.conn.close()
        for r in self._ranks:
            r.process.join(_EXIT_TIMEOUT_S)
            if r.process.is_alive():  # stuck in a computation or a collective
                r.process.kill()
                r.process.join()
        self._group = None

    # ------------------------------------------------------------ helpers

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("the data-parallel train ranks are closed")
        if self._broken is not None:
            raise RuntimeError(f"the data-parallel train ranks are out of step since: {self._broken}") from self._broken

    def _lost(self, r: _Rank, detail: str) -> TrainRankError:
        """The error for a rank that left the group unusable; later calls refuse to run."""
        error = TrainRankError(r.rank, detail)
        self._broken = error
        return error

    def _send(self, r: _Rank, message: object) -> None:
        try:
            r.conn.send(message)
        except OSError:  # BrokenPipeError and kin: the rank is gone
            r.process.join(_EXIT_TIMEOUT_S)
            raise self._lost(r, f"died (exit code {r.process.exitcode})") from None

    def _receive(self, r: _Rank) -> object:
        """The rank's next reply, waiting until it comes or the rank dies (then raises)."""
        if r.conn in wait([r.conn, r.process.sentinel]):  # a reply sent just before dying counts
            try:
                return r.conn.recv()
            except EOFError:
                pass
        r.process.join(_EXIT_TIMEOUT_S)
        raise self._lost(r, f"died (exit code {r.process.exitcode})")

    def _blame(self, exc: RuntimeError) -> Exception:
        """The error for a failed collective: the rank whose death broke it, if one died."""
        dead = wait([r.process.sentinel for r in self._ranks], timeout=_EXIT_TIMEOUT_S)
        for r in self._ranks:
            if r.process.sentinel in dead:
                return self._lost(r, f"died during the gradient all-reduce (exit code {r.process.exitcode}): {exc}")
        self._broken = RuntimeError(f"gradient all-reduce failed: {exc}")
        return self._broken
