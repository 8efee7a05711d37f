"""Fake engines with controlled timing and no model: for tests, the simulator and benchmarks.

They implement the same protocols as the real engines, shipped as real code (as httpx ships
``MockTransport``): the whole flow runs on them without torch. Durations are drawn from
:class:`~pipeline.config.LatencySpec` distributions with a seeded RNG and spent with
``asyncio.sleep``, so under a virtual clock (looptime) a 512-worker run takes seconds and is
deterministic.

Faithful where the flow's correctness is concerned:
- the rollout engine decodes at most ``slots`` sequences at once and stamps every token with
  the weight version that was loaded when that token was produced (weights may change in the
  middle of a sequence: a partial rollout that kept its cache);
- the train engine's version counts optimizer steps; log-probs have one value per token;
- reward rises with the policy version that produced a sample, so a run visibly "learns".
"""

from __future__ import annotations

import asyncio
import bisect
import json
import math
import random
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

from engines.protocols import GenerationRequest, RewardResult, SamplingParams, SyncReport
from pipeline.components import Components, SourcePrompt
from pipeline.config import FakeEnginesConfig, LatencySpec, TandemConfig
from pipeline.records import FinishReason, ResumePolicy, RolloutGroup, Sample

__all__ = [
    "FakeReward",
    "FakeRolloutEngine",
    "FakeTrainEngine",
    "FakeWeightSync",
    "LatencySampler",
    "build_fake_components",
    "synthetic_prompts",
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


class FakeRolloutEngine:
    """A rollout engine with ``slots`` decode slots and drawn sequence durations.

    Event-driven, as a discrete-event simulator: a waiting request takes the first free slot,
    its duration is drawn when it starts, and a timer delivers it when it ends. No task per
    sequence, so a simulated cluster of hundreds of slots runs fast on a virtual clock.
    """

    def __init__(self, slots: int, latency: LatencySampler, response_tokens: int, decode_step_s: float = 0.0) -> None:
        self.slots = slots
        self._decode_step_s = decode_step_s
        self._latency = latency
        self._response_tokens = response_tokens
        self._mean_s = latency.spec.mean_s
        self._times: list[float] = [float("-inf")]  # version timeline: version i since times[i]
        self._versions: list[int] = [0]
        self._waiting: deque[tuple[GenerationRequest, asyncio.Queue[Sample]]] = deque()
        self.active = 0  # sequences decoding now

    @property
    def version(self) -> int:
        return self._versions[-1]

    def load_version(self, version: int) -> None:
        """Serve ``version`` from now on (weights are swapped between decode steps)."""
        if version < self.version:
            raise ValueError(f"weights must move forward: {self.version} -> {version}")
        self._times.append(asyncio.get_running_loop().time())
        self._versions.append(version)

    def _version_at(self, t: float) -> int:
        return self._versions[bisect.bisect_right(self._times, t) - 1]

    def _sample(self, request: GenerationRequest, start: float, end: float, duration: float) -> Sample:
        length = self._response_tokens
        if self._mean_s > 0:
            # Long sequences take long: tokens scale with the drawn duration.
            length = max(1, round(self._response_tokens * duration / self._mean_s))
        length = min(length, request.params.max_new_tokens)
        first, last = self._version_at(start), self._version_at(end)
        if first == last:
            versions = [first] * length  # no weight update during this sequence
        else:
            step = (end - start) / length
            versions = [self._version_at(start + (i + 1) * step) for i in range(length)]
        return Sample(
            prompt_id=request.prompt_id,
            index=request.index,
            prompt_ids=request.prompt_ids,
            response_ids=[(request.prompt_id + request.index) % 50] * length,
            behaviour_logprobs=[-1.0] * length,
            token_versions=versions,
            start_version=versions[0],
            finish_reason=FinishReason.STOP,
            resumed=ResumePolicy.KEEP_CACHE if versions[0] != versions[-1] else None,
        )

    def _fill_slots(self) -> None:
        loop = asyncio.get_running_loop()
        while self._waiting and self.active < self.slots:
            request, out = self._waiting.popleft()
            self.active += 1
            start = loop.time()
            duration = self._latency()
            end = start + duration
            if self._decode_step_s > 0:
                end = math.ceil(end / self._decode_step_s) * self._decode_step_s
            loop.call_at(end, self._finish, request, out, start, duration)

    def _finish(self, request: GenerationRequest, out: asyncio.Queue[Sample], start: float, duration: float) -> None:
        self.active -= 1
        out.put_nowait(self._sample(request, start, asyncio.get_running_loop().time(), duration))
        self._fill_slots()

    async def generate(self, requests: Sequence[GenerationRequest]) -> AsyncIterator[Sample]:
        if self._mean_s == 0.0:
            # Zero-cost fast path (engine-overhead benchmark): no timers, no waits.
            now = asyncio.get_running_loop().time()
            for request in requests:
                yield self._sample(request, now, now, 0.0)
            return
        # Unbounded is safe here: it never holds more than this call's own requests.
        out: asyncio.Queue[Sample] = asyncio.Queue()
        mine = [(r, out) for r in requests]
        self._waiting.extend(mine)
        self._fill_slots()
        delivered = 0
        try:
            while delivered < len(requests):
                yield await out.get()
                delivered += 1
        finally:
            if delivered < len(requests):
                # Abandoned (cancelled or failed consumer): unqueue what has not started.
                for item in mine:
                    if item in self._waiting:
                        self._waiting.remove(item)


class FakeTrainEngine:
    """A trainer whose step takes a drawn time; its version counts optimizer steps."""

    def __init__(self, step_latency: LatencySampler, logp_latency: LatencySampler) -> None:
        self._step_latency = step_latency
        self._logp_latency = logp_latency
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    async def logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        await _spend(self._logp_latency())
        return [list(s.behaviour_logprobs) for s in samples]

    async def train_step(self, groups: Sequence[RolloutGroup]) -> dict[str, float]:
        await _spend(self._step_latency())
        self._version += 1
        return {"loss": 0.0, "groups": float(len(groups))}

    async def save_state(self, folder: Path) -> None:
        """The fake has no weights: its state is its version (a few bytes, written in place)."""
        (folder / "fake_trainer.json").write_text(json.dumps({"version": self._version}))

    async def load_state(self, folder: Path) -> None:
        self._version = json.loads((folder / "fake_trainer.json").read_text())["version"]


class FakeReferenceEngine:
    """A frozen reference: log-probs one nat below the behaviour policy's."""

    def __init__(self, latency: LatencySampler) -> None:
        self._latency = latency

    @property
    def version(self) -> int:
        return 0

    async def logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        await _spend(self._latency())
        return [[lp - 1.0 for lp in s.behaviour_logprobs] for s in samples]


class FakeReward:
    """Rewards 1.0 with a probability that rises with the sample's policy version."""

    def __init__(self, latency: LatencySampler, seed: int, half_life_versions: float = 10.0) -> None:
        self._latency = latency
        self._rng = random.Random(seed)
        self._half = half_life_versions

    async def score(self, samples: Sequence[Sample], answers: Sequence[str | None]) -> list[RewardResult]:
        await _spend(self._latency())
        out = []
        for sample in samples:
            p = 1.0 - 0.8 * 0.5 ** (sample.start_version / self._half)
            out.append(RewardResult(1.0 if self._rng.random() < p else 0.0))
        return out


class FakeWeightSync:
    """Takes a drawn time, then makes the rollout engine serve the new version."""

    def __init__(self, rollout: FakeRolloutEngine, latency: LatencySampler) -> None:
        self._rollout = rollout
        self._latency = latency

    async def sync(self, version: int) -> SyncReport:
        duration = self._latency()
        await _spend(duration)
        self._rollout.load_version(version)
        return SyncReport(version, {"sync_s": duration})


def synthetic_prompts(seed: int) -> Iterator[SourcePrompt]:
    """An endless, seed-determined stream of small synthetic prompts."""
    rng = random.Random(seed)
    while True:
        a, b = rng.randrange(100), rng.randrange(100)
        yield SourcePrompt(prompt=f"{a}+{b}=", prompt_ids=[a % 50, b % 50], answer=str(a + b))


def build_fake_components(config: TandemConfig) -> Components:
    """The fake bundle for a config whose ``engines.type`` is ``fake``."""
    spec = config.engines
    assert isinstance(spec, FakeEnginesConfig)
    seed = config.run.seed
    rollout = FakeRolloutEngine(
        spec.generation_slots, LatencySampler(spec.generation_latency, seed + 1), spec.response_tokens, spec.decode_step_s
    )
    r = config.rollout
    return Components(
        prompts=synthetic_prompts,
        rollout=rollout,
        trainer=FakeTrainEngine(LatencySampler(spec.train_step_latency, seed + 2), LatencySampler(spec.logp_latency, seed + 3)),
        reward=FakeReward(LatencySampler(spec.reward_latency, seed + 4), seed + 5),
        weight_sync=FakeWeightSync(rollout, LatencySampler(spec.sync_latency, seed + 6)),
        sampling=SamplingParams(r.max_new_tokens, r.temperature, r.top_p, r.top_k, tuple(r.stop)),
        reference=FakeReferenceEngine(LatencySampler(spec.logp_latency, seed + 7)),
    )
