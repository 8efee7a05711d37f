"""The workflow API: a rollout written as ordinary async Python, one episode per request.

AReaL's idea under our names. Subclass :class:`AgentWorkflow` and write
``async def run(self, engine, item) -> Trajectory``. ``item`` is the task item of the request's
group; ``engine`` is an :class:`EpisodeEngine`, the rollout engine as one episode sees it:
``await engine.generate(prompt_ids)`` samples one completion and returns a :class:`Completion`
(its tokens, behaviour log-probs and per-token policy versions). Between calls, anything goes:
tool calls, several agents sharing one model, early stopping. ``engine.trajectory(prompt_ids)``
gives a :class:`TrajectoryBuilder` that assembles the result with its loss mask: completions are
trained (or not, per completion), every other token (an observation, a tool's answer, another
agent's turn) is masked out with log-prob 0.0 and the version of the token before it::

    class Guess(AgentWorkflow):
        async def run(self, engine, item):
            episode = engine.trajectory(engine.encode(item.prompt, first=True))
            for _ in range(3):
                turn = await engine.generate(episode.context)
                episode.add_completion(turn)
                if turn.text == item.answer:
                    return episode.build(FinishReason.STOP, env_rewards=[1.0])
                episode.add_tokens(engine.encode(" no\n"))
            return episode.build(FinishReason.TRUNCATED)

Name the class in the config (``agentic.workflow: my_module:Guess``); the built-in workflows are
registered by name in ``engines.agentic.registry``. The base class is the
:class:`~core.protocols.RolloutWorkflow` the generate and validate roles drive: ``rollout``
plays every request's episode concurrently (at most ``max_episodes`` at once; the rest wait)
and yields each trajectory as soon as it is done.

Invariants:

- one trajectory per request, carrying the request's ``prompt_id`` and ``index`` (a ``run``
  that returns another's is a bug and fails the call);
- model tokens carry the version the rollout engine stamped on each; any other token carries
  the version of the token before it, so versions never decrease along a trajectory and are
  exact across weight updates mid-episode. A turn that starts after an update is sampled wholly
  under the new weights: each ``generate`` sends the whole context, marked ``continued``, and an
  engine that keeps an episode's cache between turns (the embedded one) keeps only what the
  weights serving now built. Within a turn the engine's ``resume_policy`` applies and
  ``Trajectory.resumed`` records it;
- the ``i``-th ``generate`` call of an episode samples with the seed ``turn_seed(request.seed, i)``:
  an episode's tokens are a function of its request alone, not of the schedule or of the other
  episodes in the batch (so k = 0 reproduces a hand-written synchronous loop);
- an :class:`~core.environment.EpisodeFailure` escaping ``run`` (an environment that raised,
  hung or broke its protocol) fails that episode only: it yields an empty trajectory whose
  ``failure`` holds the reason (the generate role drops the group with it in the ledger) and
  cancels the other episodes of its group still running, which yield failed trajectories too
  (their group is dropped anyway). Any other exception is a bug in the workflow and fails the
  whole call, under the generate role's error policy.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from tandem.core.environment import EnvironmentFactory, EnvironmentRunner, EpisodeFailure
from tandem.core.protocols import GenerationRequest, RolloutEngine, RolloutRequest, SamplingParams
from tandem.core.records import FinishReason, ResumePolicy, TaskItem, Trajectory
from tandem.core.task import Task
from tandem.core.trace import TraceRecorder
from tandem.engines.agentic.payload import EpisodePayload
from tandem.engines.shared.chat import PromptEncoder

__all__ = [
    "AgentWorkflow",
    "Completion",
    "EpisodeEngine",
    "TrajectoryBuilder",
    "WorkflowContext",
    "turn_seed",
]


def turn_seed(request_seed: int, call: int) -> int:
    """The sampling seed of an episode's ``call``-th generation: distinct per call (one seed for
    every turn would replay the same random draws each turn), a function of the request alone."""
    return hash((request_seed, call)) & 0x7FFFFFFF


@dataclass(slots=True, frozen=True)
class WorkflowContext:
    """What a workflow is built with (``engines.agentic.registry`` fills it from the config).

    ``context_tokens`` is an episode's token budget, first prompt through last turn (the model's
    context, or less by config). ``environments`` runs environments off the event loop and
    ``environment`` builds the task's (both None for a task without one). ``prompts`` renders
    messages through the model's chat template (``EpisodeEngine.message``; None: plain tokens).
    """

    engine: RolloutEngine
    tokenizer: Any  # a transformers tokenizer: __call__, decode, eos_token_id
    sampling: SamplingParams
    context_tokens: int
    max_episodes: int
    task: Task | None = None
    environments: EnvironmentRunner | None = None
    environment: EnvironmentFactory | None = None
    prompts: PromptEncoder | None = None


@dataclass(slots=True, frozen=True)
class Completion:
    """One sampled completion (a model turn): tokens, behaviour log-probs, per-token versions.

    ``text`` is what an environment receives: the tokens decoded with special tokens kept, minus
    the end-of-turn token the turn stopped on (a turn cut off by ``max_new_tokens`` has none).
    """

    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    text: str
    resumed: ResumePolicy | None = None


class TrajectoryBuilder:
    """Assembles one trajectory: a first prompt, then completions and other tokens in order.

    Tokens added before the first completion extend the prompt (they are context the first
    action sees). After it, :meth:`add_completion` appends model tokens (trained unless
    ``trained=False``) and :meth:`add_tokens` anything else (masked, log-prob 0.0, the version of
    the token before it).
    """

    def __init__(self, engine: EpisodeEngine, prompt_ids: Sequence[int]) -> None:
        self._engine = engine
        self.prompt_ids = list(prompt_ids)
        self.response_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.loss_mask: list[int] = []
        self.resumed: ResumePolicy | None = None

    @property
    def context(self) -> list[int]:
        """Everything so far: what the next completion is conditioned on."""
        return self.prompt_ids + self.response_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def add_completion(self, completion: Completion, *, trained: bool = True) -> None:
        if self.versions and completion.versions and completion.versions[0] < self.versions[-1]:
            raise ValueError(f"completion sampled at version {completion.versions[0]} after version {self.versions[-1]}")
        self.response_ids += completion.ids
        self.logprobs += completion.logprobs
        self.versions += completion.versions
        self.loss_mask += [int(trained)] * len(completion.ids)
        self.resumed = completion.resumed or self.resumed

    def add_tokens(self, ids: Sequence[int]) -> None:
        """Tokens the model did not sample (environment, tool, another agent): never trained."""
        if not self.response_ids:
            self.prompt_ids += ids
            return
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [self.versions[-1]] * len(ids)
        self.loss_mask += [0] * len(ids)

    def build(
        self,
        finish_reason: FinishReason,
        *,
        actions: Sequence[str] = (),
        env_rewards: Sequence[float] = (),
        outcome: str = "",
        info: dict[str, Any] | None = None,
        metrics: dict[str, float] | None = None,
    ) -> Trajectory:
        """The trajectory, with an :class:`EpisodePayload` holding the given episode facts."""
        request = self._engine.request
        payload = EpisodePayload(
            self.prompt_ids, self.response_ids, self._engine.tokenizer.decode(self.response_ids, skip_special_tokens=True),
            actions=list(actions), env_rewards=list(env_rewards), outcome=outcome, info=dict(info or {}),
        )
        return Trajectory(
            prompt_id=request.prompt_id,
            index=request.index,
            behaviour_logprobs=self.logprobs,
            versions=self.versions,
            start_version=self.versions[0] if self.versions else self._engine.start_version,
            finish_reason=finish_reason,
            payload=payload,
            loss_mask=self.loss_mask,
            resumed=self.resumed,
            metrics=metrics,
        )


class EpisodeEngine:
    """The rollout engine as one episode (one request) sees it."""

    def __init__(self, context: WorkflowContext, request: RolloutRequest, workflow: AgentWorkflow, slot: int) -> None:
        self.request = request
        self.tokenizer = context.tokenizer
        self._prompts = context.prompts
        self.sampling = context.sampling
        self.context_tokens = context.context_tokens
        self.start_version = context.engine.version
        self._engine = context.engine
        self._workflow = workflow
        self._slot = slot
        self._calls = 0
        eos = context.tokenizer.eos_token_id
        self._eos_ids = frozenset() if eos is None else frozenset([eos])

    @property
    def evaluation(self) -> bool:
        """True for the held-out evaluation's requests (the validate role)."""
        return self.request.evaluation

    @property
    def version(self) -> int:
        """The policy version the engine serves now."""
        return self._engine.version

    def encode(self, text: str, *, first: bool = False) -> list[int]:
        """Token ids of ``text``; ``first`` adds the tokenizer's special tokens (``<bos>``), as a
        first prompt has them and later pieces of an episode do not."""
        return list(self.tokenizer(text, add_special_tokens=first)["input_ids"])

    def message(self, text: str, *, after: Completion | None = None) -> list[int]:
        """Token ids of a message to the model (an environment's observation): the episode's first
        (``after`` None) or the one after the model's turn ``after``, rendered through the model's
        chat template as a user turn and the next turn's generation prompt when the model has a
        template, else its plain tokens (``encode``)."""
        if self._prompts is None or not self._prompts.has_template:
            return self.encode(text, first=after is None)
        if after is None:
            return self._prompts.chat([{"role": "user", "content": text}])
        closed = after.finish_reason is FinishReason.STOP and bool(after.ids) and after.ids[-1] in self._eos_ids
        return self._prompts.turn(text, closed=closed)

    def trajectory(self, prompt_ids: Sequence[int]) -> TrajectoryBuilder:
        return TrajectoryBuilder(self, prompt_ids)

    async def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        stop: tuple[str, ...] | None = None,
    ) -> Completion:
        """Sample one completion of ``prompt_ids`` with the run's sampling (some of it overridable)."""
        changes = {"max_new_tokens": max_new_tokens, "temperature": temperature, "stop": stop}
        params = dataclasses.replace(self.sampling, **{k: v for k, v in changes.items() if v is not None})
        seed = turn_seed(self.request.seed, self._calls)
        self._calls += 1
        request = GenerationRequest(self.request.prompt_id, self.request.index, list(prompt_ids), params, seed,
                                    continued=True)
        stream = self._engine.generate([request])
        try:
            [sampled] = [t async for t in stream]
        finally:  # at once, also when the episode is cancelled: the engine frees the row
            close = getattr(stream, "aclose", None)
            if close is not None:
                await close()
        ids = list(sampled.payload.response_ids)
        content = ids[:-1] if ids and sampled.finish_reason is FinishReason.STOP and ids[-1] in self._eos_ids else ids
        return Completion(
            ids, list(sampled.behaviour_logprobs), list(sampled.versions), sampled.finish_reason,
            self.tokenizer.decode(content, skip_special_tokens=False), sampled.resumed,
        )

    def span(self, name: str, start_s: float, end_s: float, **args: Any) -> None:
        """Record an interval (event-loop time) on this episode's trace track, if the run traces."""
        trace = self._workflow.trace
        if trace is not None:
            trace.span(f"episodes {self._slot}", name, start_s, end_s, {"prompt_id": self.request.prompt_id,
                                                                        "index": self.request.index, **args})


class AgentWorkflow:
    """A rollout workflow whose episodes are written as :meth:`run`; implements
    :class:`~core.protocols.RolloutWorkflow`. Subclasses override :meth:`run` (and ``__init__``,
    calling ``super().__init__(context)``, if they need setup)."""

    def __init__(self, context: WorkflowContext) -> None:
        self.context = context
        # The run's trace, handed over by the generate role (``use_trace``); None: no spans.
        self.trace: TraceRecorder | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._limit: asyncio.Semaphore | None = None
        self._free_slots: list[int] = []

    async def run(self, engine: EpisodeEngine, item: TaskItem) -> Trajectory:
        """Play one episode of ``item`` and return its trajectory."""
        raise NotImplementedError(f"{type(self).__name__} must implement async def run(self, engine, item)")

    def use_trace(self, trace: TraceRecorder) -> None:
        """Record episode spans (environment steps) into the run's trace."""
        self.trace = trace

    def rollout(self, requests: Sequence[RolloutRequest]) -> AsyncIterator[Trajectory]:
        return self._rollout(list(requests))

    async def _rollout(self, requests: list[RolloutRequest]) -> AsyncIterator[Trajectory]:
        done: asyncio.Queue[Trajectory | BaseException] = asyncio.Queue()
        failed: dict[int, str] = {}  # prompt_id -> why an episode of that group failed
        tasks: dict[asyncio.Task[Trajectory], RolloutRequest] = {}

        def finished(task: asyncio.Task[Trajectory]) -> None:
            request = tasks[task]
            if task.cancelled():
                # Cancelled because an episode of its group failed (else by the teardown below,
                # and then nobody reads the queue).
                if request.prompt_id in failed:
                    done.put_nowait(self._failed(request, f"another episode of its group failed: {failed[request.prompt_id]}"))
                return
            error = task.exception()
            done.put_nowait(task.result() if error is None else error)

        async def episode(request: RolloutRequest) -> Trajectory:
            try:
                return await self._episode(request)
            except EpisodeFailure as failure:
                failed.setdefault(request.prompt_id, failure.reason)
                for sibling, other in tasks.items():
                    if other.prompt_id == request.prompt_id and sibling is not asyncio.current_task():
                        sibling.cancel()
                return self._failed(request, failure.reason)

        for request in requests:
            task = asyncio.create_task(episode(request))
            tasks[task] = request
            task.add_done_callback(finished)
        try:
            for _ in requests:
                result = await done.get()
                if isinstance(result, BaseException):
                    raise result
                yield result
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _episode(self, request: RolloutRequest) -> Trajectory:
        limit, free_slots = self._episode_limit()
        async with limit:
            slot = free_slots.pop()  # a trace track of its own while it runs: spans never overlap on one
            try:
                trajectory = await self.run(EpisodeEngine(self.context, request, self, slot), request.group.item)
            finally:
                free_slots.append(slot)
        if (trajectory.prompt_id, trajectory.index) != (request.prompt_id, request.index):
            raise ValueError(
                f"{type(self).__name__}.run returned trajectory {trajectory.prompt_id}/{trajectory.index} "
                f"for request {request.prompt_id}/{request.index}"
            )
        return trajectory

    def _episode_limit(self) -> tuple[asyncio.Semaphore, list[int]]:
        """The running loop's limit on episodes at once, and the free trace-track numbers."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._limit is None:  # asyncio primitives belong to one loop
            self._loop = loop
            self._limit = asyncio.Semaphore(self.context.max_episodes)
            self._free_slots = list(range(self.context.max_episodes - 1, -1, -1))  # pop() hands out 0 first
        return self._limit, self._free_slots

    def _failed(self, request: RolloutRequest, reason: str) -> Trajectory:
        """An empty trajectory that says why the episode could not be played."""
        version = self.context.engine.version
        return Trajectory(
            prompt_id=request.prompt_id, index=request.index, behaviour_logprobs=[], versions=[],
            start_version=version, finish_reason=FinishReason.TRUNCATED,
            payload=EpisodePayload(list(request.group.prompt_ids), [], outcome="failed"), loss_mask=[],
            failure=reason,
        )
