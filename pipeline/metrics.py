"""Prometheus metrics of a running flow, on 127.0.0.1 only.

Live state (policy versions, channel depths, role state seconds) is read at scrape time by a
collector, so the hot path pays nothing for it; per-step facts (staleness of trained samples,
reward, throughput) are recorded as each step lands. Each flow has its own registry, so
several flows in one process (tests) never share series.

Series (all prefixed ``tandem_``): ``policy_version{role}``, ``param_update_lag``,
``trained_staleness`` (histogram), ``channel_depth{channel}``, ``channel_capacity{channel}``,
``channel_wait_seconds_total{channel,end}``, ``role_state{role,state}``,
``role_state_seconds_total{role,state}``, ``role_transitions_total{role}``,
``role_items_total{role}``, ``samples_per_second``, ``tokens_per_second``, ``reward_mean``,
``train_step``, ``prompts_total{outcome}`` (admitted, trained, dropped),
``prompts_dropped_total{stage}``, ``ledger_balanced`` (1 while admitted = trained + dropped +
in flight), ``staleness_bound`` (the k in force for admission), ``degraded`` (1 while failed
weight syncs hold admission synchronous), ``sync_failures_total``, ``degradations_total``,
``validation_reward_mean``, ``validation_accuracy``, ``validation_version`` (the weight
version the latest held-out evaluation ran on), ``rollout_metric{name}`` (a workload's own
per-trajectory metrics, e.g. turns per episode, averaged over the last step).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from core.channel import ReceiveChannel
from core.history import StepRecord, ValidationRecord
from core.ledger import Ledger
from core.staleness import StalenessGate, VersionClock

if TYPE_CHECKING:
    from state_machines.base import StateMachine

__all__ = ["FlowMetrics"]


class _LiveCollector(Collector):
    def __init__(self, machines: Sequence[StateMachine], channels: Sequence[ReceiveChannel[Any]],
                 clock: VersionClock, ledger: Ledger, gate: StalenessGate) -> None:
        self.machines, self.channels, self.clock, self.ledger, self.gate = machines, channels, clock, ledger, gate

    def collect(self) -> Iterator[Any]:
        from state_machines.base import State

        version = GaugeMetricFamily("tandem_policy_version", "Policy version each role last worked with", labels=["role"])
        state = GaugeMetricFamily("tandem_role_state", "1 for the state each role is in", labels=["role", "state"])
        seconds = CounterMetricFamily("tandem_role_state_seconds", "Seconds each role spent per state", labels=["role", "state"])
        transitions = CounterMetricFamily("tandem_role_transitions", "State transitions per role", labels=["role"])
        items = CounterMetricFamily("tandem_role_items", "Items each role finished", labels=["role"])
        for m in self.machines:
            version.add_metric([m.name], m.version)
            for s in State:
                state.add_metric([m.name, s.value], 1.0 if m.state is s else 0.0)
                seconds.add_metric([m.name, s.value], m.state_seconds.get(s, 0.0))
            transitions.add_metric([m.name], sum(m.transitions.values()))
            items.add_metric([m.name], m.items_done)
        yield from (version, state, seconds, transitions, items)
        yield GaugeMetricFamily("tandem_param_update_lag", "Trained minus loaded policy version", value=self.clock.lag)
        depth = GaugeMetricFamily("tandem_channel_depth", "Items buffered per channel", labels=["channel"])
        capacity = GaugeMetricFamily("tandem_channel_capacity", "Capacity per channel", labels=["channel"])
        wait = CounterMetricFamily("tandem_channel_wait_seconds", "Seconds spent waiting", labels=["channel", "end"])
        for ch in self.channels:
            st = ch.statistics()
            depth.add_metric([st.name], st.depth)
            capacity.add_metric([st.name], st.capacity)
            wait.add_metric([st.name, "send"], st.send_wait_s)
            wait.add_metric([st.name, "receive"], st.receive_wait_s)
        yield from (depth, capacity, wait)
        prompts = CounterMetricFamily("tandem_prompts", "Prompt groups by outcome", labels=["outcome"])
        prompts.add_metric(["admitted"], self.ledger.admitted)
        prompts.add_metric(["trained"], self.ledger.trained)
        prompts.add_metric(["dropped"], len(self.ledger.drops))
        yield prompts
        dropped = CounterMetricFamily("tandem_prompts_dropped", "Prompt groups dropped, by stage", labels=["stage"])
        counts = self.ledger.drop_counts()
        for m in self.machines:  # every stage, so a run without drops still exports the series
            dropped.add_metric([m.name], counts.get(m.name, 0))
        yield dropped
        yield GaugeMetricFamily("tandem_ledger_balanced", "1 while admitted = trained + dropped + in flight",
                                value=float(self.ledger.balanced))
        yield GaugeMetricFamily("tandem_staleness_bound", "Staleness bound k in force for admission", value=self.gate.k)
        syncs = self.gate.syncs
        yield GaugeMetricFamily("tandem_degraded", "1 while failed weight syncs hold admission synchronous",
                                value=float(syncs.degraded))
        yield CounterMetricFamily("tandem_sync_failures", "Weight syncs that failed after their retries",
                                  value=syncs.failures)
        yield CounterMetricFamily("tandem_degradations", "Times failed syncs degraded admission to synchronous",
                                  value=syncs.degradations)


class FlowMetrics:
    """The registry of one flow, fed by its step history and read live from its objects."""

    def __init__(self, machines: Sequence[StateMachine], channels: Sequence[ReceiveChannel[Any]],
                 clock: VersionClock, ledger: Ledger, gate: StalenessGate, start_s: float) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_LiveCollector(machines, channels, clock, ledger, gate))
        self._start_s = start_s
        self._samples = 0
        self._tokens = 0
        r = self.registry
        self.staleness = Histogram("tandem_trained_staleness", "Trained step minus start version, per group",
                                   buckets=(0, 1, 2, 3, 4, 6, 8, 16), registry=r)
        self.samples_per_s = Gauge("tandem_samples_per_second", "Trained samples per second so far", registry=r)
        self.tokens_per_s = Gauge("tandem_tokens_per_second", "Trained tokens per second so far", registry=r)
        self.reward = Gauge("tandem_reward_mean", "Mean reward of the last trained step", registry=r)
        self.step = Gauge("tandem_train_step", "Optimizer steps done", registry=r)
        self.validation_reward = Gauge("tandem_validation_reward_mean", "Mean held-out reward, latest evaluation",
                                       registry=r)
        self.validation_accuracy = Gauge("tandem_validation_accuracy", "Held-out accuracy, latest evaluation",
                                         registry=r)
        self.validation_version = Gauge("tandem_validation_version", "Weight version of the latest evaluation",
                                        registry=r)
        self.rollout_metric = Gauge("tandem_rollout_metric", "Mean of a workload's per-trajectory metric, last step",
                                    ["name"], registry=r)
        self._server: Any = None

    def observe_step(self, record: StepRecord) -> None:
        for s in record.staleness:
            self.staleness.observe(s)
        self._samples += record.samples
        self._tokens += record.tokens
        elapsed = max(record.time_s - self._start_s, 1e-9)
        self.samples_per_s.set(self._samples / elapsed)
        self.tokens_per_s.set(self._tokens / elapsed)
        self.reward.set(record.reward_mean)
        self.step.set(record.step + 1)
        for name, value in record.rollout_metrics.items():
            self.rollout_metric.labels(name).set(value)

    def observe_validation(self, record: ValidationRecord) -> None:
        self.validation_reward.set(record.reward_mean)
        self.validation_accuracy.set(record.accuracy)
        self.validation_version.set(record.version)

    def serve(self, port: int) -> int:
        """Serve on 127.0.0.1:``port`` (0 = any free port); return the bound port."""
        self._server, _thread = start_http_server(port, addr="127.0.0.1", registry=self.registry)
        return int(self._server.server_address[1])

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
