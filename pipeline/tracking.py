"""Experiment trackers: the run's rows (steps, validations, mode changes) to TensorBoard, W&B, MLflow.

What it owns: turning a ``metrics.jsonl`` row into named scalars at a global step, and one small
adapter per tracker that writes them, offline, under the run folder. Every tracker is optional:
the libraries are imported only when ``observability.trackers`` names them, and one that is not
installed fails the run before it starts, naming the package to install.

Global steps: a step row is logged at ``step + 1`` (the version it produced), a validation row at
the version it evaluated, a mode change at the trained version when it happened; so every
series shares the policy-version axis.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from tandem.core.config import ConfigError, TandemConfig

__all__ = ["MLflowTracker", "TensorBoardTracker", "Tracker", "WandbTracker", "open_trackers", "scalars"]


class Tracker(Protocol):
    """Receives every row of ``metrics.jsonl`` as it is written."""

    def log(self, row: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def _flat(prefix: str, values: dict[str, Any]) -> Iterator[tuple[str, float]]:
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        yield f"{prefix}{key}", float(value)


def scalars(row: dict[str, Any]) -> tuple[int, dict[str, float]]:
    """(global step, ``name -> value``) of one ``metrics.jsonl`` row; names are grouped by kind
    (``step/``, ``train/``, ``rollout/``, ``validation/``, ``mode/``, ``critic/``)."""
    kind = row.get("kind")
    if kind == "step":
        staleness = row.get("staleness") or [0]
        values = dict(_flat("step/", {k: v for k, v in row.items() if k not in ("step", "staleness")}))
        values["step/staleness_mean"] = sum(staleness) / len(staleness)
        values["step/staleness_max"] = float(max(staleness))
        values.update(_flat("train/", row.get("train_metrics", {})))
        values.update(_flat("rollout/", row.get("rollout_metrics", {})))
        return row["step"] + 1, values
    if kind == "validation":
        return row["version"], dict(_flat("validation/", {k: v for k, v in row.items() if k != "version"}))
    if kind == "mode":
        return row["trained_version"], {"mode/degraded": float(row["degraded"]),
                                        "mode/staleness_bound": float(row["staleness_bound"])}
    if kind == "critic":  # on the policy's axis: the critic's step trained on this policy step's batch
        values = dict(_flat("critic/", row.get("metrics", {})))
        values["critic/version"] = float(row["version"])
        return row["policy_step"] + 1, values
    raise ValueError(f"unknown metrics row kind {kind!r}")


class TensorBoardTracker:
    """Event files under ``run_dir/tensorboard`` (``tensorboard --logdir runs``)."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = run_dir / "tensorboard"
        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, row: dict[str, Any]) -> None:
        step, values = scalars(row)
        for name, value in values.items():
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """A Weights & Biases run in offline mode under ``run_dir/wandb`` (``wandb sync`` uploads it)."""

    def __init__(self, run_dir: Path, config: TandemConfig) -> None:
        import wandb

        self._run = wandb.init(
            project="tandem", name=config.run.name, dir=str(run_dir), mode="offline",
            config=config.model_dump(mode="json"),
        )

    def log(self, row: dict[str, Any]) -> None:
        step, values = scalars(row)
        self._run.log({**values, "policy_version": step})

    def close(self) -> None:
        self._run.finish()


class MLflowTracker:
    """An MLflow run in a file store under ``run_dir/mlruns`` (``mlflow ui --backend-store-uri``)."""

    def __init__(self, run_dir: Path, config: TandemConfig) -> None:
        import mlflow

        self._mlflow = mlflow
        mlflow.set_tracking_uri((run_dir / "mlruns").resolve().as_uri())
        self._run = mlflow.start_run(run_name=config.run.name)
        mlflow.log_params({"staleness.k": config.staleness.k, "run.seed": config.run.seed, "task.name": config.task.name})

    def log(self, row: dict[str, Any]) -> None:
        step, values = scalars(row)
        self._mlflow.log_metrics({name.replace("/", ".") : value for name, value in values.items()}, step=step)

    def close(self) -> None:
        self._mlflow.end_run()


_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def open_trackers(config: TandemConfig, run_dir: Path) -> list[Tracker]:
    """The trackers ``observability.trackers`` names, open; ``ConfigError`` naming the package
    if one is not installed."""
    trackers: list[Tracker] = []
    for name in config.observability.trackers:
        package = _PACKAGES[name]
        if importlib.util.find_spec(package) is None:
            raise ConfigError(f"observability.trackers: {name} needs the {package} package (pip install {package})")
        if name == "tensorboard":
            trackers.append(TensorBoardTracker(run_dir))
        elif name == "wandb":
            trackers.append(WandbTracker(run_dir, config))
        else:
            trackers.append(MLflowTracker(run_dir, config))
    return trackers
