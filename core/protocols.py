"""The seams between the flow and the compute: small protocols every backend implements.

The state machines only ever talk to these protocols, so the same flow drives the fake
engines (tests, simulator), the embedded transformers/torch engines, remote (Ray) engines and
every workload. Engines own their blocking compute: every ``async`` method here must return to
the event loop while the work runs (a thread, a process or a remote actor), never block it.

- :class:`RolloutWorkflow` turns admitted prompt groups into trajectories: the generate and
  validate roles call it, and it is where a workload decides what a trajectory is (one
  completion, a multi-turn episode, a denoising run).
- :class:`RolloutEngine` is the token-level engine text workflows drive.
- :class:`LogProbEngine` / :class:`TrainEngine` score trajectories and take optimizer steps;
  they know no algorithm: the train role hands them a :class:`LossObjective` and the plan of
  the step's mini-batches (``algorithms.mini_batches``).
- :class:`Reward` scores finished trajectories; :class:`WeightSync` moves weights to rollout.
- :class:`ValueEngine` is a critic (PPO with GAE): values per action, and its own optimizer steps.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from tandem.core.records import PromptGroup, TaskItem, Trajectory

__all__ = [
    "Agent",
    "AgentRun",
    "AgentSession",
    "Checkpointable",
    "GenerationRequest",
    "LogProbEngine",
    "LossObjective",
    "PartialTrainStep",
    "Reward",
    "RewardResult",
    "RolloutEngine",
    "RolloutRequest",
    "RolloutWorkflow",
    "SamplingParams",
    "SyncReport",
    "TrainEngine",
    "ValueEngine",
    "WeightSync",
]


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How to sample one token sequence. ``top_k = 0`` and ``top_p = 1.0`` disable those filters."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()


@dataclass(slots=True)
class RolloutRequest:
    """One trajectory to produce: sample ``index`` of ``group``, with its own sampling seed.

    ``evaluation`` marks the held-out evaluation's requests (the validate role), which a
    workload may serve differently from training's (an image workload denoises with more steps).
    Not frozen (one per sample on the hot path: a frozen dataclass's ``__init__`` costs several
    times more); nobody mutates it.
    """

    group: PromptGroup
    index: int
    seed: int
    evaluation: bool = False

    @property
    def prompt_id(self) -> int:
        return self.group.prompt_id


@dataclass(slots=True, frozen=True)
class AgentRun:
    """What an agent is given: the endpoint (``base_url`` for ``openai.AsyncOpenAI``), the task
    item, a seed for its own choices, the run's sampling settings (``rollout.max_new_tokens``,
    ``temperature``, ...: the agent passes them on, or chooses its own), and the tags that file
    its calls under its conversation."""

    base_url: str
    conversation_id: str
    item: TaskItem
    seed: int
    evaluation: bool = False
    sampling: SamplingParams = field(default_factory=SamplingParams)
    extra_body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    # openai's ``api_key``: the servers' API key where they require one (never the admin key);
    # kept out of the repr, so an agent that logs its run does not log the key.
    api_key: str = field(default="unused", repr=False)


Agent = Callable[[AgentRun], Awaitable[object]]
"""An agent trained through an OpenAI-compatible endpoint (``engines.servers.agent``): an
``async`` function run once per rollout request; its calls to ``run.base_url`` are the trajectory."""

AgentSession = Callable[[], AbstractAsyncContextManager[Agent]]
"""An agent that keeps something for the whole run (an HTTP client whose connections outlive an
episode, a pool of sandboxes, a tool server's session): a ``contextlib.asynccontextmanager``
function yielding the per-episode :data:`Agent`. Called and entered once, in the run's event loop,
before the first episode; exited when the run ends (finished, failed or stopped by Ctrl-C)."""


@runtime_checkable
class RolloutWorkflow(Protocol):
    """Produces trajectories for admitted groups with the weights the rollout engines serve.

    Invariant: each request yields exactly one trajectory (``prompt_id``, ``index`` as asked),
    every action stamped with the weight version that produced it.
    """

    def rollout(self, requests: Sequence[RolloutRequest]) -> AsyncIterator[Trajectory]:
        """Start every request now; yield each trajectory as soon as it is finished."""
        ...


@dataclass(slots=True, frozen=True)
class GenerationRequest:
    """One token sequence to sample: sample ``index`` of prompt group ``prompt_id``.

    ``continued``: the caller's next request for the same ``prompt_id`` and ``index`` extends
    this one's prompt and response (the next turn of an episode), so an engine may keep the
    sequence's KV cache for it instead of encoding the whole transcript again. A hint: an engine
    that caches prefixes anyway (vLLM) or cannot keep one ignores it, and the tokens sampled do
    not depend on it beyond float rounding.
    """

    prompt_id: int
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int = 0
    continued: bool = False


@runtime_checkable
class RolloutEngine(Protocol):
    """Samples token sequences with the weights it has loaded.

    Invariant: every token of a returned trajectory is stamped with the weight version that
    produced it, and ``version`` only moves forward.
    """

    @property
    def version(self) -> int:
        """The policy version currently loaded (serving new tokens)."""
        ...

    def generate(self, requests: Sequence[GenerationRequest]) -> AsyncIterator[Trajectory]:
        """Start sampling every request now; yield each sequence as soon as it finishes."""
        ...


@runtime_checkable
class LogProbEngine(Protocol):
    """Scores given trajectories with the weights it holds (policy or reference)."""

    @property
    def version(self) -> int: ...

    async def logprobs(self, trajectories: Sequence[Trajectory]) -> list[list[float]]:
        """Per-action log-probs of each trajectory, aligned with its actions."""
        ...


@runtime_checkable
class LossObjective(Protocol):
    """The loss a train engine applies to each micro-batch (``algorithms.PolicyObjective``).

    ``mean_over`` says what the loss averages over inside a micro-batch, so the engine weights
    micro-batches by their share of the step's ``"tokens"`` (trained actions) or
    ``"sequences"`` and the accumulated gradient is the whole step's.
    """

    @property
    def mean_over(self) -> Literal["tokens", "sequences"]: ...

    def __call__(self, inputs: Any) -> tuple[Any, dict[str, float]]: ...


@runtime_checkable
class Checkpointable(Protocol):
    """An engine whose state a resumable checkpoint holds (the trainer; a reference model)."""

    async def save_state(self, folder: Path) -> None:
        """Write everything a resume needs (weights, optimizer, schedule, version, RNG) as files
        of names of its own into the existing ``folder``, after queued work; the checkpoint
        manifests them."""
        ...

    async def load_state(self, folder: Path) -> None:
        """Restore what ``save_state`` wrote into ``folder``; ``version`` is then the saved one."""
        ...


class PartialTrainStep(RuntimeError):
    """A train step failed after some of its optimizer steps: the trainer's weights are between
    two versions, named by none, so the step can be neither retried nor dropped (the run stops;
    it goes on from a checkpoint). ``__cause__`` is the failure."""

    def __init__(self, version: int, taken: int, steps: int) -> None:
        super().__init__(
            f"the train step from version {version} failed after {taken} of its {steps} optimizer steps: "
            "the weights are no version's"
        )
        self.version = version


@runtime_checkable
class TrainEngine(LogProbEngine, Checkpointable, Protocol):
    """Holds the trained policy; one ``train_step`` is one version (version + 1), taking one
    optimizer step per mini-batch of its plan."""

    async def train_step(
        self, batch: Sequence[Trajectory], objective: LossObjective, mini_batches: Sequence[Sequence[int]] | None = None
    ) -> dict[str, float]:
        """Train on ``batch`` (each trajectory carrying its advantage), minimising ``objective``:
        one optimizer step per entry of ``mini_batches`` (indices into ``batch``, in order; the
        train role's plan), or one over the whole batch without them; returns the step's metrics
        (with ``optimizer_steps`` taken and the trainer's running ``optimizer_steps_total``). A
        failure after the first optimizer step raises :class:`PartialTrainStep`."""
        ...


@runtime_checkable
class ValueEngine(Checkpointable, Protocol):
    """A critic: scores the value of the state before each action, and trains on returns.

    Its ``version`` counts the policy steps it has trained on (one ``train_step`` each, however
    many optimizer steps), independent of the policy's. It knows no algorithm: the critic role
    hands ``train_step`` the value objective (``algorithms.objective.ValueObjective``), whose
    inputs are each trajectory's ``values`` (those its returns were computed with) and ``returns``.
    """

    @property
    def version(self) -> int: ...

    async def values(self, trajectories: Sequence[Trajectory]) -> list[list[float]]:
        """Per-action values of each trajectory (the state before each action), aligned with its actions."""
        ...

    async def train_step(
        self, batch: Sequence[Trajectory], objective: LossObjective, mini_batches: Sequence[Sequence[int]] | None = None
    ) -> dict[str, float]:
        """One critic version on ``batch``: an optimizer step per entry of ``mini_batches`` (as
        :meth:`TrainEngine.train_step`), or one over the batch; returns its metrics."""
        ...


@dataclass(slots=True, frozen=True)
class SyncReport:
    """What a weight sync did: the version now serving, and its timing/byte metrics."""

    version: int
    metrics: dict[str, float]


@runtime_checkable
class WeightSync(Protocol):
    """Moves the trainer's weights into the rollout engines."""

    async def sync(self, version: int) -> SyncReport:
        """Make at least ``version`` the one the rollout engines serve.

        The trainer may have moved on while the sync waited its turn: loading a newer version
        than asked is allowed (fresher is never staler) and the report says which. On failure
        the rollout engines keep serving their old weights and this raises.
        """
        ...


@dataclass(slots=True, frozen=True)
class RewardResult:
    """A trajectory's score; ``ok`` False means a reward failed and ``info`` says why.

    ``components`` holds each named reward before weighting when several are combined.
    """

    reward: float
    ok: bool = True
    info: str = ""
    components: dict[str, float] | None = None


@runtime_checkable
class Reward(Protocol):
    """Scores finished trajectories, each with the group it belongs to; never blocks the loop."""

    async def score(self, trajectories: Sequence[Trajectory], groups: Sequence[PromptGroup]) -> list[RewardResult]:
        ...
