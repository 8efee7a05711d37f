"""Resumable checkpoints of a run: writing them whole, finding the newest intact one, resuming.

A checkpoint is a folder ``run_dir/checkpoints/step_NNNNNNNN`` (N = the policy version) holding:

- the trainer's state (weights, optimizer, LR schedule, version, its RNG), in files the train
  engine writes itself (``TrainEngine.save_state``), so each backend keeps its own format, and
  the frozen scorers' weights (the reference model's, on-policy distillation's teacher's) the
  same way when they can save themselves (a resume then scores with the very weights the run
  started with, whatever happened to their model files since), and the state of every engine a
  role tracks (:meth:`Checkpointer.track`: the critic, which restores itself from ``restored_from``);
- ``flow.json``: the version, the data position (the next prompt id never admitted), the
  ledger of in-flight work (prompts admitted but not trained or dropped: on resume they are
  generated again, under the staleness rule, rather than lost or trained twice), the trained
  count and drop records so far, the weight syncs' record (failures, degraded or not: a run
  saved while degraded resumes degraded), the Python RNG state, and the config values a resume
  must agree with;
- ``MANIFEST.json``: every other file's size and sha256, written last.

Invariants:
- a checkpoint folder appears whole or not at all: it is written under a ``.tmp-`` name, every
  file fsynced, the manifest last, then renamed into place (atomic within a filesystem); a
  crash mid-write leaves only a ``.tmp-`` folder, which is ignored and removed by the next save;
- a checkpoint is trusted only when its manifest lists exactly its files with the recorded sizes
  and digests: a torn or truncated one is skipped with a warning and the one before it is used;
- the snapshot is taken by the train role between two optimizer steps (or by the flow once
  every role has stopped), so weights, version, ledger and data position describe one instant;
- after a resume the gate starts at the restored version (steps ``v .. v + k`` only), so a
  resumed run admits no burst of work staler than the bound.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import structlog

from tandem.core.config import ConfigError, TandemConfig
from tandem.core.ledger import DropRecord, Ledger
from tandem.core.protocols import Checkpointable, LogProbEngine, TrainEngine
from tandem.core.staleness import SyncHealth

__all__ = [
    "CHECKPOINTS_DIR",
    "CheckpointError",
    "Checkpointer",
    "FlowState",
    "find_checkpoint",
    "trim_metrics",
    "verify_checkpoint",
]

log = structlog.get_logger("tandem")

CHECKPOINTS_DIR = "checkpoints"
MANIFEST = "MANIFEST.json"
FLOW_STATE = "flow.json"
_PREFIX = "step_"
_TMP = ".tmp-"
FORMAT = 2
_READS = (1, 2)  # format 1 had no sync record: it resumes with a fresh one
# Config values whose change would make the saved data position or weights mean something else.
_MUST_MATCH = (
    "run.seed", "train.prompts_per_step", "rollout.samples_per_prompt", "task.name", "task.data_path", "engines.type",
)


class CheckpointError(ConfigError):
    """No usable checkpoint where a resume asked for one; the message names the path."""


@dataclass(slots=True, frozen=True)
class FlowState:
    """The flow's side of a checkpoint: where the run stood between two steps."""

    version: int
    next_prompt_id: int  # every prompt below this was admitted once; none above it was
    in_flight: list[int]  # admitted, neither trained nor dropped: generated again on resume
    trained: int
    drops: list[DropRecord]
    python_rng: Any
    config: dict[str, Any]
    syncs: SyncHealth
    reference_saved: bool = False  # the reference model's weights are in the checkpoint too
    teacher_saved: bool = False  # the teacher's weights are in the checkpoint too

    @classmethod
    def capture(
        cls, version: int, ledger: Ledger, config: TandemConfig, syncs: SyncHealth,
        reference_saved: bool = False, teacher_saved: bool = False,
    ) -> FlowState:
        return cls(
            version=version,
            next_prompt_id=ledger.next_prompt_id,
            in_flight=sorted(ledger.in_flight_ids()),
            trained=ledger.trained,
            drops=list(ledger.drops),
            python_rng=random.getstate(),
            config=_fingerprint(config),
            syncs=SyncHealth(**asdict(syncs)),
            reference_saved=reference_saved,
            teacher_saved=teacher_saved,
        )

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FlowState:
        if data.get("format") not in _READS:
            raise CheckpointError(f"{FLOW_STATE} has format {data.get('format')!r}; this tandem reads formats {list(_READS)}")
        rng_version, inner, gauss = data["python_rng"]
        return cls(
            version=data["version"],
            next_prompt_id=data["next_prompt_id"],
            in_flight=list(data["in_flight"]),
            trained=data["trained"],
            drops=[DropRecord(**d) for d in data["drops"]],
            python_rng=(rng_version, tuple(inner), gauss),
            config=data["config"],
            syncs=SyncHealth(**data.get("syncs", {})),
            reference_saved=data.get("reference_saved", False),
            teacher_saved=data.get("teacher_saved", False),
        )


def _fingerprint(config: TandemConfig) -> dict[str, Any]:
    dumped = config.model_dump(mode="json")
    out: dict[str, Any] = {}
    for dotted in _MUST_MATCH:
        node: Any = dumped
        for part in dotted.split("."):
            node = node[part]
        out[dotted] = node
    if config.engines.type == "torch":
        out["engines.model_path"] = dumped["engines"]["model_path"]
        # An adapter's checkpoint holds the adapter alone: it resumes only into the same adapter.
        lora = config.engines.lora
        out["engines.lora"] = None if lora is None else lora.structure
    # Another teacher (or one added or removed) would score what is left of the run differently
    # from what it trained on so far, or restore the wrong weights: the same one, or a fresh run.
    out["teacher.model_path"] = (dumped["teacher"] or {}).get("model_path")
    return out


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verify_checkpoint(folder: Path) -> str | None:
    """None if ``folder`` is an intact checkpoint, else what is wrong with it."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return f"no {MANIFEST}"
    try:
        manifest = json.loads(manifest_path.read_text())
        files: dict[str, dict[str, Any]] = manifest["files"]
    except (ValueError, KeyError, TypeError) as exc:
        return f"unreadable {MANIFEST}: {exc}"
    present = {p.name for p in folder.iterdir()} - {MANIFEST}
    if present != set(files):
        return f"files {sorted(present)} do not match the manifest's {sorted(files)}"
    for name, meta in files.items():
        size = (folder / name).stat().st_size
        if size != meta["size"]:
            return f"{name} has {size} bytes, the manifest says {meta['size']} (truncated?)"
        if _digest(folder / name) != meta["sha256"]:
            return f"{name} does not match its sha256 in the manifest"
    return None


def _step_folders(root: Path) -> list[Path]:
    """Committed checkpoint folders under ``root``, newest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and p.name[len(_PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX):]), reverse=True)


def find_checkpoint(path: Path) -> Path:
    """The checkpoint to resume from: ``path`` itself if it is one, else the newest intact one
    in ``path`` (a ``checkpoints`` folder, or a run folder holding one). Torn ones are skipped
    with a warning; raises :class:`CheckpointError` naming ``path`` when nothing usable is there."""
    if not path.exists():
        raise CheckpointError(f"run.resume: no checkpoint at {path} (no such file or folder)")
    if (path / CHECKPOINTS_DIR).is_dir():
        path = path / CHECKPOINTS_DIR
    if (path / MANIFEST).exists() or path.name.startswith(_PREFIX):
        problem = verify_checkpoint(path)
        if problem is not None:
            raise CheckpointError(f"run.resume: checkpoint {path} is damaged: {problem}")
        return path
    skipped: list[str] = []
    for folder in _step_folders(path):
        problem = verify_checkpoint(folder)
        if problem is None:
            if skipped:
                log.warning("skipped damaged checkpoints", damaged=skipped, using=str(folder))
            return folder
        skipped.append(f"{folder.name}: {problem}")
    detail = f"; damaged: {skipped}" if skipped else ""
    raise CheckpointError(f"run.resume: no intact checkpoint in {path}{detail}")


def trim_metrics(path: Path, version: int) -> None:
    """Make a resumed run's ``metrics.jsonl`` describe the run up to its checkpoint: keep the
    lines up to the row of step ``version - 1``, drop the rest (steps trained after the
    checkpoint are trained again now; a line a killed process left half-written goes too)."""
    if not path.is_file():
        return
    kept: list[str] = []
    if version > 0:
        for line in path.read_text().splitlines(keepends=True):
            kept.append(line)
            try:
                row = json.loads(line)
            except ValueError:
                kept.pop()
                continue
            if row.get("kind", "step") == "step" and row.get("step") == version - 1:
                break
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


class Checkpointer:
    """Writes a run's checkpoints and restores the newest one.

    ``save_steps`` None writes only the checkpoints the flow asks for (end of run, clean stop);
    the newest ``keep`` checkpoints are kept, older ones removed once a newer one is committed.
    """

    def __init__(
        self, config: TandemConfig, run_dir: Path, trainer: TrainEngine,
        reference: LogProbEngine | None = None, teacher: LogProbEngine | None = None,
    ) -> None:
        self._config = config
        self.root = run_dir / CHECKPOINTS_DIR
        self._trainer = trainer
        # The frozen scorers, saved only if they can save themselves (a fake has nothing to save).
        self._frozen: dict[str, Checkpointable] = {
            name: engine for name, engine in (("reference", reference), ("teacher", teacher))
            if isinstance(engine, Checkpointable)
        }
        self._save_steps = config.run.save_steps
        self._keep = config.run.keep_checkpoints
        self.last_version: int | None = None  # of the newest checkpoint this run wrote
        # Engines a role owns and saves with every checkpoint (the critic), beside the trainer.
        self._tracked: list[Checkpointable] = []
        self.restored_from: Path | None = None  # the checkpoint folder this run resumed from

    def track(self, engine: Checkpointable) -> None:
        """Save ``engine``'s state with every checkpoint from now on (a role's own engine, e.g.
        the critic, which restores itself from :attr:`restored_from` on resume)."""
        self._tracked.append(engine)

    async def after_step(self, version: int, ledger: Ledger, syncs: SyncHealth) -> None:
        """Called by the train role right after step ``version - 1`` is recorded."""
        if self._save_steps is not None and version % self._save_steps == 0:
            await self.save(version, ledger, syncs)

    async def save(self, version: int, ledger: Ledger, syncs: SyncHealth) -> Path:
        """Write a checkpoint of ``version`` with the ledger and sync record as they are now;
        returns its folder."""
        # Before any await: one instant.
        state = FlowState.capture(
            version, ledger, self._config, syncs,
            reference_saved="reference" in self._frozen, teacher_saved="teacher" in self._frozen,
        )
        final = self.root / f"{_PREFIX}{version:08d}"
        tmp = self.root / f"{_TMP}{final.name}-{os.getpid()}"
        await asyncio.to_thread(self._prepare, tmp)
        await self._trainer.save_state(tmp)
        for engine in [*self._frozen.values(), *self._tracked]:
            await engine.save_state(tmp)
        if self._trainer.version != version:  # a bug in whoever called: the snapshot would be torn
            raise RuntimeError(f"checkpoint of version {version} found the trainer at version {self._trainer.version}")
        await asyncio.to_thread(self._commit, tmp, final, state)
        self.last_version = version
        log.info("checkpoint saved", path=str(final), version=version, in_flight=len(state.in_flight))
        return final

    def _prepare(self, tmp: Path) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(f"{_TMP}*"):  # what a crash mid-write left behind
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()

    def _commit(self, tmp: Path, final: Path, state: FlowState) -> None:
        (tmp / FLOW_STATE).write_text(json.dumps(state.to_json()))
        files = {}
        for path in sorted(tmp.iterdir()):
            _fsync(path)
            files[path.name] = {"size": path.stat().st_size, "sha256": _digest(path)}
        manifest = tmp / MANIFEST
        manifest.write_text(json.dumps({"format": FORMAT, "version": state.version, "files": files}, indent=1))
        _fsync(manifest)
        if final.exists():  # the same version saved again (a resumed run re-reaching it)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync(self.root)
        for old in _step_folders(self.root)[self._keep :]:
            shutil.rmtree(old, ignore_errors=True)

    def resume_path(self) -> Path | None:
        """Where ``run.resume`` points: this run's checkpoints folder for ``true``, else the path."""
        resume = self._config.run.resume
        if resume is False:
            return None
        return self.root if resume is True else Path(resume)

    async def restore(self, path: Path) -> FlowState:
        """Load the trainer (and the frozen scorers that were saved) from the checkpoint at (or
        newest under) ``path``; return the flow state."""
        folder = await asyncio.to_thread(find_checkpoint, path)
        state = FlowState.from_json(json.loads((folder / FLOW_STATE).read_text()))
        mine = _fingerprint(self._config)
        changed = {k: (state.config.get(k), mine.get(k)) for k in mine if state.config.get(k) != mine.get(k)}
        if changed:
            raise CheckpointError(
                f"run.resume: {folder} was written with other values of {sorted(changed)} "
                f"(checkpoint, now): {changed}; resume with the same ones"
            )
        await self._trainer.load_state(folder)
        saved = {"reference": state.reference_saved, "teacher": state.teacher_saved}
        for name, engine in self._frozen.items():
            if saved[name]:
                await engine.load_state(folder)
        random.setstate(state.python_rng)
        self.restored_from = folder
        log.info("resumed", path=str(folder), version=state.version, in_flight=len(state.in_flight))
        return state
