"""Builds the text workload's bundle with generation in rollout servers (``engines.rollout: server | sglang``).

What it owns: joining the pieces: the server processes (started here, or the ones at
``engines.servers.urls``, which are left alone), the router over them
(:class:`~engines.server.router.ServerRolloutEngine`, the workflow's engine), the trainer in
this process, and the weight sync from the trainer's dual buffer into the servers by the
configured transport (with ``engines.lora``, the adapter alone, each sync probed on every server:
``engines.server.lora``). Everything else (data, tokenization, reward, checkpoints, the reference
and the teacher in this process) is the embedded bundle's, so the flow sees no difference.

Keys (``engines.servers.api_key`` / ``admin_key``) are read here, once, from where the config
points (an environment variable or a file): started servers get them in their environment (not
their command line, which the process list and the launch log show), the router, the weight
transports and the agents send them; none of them is ever logged.

Agents (``engines.servers.agent``) call the servers' own OpenAI endpoint when it records their
calls (``tandem serve``), else a recording proxy this run serves in front of the router
(``engines.server.agent_proxy``, for vLLM's servers).

Invariants: nothing here waits for a server (the first call that needs them does, in the
flow's loop); an agent's session exits first (the async close, in the flow's loop), then its
proxy stops, then the close callbacks stop the sync, the router, the servers this run started
and the trainer, on success, error and Ctrl-C alike.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from tandem.core.components import Components, TaskSetup
from tandem.core.config import ConfigError, RolloutServersConfig, TandemConfig, TorchEnginesConfig
from tandem.core.protocols import RolloutWorkflow
from tandem.engines.server.agent import OpenAIAgentWorkflow, ServerGateway, load_agent
from tandem.engines.server.agent_proxy import AgentProxy
from tandem.engines.server.auth import ApiKeys
from tandem.engines.server.client import ServerClient
from tandem.engines.server.launcher import ServerFleet, ServerSpec, sglang_command, tandem_command
from tandem.engines.server.lora import ServerProbe
from tandem.engines.server.options import ADMIN_KEY_ENV, API_KEY_ENV
from tandem.engines.server.router import ServerRolloutEngine
from tandem.engines.server.weights import (
    ClosableWeightSync,
    DiskTransport,
    HttpDistTransport,
    HttpShmTransport,
    ServerWeightSync,
    free_port,
)
from tandem.engines.shared.probe import ProbedTransport, ProbedWeightSync
from tandem.engines.shared.weight_sync import TorchWeightSync
from tandem.param_sync import Transport

__all__ = ["ServerKind", "build_server_components", "server_fleet", "server_keys"]


@dataclass(frozen=True, slots=True)
class ServerKind:
    """What differs between kinds of rollout server, so one builder serves them all: how one is
    started (its command and environment), how the router talks to it, how weights reach it,
    and whether it updates weights under running requests (its tokens carry versions)."""

    command: Callable[[str, str, int, str, int], tuple[list[str], dict[str, str]]]  # (model, host, port, name, threads)
    live_updates: bool
    client: Callable[[str, aiohttp.ClientSession], ServerClient] | None = None  # None: sglang's API
    transport: Callable[[ServerRolloutEngine], Transport] | None = None  # None: engines.servers.weight_transport's
    wrap_sync: Callable[[TorchWeightSync], Any] = lambda sync: sync  # the flow's sync around the trainer's
    key_env: Callable[[ApiKeys], dict[str, str]] | None = None  # the environment that gives a started server its key
    # Whether its OpenAI endpoint records an agent's calls (token ids, log-probs, versions) per
    # conversation, as tandem serve's does; if not, the run serves its agents a recording proxy.
    records_agents: bool = True


def server_keys(servers: RolloutServersConfig) -> ApiKeys:
    """The keys the config points to, read now (:class:`ConfigError` naming the field if absent)."""
    return ApiKeys(
        api_key=servers.api_key.read("engines.servers.api_key") if servers.api_key is not None else None,
        admin_key=servers.admin_key.read("engines.servers.admin_key") if servers.admin_key is not None else None,
    )


def tandem_key_env(keys: ApiKeys) -> dict[str, str]:
    """``tandem serve`` reads its keys from these variables when no option gives them."""
    env = {}
    if keys.api_key is not None:
        env[API_KEY_ENV] = keys.api_key.get_secret_value()
    if keys.admin_key is not None:
        env[ADMIN_KEY_ENV] = keys.admin_key.get_secret_value()
    return env


def server_fleet(
    config: TandemConfig, model_path: str, threads: int, run_dir: Path, kind: ServerKind | None = None,
    keys: ApiKeys | None = None, weights_dir: Path | None = None,
) -> ServerFleet:
    """The server processes ``config`` asks the run to start (not yet started), given ``keys``;
    ``weights_dir``: the folder the disk transport writes (the only one they may load from)."""
    spec = config.engines
    assert isinstance(spec, TorchEnginesConfig)
    servers = spec.servers
    keys = keys or ApiKeys()
    if keys.admin_key is not None and (kind is not None or spec.rollout != "server"):
        raise ConfigError(f"engines.servers.admin_key: only tandem's servers (rollout: server) take a separate admin key, "
                          f"not {spec.rollout}'s; give api_key alone")
    specs = []
    for i in range(servers.servers):
        port = servers.base_port + i if servers.base_port is not None else free_port(servers.host)
        name = f"{spec.rollout}{i}"
        if kind is not None:
            command, env = kind.command(model_path, servers.host, port, name, threads)
            if keys.any:
                if kind.key_env is None:
                    raise ConfigError(f"engines.servers.api_key: {spec.rollout}'s servers take no key")
                env = {**env, **kind.key_env(keys)}
        elif spec.rollout == "sglang":
            command = sglang_command(model_path, servers.host, port, dtype=spec.dtype, api_key=keys.api_key)
            env = {"CUDA_VISIBLE_DEVICES": str(i)} if spec.device.startswith("cuda") else {}
        else:
            command = tandem_command(
                model_path, servers.host, port, name=name, threads=threads, max_batch_size=spec.max_batch_size,
                resume_policy=spec.resume_policy, dtype=spec.dtype, device=spec.device,
                consume_bucket_mb=config.param_sync.consume_bucket_mb,
                weight_dirs=[weights_dir] if servers.weight_transport == "disk" and weights_dir is not None else [],
                group_addresses=[servers.trainer_address] if servers.weight_transport == "dist" else [],
                allow_unauthenticated=servers.allow_unauthenticated, lora=spec.lora,
            )
            env = tandem_key_env(keys)
        specs.append(ServerSpec(name, command, f"http://{servers.host}:{port}", run_dir / f"{name}.log", env))
    return ServerFleet(specs, startup_timeout_s=servers.startup_timeout_s, max_restarts=servers.max_restarts)


def agent_proxy(model_path: str, tokenizer: Any, router: ServerRolloutEngine, keys: ApiKeys) -> AgentProxy:
    """The recording proxy for agents on servers that keep no record of their calls, serving the
    model at ``model_path`` with the run's ``tokenizer`` and asking the agents for the API key."""
    from transformers import AutoConfig

    model = AutoConfig.from_pretrained(model_path)
    return AgentProxy(router, tokenizer=tokenizer, model_path=model_path, context=int(model.max_position_embeddings),
                      vocab_size=int(model.vocab_size), api_key=keys.api_key)


def build_server_components(config: TandemConfig, setup: TaskSetup, kind: ServerKind | None = None) -> Components:
    """The text workload's bundle with generation in servers (see the module docstring); ``kind``
    None: tandem serve or sglang, as ``engines.rollout`` says."""
    from tandem.engines.text.build import (
        prompt_budget,
        prompt_encoder,
        reference_engine,
        resolve_model_path,
        run_tokenizer,
        sampling_params,
        teacher_engine,
        teacher_path,
        thread_budgets,
        tokenized,
        tokenized_held_out,
        trainer_with_export,
    )
    from tandem.engines.text.workflow import SingleTurnWorkflow

    spec = config.engines
    assert isinstance(spec, TorchEnginesConfig)
    servers = spec.servers
    model_path = str(resolve_model_path(spec.model_path))
    tokenizer = run_tokenizer(config)
    max_prompt_tokens = prompt_budget(config, tokenizer)  # before anything starts: bad input fails fast
    teaching = teacher_path(config, tokenizer) if config.teacher is not None else None  # likewise
    encode = prompt_encoder(config, tokenizer, setup.items)
    agent = load_agent(servers.agent) if servers.agent is not None else None

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    keys = server_keys(servers)  # before anything starts: a missing key fails fast
    gen_threads, train_threads = thread_budgets(config)
    scratch = Path(tempfile.mkdtemp(prefix="tandem-servers-"))
    weights_dir = servers.weights_dir or scratch / "weights"
    fleet: ServerFleet | None = None
    try:  # a failure anywhere below stops every server already spawned and removes the scratch folder
        if not servers.urls:
            fleet = server_fleet(config, model_path, gen_threads, config.run.output_dir / config.run.name / "servers", kind,
                                 keys, weights_dir)
            fleet.launch()
        router = ServerRolloutEngine(
            servers.urls or fleet.urls,  # type: ignore[union-attr]
            decode=decode,
            live_updates=kind.live_updates if kind is not None else spec.rollout == "server",
            request_timeout_s=servers.request_timeout_s, health_interval_s=servers.health_interval_s,
            wait_for_server_s=servers.startup_timeout_s, ready=fleet.ready if fleet is not None else None,
            client=kind.client if kind is not None else None, keys=keys,
        )
        recorded = agent is None or kind is None or kind.records_agents
        proxy = None if recorded else agent_proxy(model_path, tokenizer, router, keys)
        engine, checkpoint = trainer_with_export(config, train_threads, tokenizer)
        transport: Transport
        if kind is not None and kind.transport is not None:
            transport = kind.transport(router)
        elif servers.weight_transport == "shm":
            transport = HttpShmTransport(router.receivers, timeout_s=servers.request_timeout_s, keys=keys)
        elif servers.weight_transport == "dist":
            backend = "nccl" if spec.device.startswith("cuda") else "gloo"
            transport = HttpDistTransport(
                router.receivers, master_address=servers.trainer_address, backend=backend,
                checksums=spec.rollout == "server", timeout_s=servers.request_timeout_s, keys=keys,
            )
        else:
            transport = DiskTransport(router.receivers, weights_dir, timeout_s=servers.request_timeout_s, keys=keys)
        if spec.lora is not None:  # the adapter alone travels; each sync proven on every server (engines.server.lora)
            assert engine.probe is not None  # a trainer with an adapter records the probe (one process or a group)
            probed = ProbedTransport(
                transport, engine.probe, ServerProbe(router.receivers, timeout_s=servers.request_timeout_s, keys=keys),
                max_gap=spec.lora.max_gap(spec.dtype), what="the adapter",
            )
            through = TorchWeightSync.through(engine, probed, produce_bucket_mb=config.param_sync.produce_bucket_mb)
            inner: ClosableWeightSync = ProbedWeightSync(through, probed)
        else:
            inner = TorchWeightSync.through(engine, transport, produce_bucket_mb=config.param_sync.produce_bucket_mb)
        weight_sync = ServerWeightSync(kind.wrap_sync(inner) if kind is not None else inner, router)
        router.resync = weight_sync.reload
        if fleet is not None:
            fleet.on_restart = router.restarted
        reference = reference_engine(config, train_threads) if "ref_logp" in config.flow.stages else None
        teacher = teacher_engine(config, teaching, train_threads) if teaching is not None else None
    except BaseException:
        if fleet is not None:
            fleet.stop()
        shutil.rmtree(scratch, ignore_errors=True)
        raise

    workflow: RolloutWorkflow
    aclosers: list[Callable[[], Awaitable[None]]] = []
    closers: list[Callable[[], None]] = []
    if agent is not None:  # imported above: a bad path fails before any server starts
        workflow = OpenAIAgentWorkflow(router, agent, decode=decode, sampling=sampling_params(config), api_key=keys.api_key,
                                       gateway=proxy or ServerGateway())
        aclosers.append(workflow.aclose)  # the agent's session exits while the servers still run
        if proxy is not None:
            aclosers.append(proxy.aclose)  # then the proxy it called
            closers.append(proxy.close)  # its port, if the run's loop ended before the async close
    else:
        workflow = SingleTurnWorkflow(router, sampling_params(config))

    # The sync first (a transfer in flight finishes against live servers), then the router, the servers, the trainer.
    closers += [weight_sync.close, router.close, *([fleet.stop] if fleet is not None else []), engine.close,
                *[scorer.close for scorer in (reference, teacher) if scorer is not None],
                lambda: shutil.rmtree(scratch, ignore_errors=True)]
    return Components(
        prompts=tokenized(setup.items, encode),
        held_out=tokenized_held_out(setup.task, encode),
        workflow=workflow,
        trainer=engine,
        reward=setup.reward,
        weight_sync=weight_sync,
        reference=reference,
        teacher=teacher,
        close_callbacks=closers,
        aclose_callbacks=aclosers,
        save_checkpoint=checkpoint,
        max_prompt_tokens=max_prompt_tokens,
    )
