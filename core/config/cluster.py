"""Where the engines run (this process or a Ray cluster), how weights reach the rollout engines, and
the rules a cluster imposes on the rest of the config."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from tandem.core.config.section import Section

if TYPE_CHECKING:
    from tandem.core.config.schema import TandemConfig

__all__ = ["POOL_ROLES", "ClusterConfig", "ParamSyncConfig", "check_cluster"]


class ParamSyncConfig(Section):
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


POOL_ROLES = ("generate", "train", "ref_logp")


class ClusterConfig(Section):
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




def check_cluster(config: TandemConfig) -> None:
    cluster = config.cluster
    if cluster.backend == "local":
        return
    if config.engines.type != "torch":
        raise ValueError("cluster.backend=ray runs the torch engines as actors: needs engines.type=torch")
    if config.engines.trainer_group is not None and cluster.weight_transport == "dist":
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
        callers = ("generate", "param_update") + (("validate",) if config.validation.every_versions else ())
        short = [r for r in callers if config.role(r).max_retries < 1]
        if short:
            raise ValueError(
                f"cluster.max_actor_restarts > 0 redoes a dead actor's work through the role's retries: "
                f"set roles.{short[0]}.max_retries >= 1"
            )

