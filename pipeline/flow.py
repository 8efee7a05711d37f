"""AsyncTrainingFlow: one asyncio loop running a state machine per role over bounded channels.

The flow owns everything shared: the version clock, the staleness gate, the ledger, the run
history, the channels and the tasks. It builds the stage chain from config, supervises one task
per state machine in a TaskGroup (the first failure cancels the rest and ``run()`` raises that
one :class:`StageError`, naming the stage and its prompts), and stops when the train role has
done ``max_steps``: every admitted group has then been trained or dropped, so cancelling the
remaining tasks loses nothing. No task outlives ``run()``.

Checkpoints (``core.checkpoint``): the train role writes one every ``run.save_steps``, the
flow one at the end and one at a clean stop (cancellation, e.g. Ctrl-C), where the prompts in
flight are saved to be generated again and recorded in this run's ledger as cancelled at
shutdown. With ``run.resume`` the flow starts from a checkpoint: its version (clock and gate
start there, so admission resumes within the bound), its data position and its ledger.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from core.channel import BrokenChannel, ChannelStatistics, ReceiveChannel, SendChannel, open_channel
from core.checkpoint import Checkpointer, FlowState, trim_metrics
from core.components import Components
from core.config import TandemConfig
from core.history import ModeChange, RunHistory, StepRecord, SyncRecord, ValidationRecord
from core.ledger import DropRecord, Ledger
from core.resources import colocated_groups
from core.staleness import StalenessGate, VersionClock
from core.trace import TraceRecorder
from pipeline.builders import build_components
from pipeline.metrics import FlowMetrics
from pipeline.report import plot_run
from state_machines.base import FlowServices, StageError, StateMachine
from state_machines.registry import create_role_state_machine
from state_machines.train import TrainStateMachine

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
    """What a run did. Times are event-loop seconds (virtual under a virtual clock)."""

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
    run_dir: Path | None = None
    metrics_port: int | None = None
    resumed_from_version: int | None = None  # the checkpoint's version, when the run resumed

    @property
    def samples_per_s(self) -> float:
        return sum(s.samples for s in self.steps) / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return sum(s.tokens for s in self.steps) / self.wall_s if self.wall_s > 0 else 0.0


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
        cfg = self.config
        components = self._given_components or build_components(cfg)
        loop = asyncio.get_running_loop()
        start = loop.time()
        run_dir = self._make_run_dir()
        checkpoints = Checkpointer(cfg, run_dir, components.trainer) if run_dir is not None else None
        resumed = await self._resume(checkpoints, components)
        version = resumed.version if resumed is not None else 0
        clock = VersionClock(trained=version, loaded=version)
        gate = StalenessGate(clock, cfg.staleness.k, cfg.train.prompts_per_step, cfg.run.max_steps, cfg.max_concurrent)
        ledger = Ledger(gate)
        if resumed is not None:
            ledger.restore(resumed.trained, resumed.drops, resumed.next_prompt_id)
        services = FlowServices(
            config=cfg, clock=clock, gate=gate, ledger=ledger, components=components,
            trace=TraceRecorder(start, cfg.observability.trace_max_events, enabled=cfg.observability.trace),
            history=RunHistory(run_dir / "metrics.jsonl" if run_dir else None, append=resumed is not None),
            checkpoints=checkpoints, resumed=resumed,
        )
        self.machines = self._build_graph(services)
        metrics = self.metrics = FlowMetrics(self.machines, self.channels, clock, services.ledger, gate, start)
        services.history.on_step(metrics.observe_step)
        services.history.on_validation(metrics.observe_validation)
        if self._on_step is not None:
            services.history.on_step(self._on_step)
        port = metrics.serve(cfg.observability.metrics_port) if cfg.observability.metrics_port is not None else None
        self.metrics_port = port
        log.info("flow started", stages=cfg.flow.stages, k=cfg.staleness.k, max_steps=cfg.run.max_steps, metrics_port=port)
        cancelled = False
        try:
            await self._supervise()
            if checkpoints is not None and checkpoints.last_version != clock.trained:
                await checkpoints.save(clock.trained, ledger)
            if run_dir is not None and components.save_checkpoint is not None:
                await components.save_checkpoint(run_dir / "checkpoint")
        except asyncio.CancelledError:
            cancelled = True
            await self._stop(services)
        finally:
            metrics.close()
            self.metrics_port, self.metrics = None, None
            services.history.close()
            if self._given_components is None:
                components.close()
            if run_dir is not None and cfg.observability.trace:
                services.trace.write(run_dir / "trace.json")
        result = self._result(services, loop.time() - start, run_dir, port)
        if run_dir is not None:
            (run_dir / "summary.json").write_text(json.dumps(self._summary(result), indent=2))
            plot_run(result.steps, run_dir / "progress.png")
        if cancelled:
            raise asyncio.CancelledError
        log.info("flow finished", steps=len(result.steps), wall_s=round(result.wall_s, 3), **result.ledger)
        return result

    async def _resume(self, checkpoints: Checkpointer | None, components: Components) -> FlowState | None:
        """Restore the checkpoint ``run.resume`` names, if any: the trainer's state, then the
        rollout engines' weights (they start from the base model). Closes the components the
        flow built if that fails (a missing or damaged checkpoint raises ``CheckpointError``)."""
        path = checkpoints.resume_path() if checkpoints is not None else None
        if checkpoints is None or path is None:
            return None
        try:
            state = await checkpoints.restore(path)
            if state.version > 0:
                await components.weight_sync.sync(state.version)
        except BaseException:
            if self._given_components is None:
                components.close()
            raise
        trim_metrics(checkpoints.root.parent / "metrics.jsonl", state.version)
        return state

    async def _stop(self, services: FlowServices) -> None:
        """A clean stop (the flow was cancelled, e.g. Ctrl-C): checkpoint what is done, with the
        prompts in flight (a resume generates them again), then record those prompts in this
        run's ledger as cancelled at shutdown. Every role has stopped, and the train role
        finished the step it had begun, so the trainer holds exactly the trained version."""
        if services.checkpoints is not None:
            try:
                await services.checkpoints.save(services.clock.trained, services.ledger)
            except Exception:  # stopping anyway: the previous checkpoint stands
                log.exception("checkpoint at shutdown failed; the previous one stands")
        for prompt_id in services.ledger.in_flight_ids():
            await services.ledger.drop(prompt_id, "flow", CANCELLED_AT_SHUTDOWN)

    def _make_run_dir(self) -> Path | None:
        if not self.config.observability.write_run_dir:
            return None
        run_dir = self.config.run.output_dir / self.config.run.name
        run_dir.mkdir(parents=True, exist_ok=True)
        return run_dir

    def _locks(self) -> dict[str, asyncio.Lock]:
        """One fair lock per colocated group. logp shares the trainer's weights, so it always
        takes turns with train: a proximal score then never straddles an optimizer step."""
        groups = colocated_groups(self.config)  # flow.colocate, plus roles sharing Ray devices
        if "logp" in self.config.flow.stages and not any({"logp", "train"} <= g for g in groups):
            merged = {"logp", "train"}.union(*[g for g in groups if g & {"logp", "train"}])
            groups = [g for g in groups if not g & {"logp", "train"}] + [merged]
        locks: dict[str, asyncio.Lock] = {}
        for group in groups:
            lock = asyncio.Lock()
            locks.update({role: lock for role in group})
        return locks

    def _build_graph(self, services: FlowServices) -> list[StateMachine]:
        cfg = self.config
        stages = cfg.flow.stages
        if "ref_logp" in stages and services.components.reference is None:
            raise ValueError("flow.stages has ref_logp but the engines provide no reference model")
        locks = self._locks()
        inbox: ReceiveChannel[Any] | None = None
        machines: list[StateMachine] = []
        self.channels = []
        for i, name in enumerate(stages):
            outbox: SendChannel[Any] | None = None
            next_inbox: ReceiveChannel[Any] | None = None
            if i + 1 < len(stages):
                outbox, next_inbox = open_channel(f"{name}->{stages[i + 1]}", cfg.flow.channel_capacity)
                self.channels.append(next_inbox)
            machines.append(create_role_state_machine(name, services, inbox=inbox, outbox=outbox, lock=locks.get(name)))
            inbox = next_inbox
        machines.append(create_role_state_machine("param_update", services, lock=locks.get("param_update")))
        if cfg.validation.every_versions is not None:
            machines.append(create_role_state_machine("validate", services, lock=locks.get("validate")))
        return machines

    async def _supervise(self) -> None:
        """Run every machine; stop the rest when train is done; surface the first failure."""
        try:
            async with asyncio.TaskGroup() as tasks:
                running = {m.name: tasks.create_task(m.run(), name=f"tandem:{m.name}") for m in self.machines}
                # asyncio.wait, not await: a failure must surface once, from the group itself.
                try:
                    await asyncio.wait([running["train"]])
                except asyncio.CancelledError:
                    # Cancelled from outside, not by a failed stage (the group cancels the
                    # roles only after this): a clean stop, so the train step in progress ends.
                    if not any(t.done() and not t.cancelled() and t.exception() for t in running.values()):
                        for machine in self.machines:
                            if isinstance(machine, TrainStateMachine):
                                machine.finish_step_on_stop = True
                    raise
                for task in running.values():
                    task.cancel()
        except BaseExceptionGroup as group:
            raise _root_cause(group) from None

    def _result(self, services: FlowServices, wall_s: float, run_dir: Path | None, port: int | None) -> FlowResult:
        return FlowResult(
            steps=services.history.steps,
            syncs=services.history.syncs,
            validations=services.history.validations,
            mode_changes=services.history.mode_changes,
            ledger=services.ledger.summary(),
            drops=services.ledger.drops,
            staleness_counts=dict(sorted(services.history.staleness_counts.items())),
            final_version=services.clock.trained,
            wall_s=wall_s,
            channels={ch.name: ch.statistics() for ch in self.channels},
            roles={
                m.name: RoleSummary(
                    state_seconds={s.value: t for s, t in m.state_seconds.items()},
                    transitions=sum(m.transitions.values()),
                    items=m.items_done,
                )
                for m in self.machines
            },
            run_dir=run_dir,
            metrics_port=port,
            resumed_from_version=services.resumed.version if services.resumed is not None else None,
        )

    @staticmethod
    def _summary(result: FlowResult) -> dict[str, Any]:
        rewards = [s.reward_mean for s in result.steps]
        return {
            "steps": len(result.steps),
            "final_version": result.final_version,
            "wall_s": result.wall_s,
            "samples_per_s": result.samples_per_s,
            "tokens_per_s": result.tokens_per_s,
            "reward_first": rewards[0] if rewards else None,
            "reward_last": rewards[-1] if rewards else None,
            "staleness_counts": result.staleness_counts,
            "ledger": result.ledger,
            "resumed_from_version": result.resumed_from_version,
            "degradations": sum(m.degraded for m in result.mode_changes),
            "validation": [{"version": v.version, "reward_mean": v.reward_mean, "accuracy": v.accuracy}
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
