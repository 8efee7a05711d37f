"""Fake engines with controlled timing and no model: for tests, the simulator and benchmarks.

They implement the same protocols as the real engines, shipped as real code (as httpx ships
``MockTransport``): the whole flow runs on them without torch. Durations are drawn from
:class:`~core.config.LatencySpec` distributions with a seeded RNG and spent with
``asyncio.sleep``, so under a virtual clock (looptime) a 512-worker run takes seconds and is
deterministic.

Faithful where the flow's correctness is concerned:
- the rollout engine decodes at most ``slots`` sequences at once and stamps every token with
  the weight version that was loaded when that token was produced (weights may change in the
  middle of a sequence: a partial rollout that kept its cache);
- the train engine's version counts train steps, and its ``optimizer_steps`` metrics count one
  per mini-batch of the step's plan; log-probs have one value per token;
- the critic (a flow with a critic stage) counts its own train steps; its values move as it trains;
- the reference and the teacher (a flow with a teacher) are frozen: version 0, log-probs a fixed
  offset from the behaviour policy's;
- the fake policy answers a prompt right (its response text is the item's answer) with a
  probability that rises with the weight version it started with, so a run scored by the
  task's reward (the synthetic task's exact match by default) visibly "learns".

Faults, from ``engines.faults`` (per role, seeded): a call may be held up by an extra delay and
may raise :class:`InjectedFault`, so the error policies, the ledger and weight-sync degradation
can be exercised by tests, the soak benchmark and users alike. A failed train step leaves the
version unchanged; a failed sync leaves the old weights serving; a failed generation call
delivers a random part of its samples first.
"""

from __future__ import annotations

import asyncio
import bisect
import heapq
import json
import math
import random
from collections import deque
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from tandem.core.components import Components, TaskSetup
from tandem.core.config import FakeEnginesConfig, FaultSpec, LatencySpec, TandemConfig
from tandem.core.protocols import LossObjective, Reward, RewardResult, RolloutRequest, SyncReport
from tandem.core.records import FinishReason, PromptGroup, ResumePolicy, TokenPayload, Trajectory

__all__ = [
    "FakeFrozenScorer",
    "FakeRolloutEngine",
    "FakeTrainEngine",
    "FakeValueEngine",
    "FakeWeightSync",
    "FaultInjector",
    "InjectedFault",
    "LatencySampler",
    "SlowReward",
    "build_fake_components",
]


class LatencySampler:
    """Draws durations (seconds) from a :class:`LatencySpec` with its own seeded RNG."""

    def __init__(self, spec: LatencySpec, seed: int) -> None:
        self.spec = spec
        self._rng = random.Random(seed)
        # lognormal parametrised by its mean: E[X] = exp(mu + sigma^2 / 2)
        self._mu = math.log(spec.mean_s) - spec.sigma**2 / 2 if spec.mean_s > 0 else 0.0

    def __call__(self) -> float:
        s = self.spec
        if s.mean_s == 0.0:
            return 0.0
        if s.type == "constant":
            return s.mean_s
        if s.type == "uniform":
            return s.mean_s * (1.0 + s.sigma * (2.0 * self._rng.random() - 1.0))
        if s.type == "exponential":
            return self._rng.expovariate(1.0 / s.mean_s)
        return self._rng.lognormvariate(self._mu, s.sigma)


async def _spend(seconds: float) -> None:
    if seconds > 0:
        await asyncio.sleep(seconds)


class InjectedFault(RuntimeError):
    """A failure the fake engines raise on purpose (``engines.faults``)."""


class FaultInjector:
    """Seeded faults for one role's engine calls: an extra delay, then maybe a failure."""

    def __init__(self, role: str, spec: FaultSpec, seed: int) -> None:
        self.role = role
        self.spec = spec
        self._rng = random.Random(seed)
        self._delay = LatencySampler(spec.delay, seed + 1)
        self.failures = 0  # faults raised so far
        self.delays = 0  # calls held up so far

    async def enter(self) -> bool:
        """Start a call: spend the injected delay, if drawn; True if this call must fail."""
        if self.spec.delay_rate and self._rng.random() < self.spec.delay_rate:
            self.delays += 1
            await _spend(self._delay())
        return bool(self.spec.failure_rate) and self._rng.random() < self.spec.failure_rate

    async def check(self) -> None:
        """Start a call that fails as a whole: delay, then raise if this call is to fail."""
        if await self.enter():
            raise self.fault()

    def fault(self) -> InjectedFault:
        self.failures += 1
        return InjectedFault(f"injected {self.role} fault #{self.failures}")

    def cut(self, n: int) -> int:
        """How many of a failing call's ``n`` results it delivers before it raises."""
        return self._rng.randrange(n) if n > 0 else 0


class FakeRolloutEngine:
    """A rollout workflow with ``slots`` decode slots and drawn sequence durations.

    Event-driven, as a discrete-event simulator: a waiting request takes the first free slot,
    its duration is drawn when it starts, and a timer delivers it when it ends. No task per
    sequence, so a simulated cluster of hundreds of slots runs fast on a virtual clock.

    Implements :class:`core.protocols.RolloutWorkflow` directly (the fake is its own workload):
    a trajectory's text is the item's answer with probability ``1 - 0.8 * 0.5 ** (v / 10)`` at
    start version ``v``, drawn from the engine's seeded RNG.
    """

    def __init__(
        self,
        slots: int,
        latency: LatencySampler,
        response_tokens: int,
        decode_step_s: float = 0.0,
        faults: FaultInjector | None = None,
        seed: int = 0,
        half_life_versions: float = 10.0,
        max_new_tokens: int | None = None,
    ) -> None:
        self.slots = slots
        self._max_new_tokens = max_new_tokens
        self._faults = faults or no_faults("generate")
        self._decode_step_s = decode_step_s
        self._latency = latency
        self._response_tokens = response_tokens
        self._mean_s = latency.spec.mean_s
        self._rng = random.Random(seed)
        self._half = half_life_versions
        # The version timeline, version i served since times[i], kept back only to the oldest
        # sequence decoding now (older entries can never be read again: memory stays bounded).
        self._times: list[float] = [float("-inf")]
        self._versions: list[int] = [0]
        self._started: list[float] = []  # heap: start times of the sequences decoding now
        self._ended: list[float] = []  # heap: start times of finished ones not yet popped off _started
        self._waiting: deque[tuple[RolloutRequest, asyncio.Queue[Trajectory]]] = deque()
        self.active = 0  # sequences decoding now

    @property
    def version(self) -> int:
        return self._versions[-1]

    def load_version(self, version: int) -> None:
        """Serve ``version`` from now on (weights are swapped between decode steps)."""
        if version < self.version:
            raise ValueError(f"weights must move forward: {self.version} -> {version}")
        now = asyncio.get_running_loop().time()
        self._times.append(now)
        self._versions.append(version)
        while self._ended and self._started[0] == self._ended[0]:
            heapq.heappop(self._started)
            heapq.heappop(self._ended)
        oldest = self._started[0] if self._started else now
        cut = bisect.bisect_right(self._times, oldest) - 1  # the entry in force at ``oldest`` stays
        if cut > 0:
            del self._times[:cut], self._versions[:cut]

    def _version_at(self, t: float) -> int:
        return self._versions[bisect.bisect_right(self._times, t) - 1]

    def _sample(self, request: RolloutRequest, start: float, end: float, duration: float) -> Trajectory:
        length = self._response_tokens
        if self._mean_s > 0:
            # Long sequences take long: tokens scale with the drawn duration.
            length = max(1, round(self._response_tokens * duration / self._mean_s))
        if self._max_new_tokens is not None:
            length = min(length, self._max_new_tokens)
        group = request.group
        first, last = self._version_at(start), self._version_at(end)
        if first == last:
            versions = [first] * length  # no weight update during this sequence
        else:
            step = (end - start) / length
            versions = [self._version_at(start + (i + 1) * step) for i in range(length)]
        right = self._rng.random() < 1.0 - 0.8 * 0.5 ** (versions[0] / self._half)
        token = (group.prompt_id + request.index) % 50
        return Trajectory(
            prompt_id=group.prompt_id,
            index=request.index,
            behaviour_logprobs=[-1.0] * length,
            versions=versions,
            start_version=versions[0],
            finish_reason=FinishReason.STOP,
            payload=TokenPayload(group.prompt_ids, [token] * length, (group.answer or "") if right else "?"),
            resumed=ResumePolicy.KEEP_CACHE if versions[0] != versions[-1] else None,
            metrics={"decode_s": end - start},
        )

    def _fill_slots(self) -> None:
        loop = asyncio.get_running_loop()
        while self._waiting and self.active < self.slots:
            request, out = self._waiting.popleft()
            self.active += 1
            start = loop.time()
            heapq.heappush(self._started, start)
            duration = self._latency()
            end = start + duration
            if self._decode_step_s > 0:
                end = math.ceil(end / self._decode_step_s) * self._decode_step_s
            loop.call_at(end, self._finish, request, out, start, duration)

    def _finish(self, request: RolloutRequest, out: asyncio.Queue[Trajectory], start: float, duration: float) -> None:
        self.active -= 1
        heapq.heappush(self._ended, start)
        out.put_nowait(self._sample(request, start, asyncio.get_running_loop().time(), duration))
        self._fill_slots()

    async def rollout(self, requests: Sequence[RolloutRequest]) -> AsyncIterator[Trajectory]:
        fail = await self._faults.enter()
        deliver = self._faults.cut(len(requests)) if fail else len(requests)
        if self._mean_s == 0.0:
            # Zero-cost fast path (engine-overhead benchmark): no timers, no waits.
            now = asyncio.get_running_loop().time()
            for request in requests[:deliver]:
                yield self._sample(request, now, now, 0.0)
            if fail:
                raise self._faults.fault()
            return
        # Unbounded is safe here: it never holds more than this call's own requests.
        out: asyncio.Queue[Trajectory] = asyncio.Queue()
        mine = [(r, out) for r in requests]
        self._waiting.extend(mine)
        self._fill_slots()
        delivered = 0
        try:
            while delivered < deliver:
                yield await out.get()
                delivered += 1
            if fail:
                raise self._faults.fault()
        finally:
            if delivered < len(requests):
                # Abandoned (cancelled or failed consumer): unqueue what has not started.
                for item in mine:
                    if item in self._waiting:
                        self._waiting.remove(item)


class FakeTrainEngine:
    """A trainer whose step takes a drawn time; its version counts train steps, and it counts
    the optimizer steps of each as a real trainer does (one per mini-batch of the plan)."""

    def __init__(
        self,
        step_latency: LatencySampler,
        logp_latency: LatencySampler,
        train_faults: FaultInjector | None = None,
        logp_faults: FaultInjector | None = None,
    ) -> None:
        self._step_latency = step_latency
        self._logp_latency = logp_latency
        self._train_faults = train_faults or no_faults("train")
        self._logp_faults = logp_faults or no_faults("logp")
        self._version = 0
        self._optimizer_steps = 0

    @property
    def version(self) -> int:
        return self._version

    async def logprobs(self, trajectories: Sequence[Trajectory]) -> list[list[float]]:
        await self._logp_faults.check()
        await _spend(self._logp_latency())
        return [list(t.behaviour_logprobs) for t in trajectories]

    async def train_step(
        self, batch: Sequence[Trajectory], objective: LossObjective, mini_batches: Sequence[Sequence[int]] | None = None
    ) -> dict[str, float]:
        await self._train_faults.check()
        await _spend(self._step_latency())
        steps = 1 if mini_batches is None else len(mini_batches)
        self._version += 1
        self._optimizer_steps += steps
        return {
            "loss": 0.0,
            "trajectories": float(len(batch)),
            "optimizer_steps": float(steps),
            "optimizer_steps_total": float(self._optimizer_steps),
        }

    async def save_state(self, folder: Path) -> None:
        """The fake has no weights: its state is its counts (a few bytes, written in place)."""
        state = {"version": self._version, "optimizer_steps": self._optimizer_steps}
        (folder / "fake_trainer.json").write_text(json.dumps(state))

    async def load_state(self, folder: Path) -> None:
        state = json.loads((folder / "fake_trainer.json").read_text())
        self._version, self._optimizer_steps = state["version"], state["optimizer_steps"]


class FakeValueEngine:
    """A critic whose step takes a drawn time; its version counts the policy steps it trained on.

    Its value of every state is one number, the mean return of the last batch it trained on
    (0 before any): a baseline that moves as it trains, so the values a policy step gets depend
    on which critic version scored them, as with a real critic.
    """

    def __init__(self, step_latency: LatencySampler, score_latency: LatencySampler) -> None:
        self._step_latency = step_latency
        self._score_latency = score_latency
        self._version = 0
        self._baseline = 0.0

    @property
    def version(self) -> int:
        return self._version

    async def values(self, trajectories: Sequence[Trajectory]) -> list[list[float]]:
        await _spend(self._score_latency())
        return [[self._baseline] * t.num_actions for t in trajectories]

    async def train_step(
        self, batch: Sequence[Trajectory], objective: LossObjective, mini_batches: Sequence[Sequence[int]] | None = None
    ) -> dict[str, float]:
        await _spend(self._step_latency())
        returns = [r for t in batch for r in (t.returns or [])]
        if not returns:
            raise ValueError("critic train_step on trajectories without returns")
        error = sum((r - v) ** 2 for t in batch for r, v in zip(t.returns or [], t.values or [], strict=True))
        self._baseline = sum(returns) / len(returns)
        self._version += 1
        return {"value_loss": 0.5 * error / len(returns)}

    async def save_state(self, folder: Path) -> None:
        (folder / "fake_critic.json").write_text(json.dumps({"version": self._version, "baseline": self._baseline}))

    async def load_state(self, folder: Path) -> None:
        state = json.loads((folder / "fake_critic.json").read_text())
        self._version, self._baseline = state["version"], state["baseline"]


class FakeFrozenScorer:
    """A frozen model that only scores, version 0: the reference (log-probs one nat below the
    behaviour policy's) or distillation's teacher (half a nat above them: every token then has
    advantage +0.5)."""

    def __init__(self, latency: LatencySampler, faults: FaultInjector, offset: float) -> None:
        self._latency = latency
        self._faults = faults
        self._offset = offset

    @property
    def version(self) -> int:
        return 0

    async def logprobs(self, trajectories: Sequence[Trajectory]) -> list[list[float]]:
        await self._faults.check()
        await _spend(self._latency())
        return [[lp + self._offset for lp in t.behaviour_logprobs] for t in trajectories]


class SlowReward:
    """Any reward, held up by a drawn latency and injected faults first (the reward role's
    timing and error policy under the fake engines)."""

    def __init__(self, inner: Reward, latency: LatencySampler, faults: FaultInjector | None = None) -> None:
        self._inner = inner
        self._latency = latency
        self._faults = faults or no_faults("reward")

    async def score(self, trajectories: Sequence[Trajectory], groups: Sequence[PromptGroup]) -> list[RewardResult]:
        await self._faults.check()
        await _spend(self._latency())
        return await self._inner.score(trajectories, groups)


class FakeWeightSync:
    """Takes a drawn time, then makes the rollout engine serve the new version."""

    def __init__(self, rollout: FakeRolloutEngine, latency: LatencySampler, faults: FaultInjector | None = None) -> None:
        self._rollout = rollout
        self._latency = latency
        self._faults = faults or no_faults("param_update")

    async def sync(self, version: int) -> SyncReport:
        await self._faults.check()  # raises before the load: the old weights keep serving
        duration = self._latency()
        await _spend(duration)
        self._rollout.load_version(version)
        return SyncReport(version, {"sync_s": duration})


def no_faults(role: str) -> FaultInjector:
    """An injector that never delays or fails (and draws no random numbers)."""
    return FaultInjector(role, FaultSpec(), 0)


def build_fake_components(config: TandemConfig, setup: TaskSetup) -> Components:
    """The fake bundle for a config whose ``engines.type`` is ``fake``: the fake workload
    over the task's items, scored by its reward behind the fake reward latency."""
    spec = config.engines
    assert isinstance(spec, FakeEnginesConfig)
    seed = config.run.seed

    def faults(role: str, offset: int) -> FaultInjector:
        return FaultInjector(role, spec.faults.get(role, FaultSpec()), seed + offset)

    rollout = FakeRolloutEngine(
        spec.generation_slots, LatencySampler(spec.generation_latency, seed + 1), spec.response_tokens,
        spec.decode_step_s, faults("generate", 11), seed=seed + 5, max_new_tokens=config.rollout.max_new_tokens,
    )
    return Components(
        prompts=setup.items,
        workflow=rollout,
        trainer=FakeTrainEngine(
            LatencySampler(spec.train_step_latency, seed + 2), LatencySampler(spec.logp_latency, seed + 3),
            faults("train", 13), faults("logp", 15),
        ),
        reward=SlowReward(setup.reward, LatencySampler(spec.reward_latency, seed + 4), faults("reward", 17)),
        weight_sync=FakeWeightSync(rollout, LatencySampler(spec.sync_latency, seed + 6), faults("param_update", 19)),
        reference=FakeFrozenScorer(LatencySampler(spec.logp_latency, seed + 7), faults("ref_logp", 21), offset=-1.0),
        teacher=(
            FakeFrozenScorer(LatencySampler(spec.logp_latency, seed + 10), no_faults("teacher_logp"), offset=0.5)
            if config.teacher is not None else None
        ),
        critic=(
            FakeValueEngine(LatencySampler(spec.critic_step_latency, seed + 8), LatencySampler(spec.logp_latency, seed + 9))
            if "critic" in config.flow.stages else None
        ),
        held_out=setup.task.held_out,
    )
