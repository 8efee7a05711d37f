"""AsyncTrainingFlow: one asyncio loop running a state machine per role over bounded channels.

The flow owns everything shared: the version clock, the staleness gate, the ledger, the run
history, the channels and the tasks. It builds the stage graph the config declares
(:class:`~pipeline.graph.StageGraph`), supervises one task per state machine in a TaskGroup (the
first failure cancels the rest and ``run()`` raises that one :class:`StageError`, naming the
stage and its prompts), and stops when the graph's finishing role (train, after ``max_steps``)
is done: every admitted group has then been trained or dropped, so cancelling the remaining
tasks loses nothing. No task outlives ``run()``.

Checkpoints (``core.checkpoint``): the train role writes one every ``run.save_steps``, the
flow one at the end and one at a clean stop (cancellation, e.g. Ctrl-C), where the prompts in
flight are saved to be generated again and recorded in this run's ledger as cancelled at
shutdown. With ``run.resume`` the flow starts from a checkpoint: its version (clock and gate
start there, so admission resumes within the bound), its data position, its ledger and the
weight syncs' record (a run saved while degraded resumes degraded).

One writer per run folder (``pipeline.run_lock``): the flow locks the folder before it builds
anything and lets go after the report is written; a second run into a live run's folder is
refused with a :class:`~pipeline.run_lock.RunFolderBusy` naming the holder's pid.
"""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from tandem.core.channel import BrokenChannel, ChannelStatistics, ReceiveChannel
from tandem.core.checkpoint import Checkpointer, FlowState, trim_metrics
from tandem.core.components import Components
from tandem.core.config import TandemConfig
from tandem.core.history import ModeChange, RunHistory, StepRecord, SyncRecord, ValidationRecord, read_step_rows
from tandem.core.ledger import DropRecord, Ledger
from tandem.core.staleness import StalenessGate, VersionClock
from tandem.core.trace import TraceRecorder
from tandem.pipeline.builders import build_components
from tandem.pipeline.graph import StageGraph
from tandem.pipeline.metrics import FlowMetrics
from tandem.pipeline.report import plot_run
from tandem.pipeline.run_lock import RunFolderLock
from tandem.pipeline.tracking import Tracker, open_trackers
from tandem.state_machines.base import FlowServices, StageError, StateMachine

__all__ = ["AsyncTrainingFlow", "FlowResult", "RoleSummary"]

log = structlog.get_logger("tandem")

CANCELLED_AT_SHUTDOWN = "cancelled at shutdown"  # the drop reason of prompts in flight at a clean stop


@dataclass(slots=True, frozen=True)
class RoleSummary:
    """How a role spent the run: seconds per state, transitions, items finished."""

    state_seconds: dict[str, float]
    transitions: int
    items: int

    @property
    def busy_fraction(self) -> float:
        total = sum(self.state_seconds.values())
        return self.state_seconds.get("running", 0.0) / total if total > 0 else 0.0


@dataclass(slots=True)
class FlowResult:
    """What a run did. Times are event-loop seconds (virtual under a virtual clock).

    ``steps`` and ``syncs`` are the most recent ``observability.keep_steps`` records (the whole
    run is in ``metrics.jsonl``); the totals and the reward summary cover every step.
    """

    steps: list[StepRecord]
    syncs: list[SyncRecord]
    validations: list[ValidationRecord]
    mode_changes: list[ModeChange]
    ledger: dict[str, Any]
    drops: list[DropRecord]
    staleness_counts: dict[int, int]
    final_version: int
    wall_s: float
    channels: dict[str, ChannelStatistics]
    roles: dict[str, RoleSummary]
    total_steps: int = 0
    samples: int = 0
    tokens: int = 0
    reward_first: float | None = None  # mean reward of the first tenth of the steps
    reward_last: float | None = None  # mean reward of the last tenth
    run_dir: Path | None = None
    metrics_port: int | None = None
    resumed_from_version: int | None = None  # the checkpoint's version, when the run resumed

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


@dataclass(slots=True)
class _Run:
    """One run's shared objects, from its start to its report."""

    services: FlowServices
    components: Components
    run_dir: Path | None
    start_s: float
    trackers: list[Tracker] = field(default_factory=list)
    metrics: FlowMetrics | None = None
    port: int | None = None
    lock: RunFolderLock | None = None  # held from _open until the report is written


class AsyncTrainingFlow:
    """Runs one training job: ``result = await AsyncTrainingFlow(config).run()``.

    ``components`` overrides the engines the config would build (tests and embedding users
    pass their own); the flow closes only components it built itself. ``on_step`` is told of
    each trained step as it lands (the CLI's progress bar listens here).
    """

    def __init__(
        self,
        config: TandemConfig,
        components: Components | None = None,
        on_step: Callable[[StepRecord], None] | None = None,
    ) -> None:
        self.config = config
        self._given_components = components
        self._on_step = on_step
        self.machines: list[StateMachine] = []
        self.channels: list[ReceiveChannel[Any]] = []
        self.metrics_port: int | None = None  # set while metrics are served
        self.metrics: FlowMetrics | None = None  # the run's Prometheus registry, set while it runs

    async def run(self) -> FlowResult:
        graph = StageGraph.from_config(self.config)
        run = await self._open()
        cancelled = False
        collector = _tune_collector()
        try:
            try:
                built = graph.build(run.services)
                self.machines, self.channels = built.machines, built.channels
                self._observe(run)
                log.info("flow started", stages=graph.chain, k=self.config.staleness.k,
                         max_steps=self.config.run.max_steps, metrics_port=run.port)
                await self._supervise(run, graph.finishing_role)
                await self._save_final(run)
            except asyncio.CancelledError:
                cancelled = True
                await self._stop(run)
            finally:
                _restore_collector(collector)
                await self._close(run)
            result = self._report(run)
        finally:
            if run.lock is not None:
                run.lock.release()
        if cancelled:
            raise asyncio.CancelledError
        log.info("flow finished", steps=result.total_steps, wall_s=round(result.wall_s, 3), **result.ledger)
        return result

    # ------------------------------------------------------------------ start

    async def _open(self) -> _Run:
        """Make and lock the run folder, build (or take) the components, resume if asked, and set
        up the shared objects: clock and gate at the resumed version, ledger, history, trace.

        The folder is locked first, so a refused run loads no model."""
        cfg = self.config
        run_dir = self._make_run_dir()
        lock = RunFolderLock.acquire(run_dir) if run_dir is not None else None
        components: Components | None = None
        try:
            components = self._given_components or build_components(cfg)
            loop = asyncio.get_running_loop()
            checkpoints = None
            if run_dir is not None:
                checkpoints = Checkpointer(
                    cfg, run_dir, components.trainer, reference=components.reference, teacher=components.teacher
                )
            resumed = await self._resume(checkpoints, components)
            version = resumed.version if resumed is not None else 0
            clock = VersionClock(trained=version, loaded=version)
            gate = StalenessGate(
                clock, cfg.staleness.k, cfg.train.prompts_per_step, cfg.run.max_steps, cfg.max_concurrent,
                degrade_after=cfg.staleness.degrade_after_sync_failures, recover_after=cfg.staleness.recover_after_syncs,
            )
            ledger = Ledger(gate)
            if resumed is not None:
                ledger.restore(resumed.trained, resumed.drops, resumed.next_prompt_id)
                await gate.restore(resumed.syncs)
            history = RunHistory(
                run_dir / "metrics.jsonl" if run_dir else None, append=resumed is not None,
                keep=cfg.observability.keep_steps, max_steps=cfg.run.max_steps,
            )
            start = loop.time()
            services = FlowServices(
                config=cfg, clock=clock, gate=gate, ledger=ledger, components=components,
                trace=TraceRecorder(start, cfg.observability.trace_max_events, enabled=cfg.observability.trace),
                history=history, checkpoints=checkpoints, resumed=resumed,
            )
        except BaseException:
            if components is not None and self._given_components is None:
                components.close()
            if lock is not None:
                lock.release()
            raise
        return _Run(services, components, run_dir, start, lock=lock)

    def _observe(self, run: _Run) -> None:
        """Prometheus (served if asked), experiment trackers and the ``on_step`` listener."""
        cfg, history = self.config, run.services.history
        services = run.services
        metrics = self.metrics = run.metrics = FlowMetrics(
            self.machines, self.channels, services.clock, services.ledger, services.gate, run.start_s
        )
        history.on_step(metrics.observe_step)
        # The series of the task's held-out measure exists from the start, as the other gauges do.
        metrics.validation_measure.labels(run.components.held_out_measure.name)
        history.on_validation(metrics.observe_validation)
        history.on_sync(metrics.observe_sync)
        if run.run_dir is not None:
            run.trackers = open_trackers(cfg, run.run_dir)
            for tracker in run.trackers:
                history.on_row(tracker.log)
        if self._on_step is not None:
            history.on_step(self._on_step)
        if cfg.observability.metrics_port is not None:
            run.port = self.metrics_port = metrics.serve(cfg.observability.metrics_port)

    async def _resume(self, checkpoints: Checkpointer | None, components: Components) -> FlowState | None:
        """Restore the checkpoint ``run.resume`` names, if any: the trainer's (and the frozen
        scorers') state, then the rollout engines' weights (they start from the base model). A
        missing or damaged checkpoint raises ``CheckpointError``."""
        path = checkpoints.resume_path() if checkpoints is not None else None
        if checkpoints is None or path is None:
            return None
        state = await checkpoints.restore(path)
        if state.version > 0:
            await components.weight_sync.sync(state.version)
        trim_metrics(checkpoints.root.parent / "metrics.jsonl", state.version)
        return state

    def _make_run_dir(self) -> Path | None:
        if not self.config.observability.write_run_dir:
            return None
        run_dir = self.config.run.output_dir / self.config.run.name
        run_dir.mkdir(parents=True, exist_ok=True)
        return run_dir

    # ------------------------------------------------------------------ run

    async def _supervise(self, run: _Run, finishing_role: str) -> None:
        """Run every machine; stop the rest when the finishing role is done; surface the first failure."""
        try:
            async with asyncio.TaskGroup() as tasks:
                running = {m.name: tasks.create_task(m.run(), name=f"tandem:{m.name}") for m in self.machines}
                # asyncio.wait, not await: a failure must surface once, from the group itself.
                try:
                    await asyncio.wait([running[finishing_role]])
                except asyncio.CancelledError:
                    # Cancelled from outside, not by a failed stage (the group cancels the
                    # roles only after this): a clean stop, so the train step in progress ends.
                    if not any(t.done() and not t.cancelled() and t.exception() for t in running.values()):
                        run.services.stopping_cleanly = True
                    raise
                for task in running.values():
                    task.cancel()
        except BaseExceptionGroup as group:
            raise _root_cause(group) from None

    # ------------------------------------------------------------------ end

    async def _save_final(self, run: _Run) -> None:
        """The end-of-run checkpoint (unless the last step wrote one) and the exported weights."""
        services = run.services
        checkpoints = services.checkpoints
        if checkpoints is not None and checkpoints.last_version != services.clock.trained:
            await checkpoints.save(services.clock.trained, services.ledger, services.gate.syncs)
        if run.run_dir is not None and run.components.save_checkpoint is not None:
            await run.components.save_checkpoint(run.run_dir / "checkpoint")

    async def _stop(self, run: _Run) -> None:
        """A clean stop (the flow was cancelled, e.g. Ctrl-C): checkpoint what is done, with the
        prompts in flight (a resume generates them again), then record those prompts in this
        run's ledger as cancelled at shutdown. Every role has stopped, and the train role
        finished the step it had begun, so the trainer holds exactly the trained version."""
        services = run.services
        if services.checkpoints is not None:
            try:
                await services.checkpoints.save(services.clock.trained, services.ledger, services.gate.syncs)
            except Exception:  # stopping anyway: the previous checkpoint stands
                log.exception("checkpoint at shutdown failed; the previous one stands")
        for prompt_id in services.ledger.in_flight_ids():
            await services.ledger.drop(prompt_id, "flow", CANCELLED_AT_SHUTDOWN)

    async def _close(self, run: _Run) -> None:
        if run.metrics is not None:
            run.metrics.close()
        self.metrics_port, self.metrics = None, None
        run.services.history.close()
        for tracker in run.trackers:
            tracker.close()
        if self._given_components is None:
            await run.components.aclose()
        if run.run_dir is not None and self.config.observability.trace:
            run.services.trace.write(run.run_dir / "trace.json")

    def _report(self, run: _Run) -> FlowResult:
        """The result, and in the run folder ``summary.json`` and ``progress.png``."""
        services, history = run.services, run.services.history
        result = FlowResult(
            steps=list(history.steps),
            syncs=list(history.syncs),
            validations=history.validations,
            mode_changes=history.mode_changes,
            ledger=services.ledger.summary(),
            drops=services.ledger.drops,
            staleness_counts=dict(sorted(history.staleness_counts.items())),
            final_version=services.clock.trained,
            wall_s=asyncio.get_running_loop().time() - run.start_s,
            channels={ch.name: ch.statistics() for ch in self.channels},
            roles={
                m.name: RoleSummary(
                    state_seconds={s.value: t for s, t in m.state_seconds.items()},
                    transitions=sum(m.transitions.values()),
                    items=m.items_done,
                )
                for m in self.machines
            },
            total_steps=history.total_steps,
            samples=history.samples,
            tokens=history.tokens,
            reward_first=_mean(history.first_rewards),
            reward_last=_mean(history.last_rewards),
            run_dir=run.run_dir,
            metrics_port=run.port,
            resumed_from_version=services.resumed.version if services.resumed is not None else None,
        )
        if run.run_dir is not None:
            (run.run_dir / "summary.json").write_text(json.dumps(_summary(result), indent=2))
            plot_run(read_step_rows(run.run_dir / "metrics.jsonl"), run.run_dir / "progress.png")
        return result


# Allocations between two runs of the cyclic collector's youngest generation while the flow runs.
# Its per-item records are freed by reference counting the moment they are done (no cycles), so
# the default of 700 ran collections that found almost nothing; measured on the fake engines:
# 552 young collections and ~10 % of the flow's CPU time over 200 steps, against 2 at 5,000.
_YOUNG_THRESHOLD = 10_000


def _tune_collector() -> tuple[int, int, int]:
    """Tune the cyclic collector for the run: everything built so far (engines, models, config,
    modules) lives as long as the run, so it is frozen out of full collections (they re-scanned it:
    about a fifth of the flow's CPU time), and young collections run less often. Returns the
    thresholds to restore."""
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(_YOUNG_THRESHOLD, thresholds[1], thresholds[2])
    return thresholds


def _restore_collector(thresholds: tuple[int, int, int]) -> None:
    gc.set_threshold(*thresholds)
    gc.unfreeze()


def _mean(values: Any) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def _summary(result: FlowResult) -> dict[str, Any]:
    return {
        "steps": result.total_steps,
        "final_version": result.final_version,
        "wall_s": result.wall_s,
        "samples_per_s": result.samples_per_s,
        "tokens_per_s": result.tokens_per_s,
        "reward_first": result.reward_first,
        "reward_last": result.reward_last,
        "staleness_counts": result.staleness_counts,
        "ledger": result.ledger,
        "resumed_from_version": result.resumed_from_version,
        "degradations": sum(m.degraded for m in result.mode_changes),
        "validation": [{"version": v.version, "reward_mean": v.reward_mean, "measure": v.measure, v.measure: v.score}
                       for v in result.validations],
        "roles_busy_fraction": {name: r.busy_fraction for name, r in result.roles.items()},
    }


def _root_cause(group: BaseExceptionGroup) -> BaseException:
    """The error to surface: the first stage failure that is not a consequence of another."""
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(group)
    for exc in leaves:
        if not (isinstance(exc, StageError) and isinstance(exc.cause, BrokenChannel)):
            return exc
    return leaves[0]
