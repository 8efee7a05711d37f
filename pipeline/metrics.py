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
``validation_reward_mean``, ``validation_measure{measure}`` (the task's held-out measure, by
its name), ``validation_version`` (the weight version the latest held-out evaluation ran on),
``rollout_metric{name}`` (a workload's own per-trajectory metrics, e.g. turns per episode,
averaged over the last step); the lag of every trained trajectory, as histograms:
``trajectory_staleness`` (its step minus its first token's version), ``trajectory_version_span``
(newest minus oldest token version),
``trajectory_in_flight_seconds`` (request to delivery), ``trajectory_queued_seconds`` (delivery
to its train step), ``value_staleness`` (with a critic: step minus the critic version of its
values); ``consumption_total{action}`` (what the train role did with arriving groups: stale,
stale_trained, stale_dropped, regenerated, withheld, filtered, zero_variance_trained) and
``dynamic_sampling_filter_rate`` (the last step's filtered groups over filtered plus trained);
``rollout_train_gap{stat}`` (log pi_rollout - log pi_train on the last step's tokens that the
trained weights sampled: mean, abs_max, icepop_fraction; 0 until an engine measures it) and
``weight_probe_gap`` (the largest log-prob gap of the last weight sync's probe: vLLM, LoRA adapters).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from tandem.core.channel import ReceiveChannel
from tandem.core.config import ConfigError
from tandem.core.history import StepRecord, SyncRecord, ValidationRecord
from tandem.core.ledger import Ledger
from tandem.core.staleness import StalenessGate, VersionClock
from tandem.state_machines.consumption import CONSUMPTION_ACTIONS

if TYPE_CHECKING:
    from tandem.state_machines.base import StateMachine

__all__ = ["FlowMetrics"]


class _LiveCollector(Collector):
    def __init__(self, machines: Sequence[StateMachine], channels: Sequence[ReceiveChannel[Any]],
                 clock: VersionClock, ledger: Ledger, gate: StalenessGate) -> None:
        self.machines, self.channels, self.clock, self.ledger, self.gate = machines, channels, clock, ledger, gate

    def collect(self) -> Iterator[Any]:
        from tandem.state_machines.base import State

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


class StepHistogram:
    """A Prometheus histogram fed a whole step's values at once: sorted once, one bisect per
    bucket. The per-trajectory lag series cost a fraction of ``Histogram.observe`` per value
    (a lock and a bucket search each), which at the flow's own rate of tens of thousands of
    samples a second would be a sizeable share of its overhead."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float]) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = [float(b) for b in buckets]
        self.cumulative = [0] * len(self.bounds)  # values <= each bound, so far
        self.count = 0
        self.sum = 0.0

    def observe_all(self, values: Sequence[float]) -> None:
        if not values:
            return
        ordered = sorted(values)
        for i, bound in enumerate(self.bounds):
            self.cumulative[i] += bisect.bisect_right(ordered, bound)
        self.count += len(ordered)
        self.sum += math.fsum(ordered)

    def family(self) -> HistogramMetricFamily:
        buckets = [(floatToGoString(b), c) for b, c in zip(self.bounds, self.cumulative, strict=True)]
        return HistogramMetricFamily(self.name, self.documentation, buckets=[*buckets, ("+Inf", self.count)],
                                     sum_value=self.sum)


class _HistogramCollector(Collector):
    def __init__(self, histograms: Sequence[StepHistogram]) -> None:
        self.histograms = histograms

    def collect(self) -> Iterator[Any]:
        for histogram in self.histograms:
            yield histogram.family()


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
        self.validation_measure = Gauge("tandem_validation_measure", "The task's held-out measure, latest evaluation",
                                        ["measure"], registry=r)
        self.validation_version = Gauge("tandem_validation_version", "Weight version of the latest evaluation",
                                        registry=r)
        self.rollout_metric = Gauge("tandem_rollout_metric", "Mean of a workload's per-trajectory metric, last step",
                                    ["name"], registry=r)
        versions = (0, 1, 2, 3, 4, 6, 8, 16)
        seconds = (0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)
        self.lags = {
            "trajectory_staleness": StepHistogram("tandem_trajectory_staleness",
                                                  "Train step minus the version of a trained trajectory's first token", versions),
            "version_span": StepHistogram("tandem_trajectory_version_span",
                                          "Newest minus oldest token version of a trained trajectory", versions),
            "in_flight_s": StepHistogram("tandem_trajectory_in_flight_seconds",
                                         "Seconds from a trajectory's request to its delivery", seconds),
            "queued_s": StepHistogram("tandem_trajectory_queued_seconds",
                                      "Seconds from a trajectory's delivery to its train step", seconds),
            "value_staleness": StepHistogram("tandem_value_staleness",
                                             "Train step minus the critic version of a trained trajectory's values", versions),
        }
        r.register(_HistogramCollector(list(self.lags.values())))
        self.consumption = Counter("tandem_consumption", "Arriving groups by what the train role did with them",
                                   ["action"], registry=r)
        for action in CONSUMPTION_ACTIONS:
            self.consumption.labels(action)  # every action exported, at 0 until it happens
        self.rollout_train_gap = Gauge(
            "tandem_rollout_train_gap", "log pi_rollout - log pi_train on the last step's fresh trained tokens "
            "(stat: mean, abs_max, icepop_fraction)", ["stat"], registry=r,
        )
        for stat in ("mean", "abs_max", "icepop_fraction"):
            self.rollout_train_gap.labels(stat)  # exported from the start, as the unlabelled gauges are
        self.probe_gap = Gauge("tandem_weight_probe_gap", "Largest log-prob gap of the last sync's probe (nats)",
                               registry=r)
        self.filter_rate = Gauge("tandem_dynamic_sampling_filter_rate",
                                 "Last step's groups filtered by dynamic sampling over filtered plus trained", registry=r)
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
        for field, histogram in self.lags.items():
            histogram.observe_all(getattr(record, field))
        for stat in ("mean", "abs_max", "icepop_fraction"):
            value = record.train_metrics.get(f"rollout_gap_{stat}")
            if value is not None:
                self.rollout_train_gap.labels(stat).set(value)
        for action, count in record.consumption.items():
            self.consumption.labels(action).inc(count)
        filtered = record.consumption.get("filtered", 0)
        self.filter_rate.set(filtered / (filtered + record.groups))

    def observe_sync(self, record: SyncRecord) -> None:
        gap = record.metrics.get("logprob_gap")
        if gap is not None:
            self.probe_gap.set(gap)

    def observe_validation(self, record: ValidationRecord) -> None:
        self.validation_reward.set(record.reward_mean)
        self.validation_measure.labels(record.measure).set(record.score)
        self.validation_version.set(record.version)

    def serve(self, port: int) -> int:
        """Serve on 127.0.0.1:``port`` (0 = any free port); return the bound port.

        A port that cannot be bound (in use, or privileged) is a config error naming the field,
        raised before any role starts."""
        try:
            self._server, _thread = start_http_server(port, addr="127.0.0.1", registry=self.registry)
        except OSError as err:
            raise ConfigError(
                f"observability.metrics_port: cannot serve metrics on 127.0.0.1:{port} ({err.strerror}); "
                "choose another port, 0 for any free one, or null for none"
            ) from None
        return int(self._server.server_address[1])

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
