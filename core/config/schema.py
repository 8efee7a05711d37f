"""The whole run's config: every section, and the rules between them, each kept beside the section
that imposes it (``engines``, ``algorithm``, ``cluster``) and run here before anything starts."""

from __future__ import annotations

from pydantic import Field, model_validator

from tandem.core.config.algorithm import (
    AlgorithmConfig,
    check_algorithm_stages,
    check_objective_inputs,
    check_proximal_schedule,
)
from tandem.core.config.cluster import ClusterConfig, ParamSyncConfig, check_cluster
from tandem.core.config.engines import EnginesConfig, FakeEnginesConfig, check_rollout_placement
from tandem.core.config.lora import check_lora
from tandem.core.config.run import (
    ROLE_NAMES,
    FlowConfig,
    ObservabilityConfig,
    RoleConfig,
    RolloutConfig,
    RunConfig,
    StalenessConfig,
    TrainConfig,
    ValidationConfig,
)
from tandem.core.config.section import Section
from tandem.core.config.teacher import TeacherConfig, check_teacher
from tandem.core.config.workloads import AgenticConfig, DiffusionConfig, TaskConfig

__all__ = ["TandemConfig"]


class TandemConfig(Section):
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
    teacher: TeacherConfig | None = None
    """On-policy distillation's teacher (with the ``teacher_logp`` stage); None: no teacher."""
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
        check_cluster(self)
        check_rollout_placement(self)
        check_lora(self)
        check_algorithm_stages(self)
        check_teacher(self)
        check_proximal_schedule(self)
        if self.engines.type != "fake" and self.task.name is None:
            raise ValueError(f"task.name: engines.type={self.engines.type} trains a real model: name its task")
        check_objective_inputs(self)
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

    @property
    def max_concurrent(self) -> int:
        cap = self.staleness.max_concurrent_rollouts
        return cap if cap is not None else (self.staleness.k + 1) * self.train.prompts_per_step

    def role(self, name: str) -> RoleConfig:
        return self.roles.get(name, RoleConfig())

    def micro_batch(self, name: str) -> int:
        size = self.role(name).micro_batch_size
        return size if size is not None else self.flow.micro_batch_size


