"""The flow's sections: what to run, the off-policy bound, the stage graph and roles, the training
schedule, sampling, held-out evaluation and observability."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from tandem.core.config.section import Section

__all__ = [
    "DEFAULT_STAGES",
    "ROLE_NAMES",
    "FlowConfig",
    "LatencySpec",
    "ObservabilityConfig",
    "RoleConfig",
    "RolloutConfig",
    "RunConfig",
    "StalenessConfig",
    "TrainConfig",
    "ValidationConfig",
]


ROLE_NAMES = (
    "dataloader", "generate", "rollout", "logp", "ref_logp", "teacher_logp", "critic", "reward", "train", "param_update",
    "validate",
)
# The chain of roles that exchange items over channels; param_update and validate are driven by
# the version clock instead. A config may insert custom stages anywhere between dataloader and train.
DEFAULT_STAGES = ["dataloader", "generate", "rollout", "logp", "ref_logp", "reward", "train"]


class LatencySpec(Section):
    """A distribution of durations in seconds, for the fake engines and the simulator."""

    type: Literal["constant", "uniform", "exponential", "lognormal"] = "constant"
    """Shape of the distribution."""
    mean_s: float = Field(0.0, ge=0.0)
    """Mean duration in seconds (for lognormal: the mean of the distribution, not of its log)."""
    sigma: float = Field(1.0, ge=0.0)
    """Lognormal: std-dev of the log; uniform: half-width as a fraction of the mean."""


class RunConfig(Section):
    """What to run and where its outputs go."""

    name: str = "tandem"
    """Run name; the run folder is ``output_dir/name``."""
    seed: int = 0
    """Seed for every random choice of the run (data order, sampling, fake latencies)."""
    max_steps: int = Field(20, ge=1)
    """Train steps (versions) to train; the flow stops cleanly after the last one."""
    output_dir: Path = Path("runs")
    """Where run folders (metrics JSONL, trace, plots, checkpoints) are written."""
    save_steps: int | None = Field(None, ge=1)
    """Write a resumable checkpoint (``checkpoints/step_N`` in the run folder) every this many
    train steps; one is also written at the end and at a clean stop (Ctrl-C). None: only those."""
    keep_checkpoints: int = Field(2, ge=1)
    """Resumable checkpoints kept; older ones are removed once a newer one is complete."""
    resume: bool | Path = False
    """``true``: continue from the newest intact checkpoint in the run folder; a path: from that
    checkpoint (or the newest intact one in that folder). Same version, data position, in-flight
    prompts generated again. ``max_steps`` counts from the start of the original run."""


class StalenessConfig(Section):
    """How far generation may run ahead of training.

    Give at most one of the four knobs; they mean the same bound ``k`` in our peers' words:
    ``max_staleness`` (ours) = ``max_head_offpolicyness`` (AReaL) = ``async_generation_ratio``
    (ROLL, integer values only) = ``generate_ahead_steps - 1`` (counts the current step too).
    """

    max_staleness: int | None = Field(None, ge=0)
    """k: a sample trained at step t was started at policy version >= t - k (a version is a train
    step, however many optimizer steps it takes: ``train.mini_batches``). 0 = synchronous."""
    max_head_offpolicyness: int | None = Field(None, ge=0)
    """AReaL's name for k."""
    async_generation_ratio: float | None = Field(None, ge=0)
    """ROLL's name for k; only whole numbers are accepted since our bound counts whole steps."""
    generate_ahead_steps: int | None = Field(None, ge=1)
    """Steps of prompts generation may have open at once, the current one included: k + 1."""
    max_concurrent_rollouts: int | None = Field(None, ge=1)
    """Cap on prompt groups in flight (admitted, not yet trained); default (k + 1) * prompts_per_step."""
    degrade_after_sync_failures: int | None = Field(None, ge=1)
    """After this many weight syncs in a row failed (each after its retries), admit synchronously
    (bound in force 0) until syncs succeed again; None = never degrade. Needs
    ``roles.param_update.on_error: drop`` (a failed sync is then tolerated and retried)."""
    recover_after_syncs: int = Field(1, ge=1)
    """While degraded: successful syncs in a row that restore the configured k."""
    max_consumption_staleness: int | None = Field(None, ge=0)
    """c < k: a group whose oldest token is more than c versions behind the step that trains it
    is stale at consumption and handled by ``on_stale`` (admission at k lets generation start
    early; c bounds what is trained). None: the admission bound k is the only bound."""
    max_version_span: int | None = Field(None, ge=0)
    """< k: a group with a trajectory whose tokens span more than this many policy versions (a
    partial rollout that went on through weight updates) is handled by ``on_stale`` too; None: any span."""
    on_stale: Literal["train", "drop", "recompute", "withhold"] = "train"
    """What the train role does with a group over ``max_consumption_staleness`` or
    ``max_version_span`` (see ``state_machines.consumption``): ``train`` it anyway (counted),
    ``drop`` it (ledger reason recorded; a fresh prompt refills its slot), ``recompute`` it
    (the same prompt generated again for the same step), or ``withhold`` it to the next step
    while its admission bound still holds there (its slot refilled now). A refill or
    regeneration is admitted only once the rollout serves a version that keeps it within both
    bounds, so it is never stale itself: each stale group costs at most one refill."""

    @model_validator(mode="after")
    def _consumption_bounds(self) -> StalenessConfig:
        for name in ("max_consumption_staleness", "max_version_span"):
            value = getattr(self, name)
            if value is not None and value >= self.k:
                raise ValueError(
                    f"staleness.{name}={value} must be below the admission bound k={self.k}: a group's tokens "
                    "are never more than k versions old (or apart) when trained, so the check could never fire"
                )
        if self.on_stale != "train" and self.refill_bound is None:
            raise ValueError(
                f"staleness.on_stale={self.on_stale} needs staleness.max_consumption_staleness or "
                "staleness.max_version_span: without a bound no group is ever stale"
            )
        return self

    @property
    def refill_bound(self) -> int | None:
        """The tightest consumption bound (None without one): slots given back are refilled, and
        stale groups regenerated, only under it, so a refill always passes the consumption check."""
        bounds = [b for b in (self.max_consumption_staleness, self.max_version_span) if b is not None]
        return min(bounds) if bounds else None

    @model_validator(mode="after")
    def _one_bound(self) -> StalenessConfig:
        given = {
            name: value
            for name, value in (
                ("max_staleness", self.max_staleness),
                ("max_head_offpolicyness", self.max_head_offpolicyness),
                ("async_generation_ratio", self.async_generation_ratio),
                ("generate_ahead_steps", self.generate_ahead_steps),
            )
            if value is not None
        }
        if self.async_generation_ratio is not None and not float(self.async_generation_ratio).is_integer():
            raise ValueError(
                f"staleness.async_generation_ratio must be a whole number of steps, got "
                f"{self.async_generation_ratio}"
            )
        ks = {name: _to_k(name, value) for name, value in given.items()}
        if len(set(ks.values())) > 1:
            raise ValueError(f"staleness knobs disagree: {ks}; give only one of them")
        return self

    @property
    def k(self) -> int:
        for name in ("max_staleness", "max_head_offpolicyness", "async_generation_ratio", "generate_ahead_steps"):
            value = getattr(self, name)
            if value is not None:
                return _to_k(name, value)
        return 1


def _to_k(name: str, value: float) -> int:
    return int(value) - 1 if name == "generate_ahead_steps" else int(value)


class RoleConfig(Section):
    """Per-role settings: error policy and micro-batching."""

    max_retries: int = Field(0, ge=0)
    """Retries (with exponential backoff) of a failed unit of work before ``on_error`` applies."""
    retry_backoff_s: float = Field(0.05, ge=0.0)
    """First retry delay; doubles each retry."""
    on_error: Literal["fail", "drop"] = "fail"
    """After retries: ``fail`` stops the flow naming stage and samples; ``drop`` records the
    samples as dropped with the error as reason and carries on (their slots are refilled)."""
    micro_batch_size: int | None = Field(None, ge=1)
    """Items per unit of work for this role; default ``flow.micro_batch_size``."""


class ValidationConfig(Section):
    """Held-out evaluation of the serving policy while training runs (the validate role)."""

    every_versions: int | None = Field(None, ge=1)
    """Evaluate the loaded policy at versions 0, N, 2N, ... as they are loaded; None = off."""
    prompts: int = Field(32, ge=1)
    """Held-out prompts per evaluation (the same ones each time), one sample each."""


class FlowConfig(Section):
    """The graph of stages and the channels between them."""

    stages: list[str] = Field(default_factory=lambda: list(DEFAULT_STAGES))
    """The channel chain, first to last. Must start with dataloader, generate, rollout and end
    with train; ``logp``/``ref_logp`` may be left out; ``critic`` (the value model) goes after rollout
    with ``algorithm.advantage: gae``, ``teacher_logp`` (on-policy distillation) after rollout with a
    ``teacher``; custom stages go anywhere after rollout."""
    custom_stages: dict[str, str] = Field(default_factory=dict)
    """Stage name -> ``module:Class`` of a StateMachine subclass. Naming a built-in role here
    replaces it; a new name adds a stage (list it in ``stages``)."""
    channel_capacity: int = Field(64, ge=1)
    """Items each channel holds before its producer waits (backpressure)."""
    micro_batch_size: int = Field(8, ge=1)
    """Items a stage takes per unit of work, unless its role overrides it."""
    batch_linger_s: float = Field(0.0, ge=0.0)
    """How long a stage waits for a micro-batch to fill once it has one item."""
    colocate: list[list[str]] = Field(default_factory=list)
    """Groups of roles that share devices; each group's roles take turns under one fair lock."""

    @model_validator(mode="after")
    def _valid_chain(self) -> FlowConfig:
        known = set(ROLE_NAMES) | set(self.custom_stages)
        unknown = [s for s in self.stages if s not in known]
        if unknown:
            raise ValueError(
                f"flow.stages names unknown stages {unknown}; allowed: {sorted(known - {'param_update'})} "
                "(add new ones to flow.custom_stages)"
            )
        if len(set(self.stages)) != len(self.stages):
            raise ValueError(f"flow.stages lists a stage twice: {self.stages}")
        if self.stages[:3] != ["dataloader", "generate", "rollout"] or self.stages[-1] != "train":
            raise ValueError(
                f"flow.stages must start with dataloader, generate, rollout and end with train; got {self.stages}"
            )
        for beside in ("param_update", "validate"):
            if beside in self.stages:
                raise ValueError(f"flow.stages: {beside} is not a channel stage; it runs beside the chain")
        for group in self.colocate:
            bad = [r for r in group if r not in known]
            if bad:
                raise ValueError(f"flow.colocate names unknown roles {bad}; allowed: {sorted(known)}")
        for name, target in self.custom_stages.items():
            if ":" not in target:
                raise ValueError(f"flow.custom_stages.{name} must be 'module:Class', got {target!r}")
        return self


class TrainConfig(Section):
    """The training side of the schedule.

    A train step is one *version*: one published set of weights, whatever the number of
    optimizer steps it takes (``mini_batches * epochs``). Staleness (``k``), admission, the
    ledger, param sync and checkpoints count versions."""

    prompts_per_step: int = Field(8, ge=1)
    """Prompt groups per train step (the batch B of the staleness rule)."""
    mini_batches: int = Field(1, ge=1)
    """M: a train step's groups are shuffled (seeded by ``run.seed`` and the step, so a resumed
    run shuffles alike) and split into M mini-batches of whole groups, each one optimizer step
    with its own loss aggregation, gradient clipping and LR-schedule step (verl's
    ``ppo_mini_batch_size`` as a count, AReaL's ``ppo_n_minibatches``); at most
    ``prompts_per_step``. The critic (``algorithm.advantage: gae``) trains on the same plan.
    Past the first optimizer step the weights have left pi_prox: decoupled PPO then needs
    ``algorithm.proximal`` ``recompute`` or ``loglinear`` (``current`` is refused)."""
    epochs: int = Field(1, ge=1)
    """E: passes over a train step's groups, reshuffled each pass: the step takes
    ``mini_batches * epochs`` optimizer steps inside one version (``optimizer_steps`` in the
    step's ``train_metrics``, with the run's running total ``optimizer_steps_total``)."""

    @model_validator(mode="after")
    def _mini_batches_fit(self) -> TrainConfig:
        if self.mini_batches > self.prompts_per_step:
            raise ValueError(
                f"train.mini_batches={self.mini_batches} exceeds train.prompts_per_step={self.prompts_per_step}: "
                "a mini-batch holds whole groups, at least one"
            )
        return self

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps per train step."""
        return self.mini_batches * self.epochs


class RolloutConfig(Section):
    """The sampling side."""

    samples_per_prompt: int = Field(4, ge=1)
    """n: samples per prompt group (GRPO's group size)."""
    max_new_tokens: int = Field(64, ge=1)
    """Longest response, in tokens; in an episode (tasks of kind ``episode``), longest model turn."""
    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass; 1.0 disables it."""
    top_k: int = Field(0, ge=0)
    """Top-k filter; 0 disables it."""
    stop: list[str] = Field(default_factory=list)
    """Stop strings that end a response."""
    with_reward: bool = True
    """Scoring runs per micro-batch of finished samples while the rest are still generated
    (MM-GRPO's and GeRL's ``rollout.with_reward``); false: a rollout call delivers its samples
    only once all of them are finished, so scoring waits for the whole batch (the image
    workload implements false; text workflows always stream)."""


class ObservabilityConfig(Section):
    """Logs, metrics, trace and progress display."""

    log_format: Literal["console", "json"] = "console"
    """structlog renderer."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Lowest level logged."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Serve Prometheus metrics on 127.0.0.1:PORT while running; None = off (0 = any free port)."""
    trace: bool = True
    """Write a Chrome/Perfetto trace (``trace.json``) of every stage's states to the run folder."""
    trace_max_events: int = Field(200_000, ge=1)
    """Stop recording trace events past this many (long runs stay bounded); the trace says so."""
    progress: bool = False
    """Show a progress bar (the CLI turns it on)."""
    write_run_dir: bool = True
    """Write metrics JSONL and the trace into the run folder."""
    keep_steps: int = Field(1000, ge=1)
    """Step and sync records kept in memory for the run's result (the most recent ones; the
    whole run streams to ``metrics.jsonl``), so memory stays flat however long the run."""
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(default_factory=list)
    """Experiment trackers the step, validation and mode rows also go to, each writing offline
    into the run folder: ``tensorboard`` (needs the tensorboard package), ``wandb`` (offline
    mode) and ``mlflow`` (a file store) when installed; none is required."""


