"""Trainer groups in the flow: the default job on FSDP2 and megatron ranks, a rank killed mid-run, a resume with fewer ranks, Ray.

Short runs of the shipped arithmetic model (tied Llama) on a reduced budget: what is checked
is that the group is the flow's one train engine (versions, checkpoints, weight syncs, the HF
export), not that reward rises (``test_torch_flow.py`` shows that for the same engines' math).
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from tandem.core.config import TandemConfig, apply_overrides, validate_config
from tandem.core.protocols import LossObjective
from tandem.core.records import Trajectory
from tandem.engines.trainers.group import TrainerGroup
from tandem.param_sync import unique_weights
from tandem.pipeline import AsyncTrainingFlow
from tandem.pipeline.builders import build_components
from tandem.tasks.arithmetic import MODEL_DIR

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(), reason="the shipped model is missing"),
]


def short_job(tmp_path: Path, *overrides: str) -> TandemConfig:
    """The default job, a few small steps, one thread per engine and rank."""
    data = yaml.safe_load(Path("configs/default.yaml").read_text())
    data.pop("validation", None)
    settings = [
        "train.prompts_per_step=4", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=24",
        "engines.generation_threads=1", "engines.train_threads=1", "observability.metrics_port=null",
        "observability.trace=false", f"run.output_dir={tmp_path}", *overrides,
    ]  # fmt: skip
    return validate_config(apply_overrides(data, settings), "configs/default.yaml")


def run(config: TandemConfig, components: Any = None) -> Any:
    return asyncio.run(AsyncTrainingFlow(config, components).run())


def rank_processes(besides: Sequence[multiprocessing.process.BaseProcess] = ()) -> list[Any]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("tandem-train-rank") and p not in besides]


@contextmanager
def reports_a_hang(group: TrainerGroup, after_s: float) -> Iterator[None]:
    """If the block still runs after ``after_s``, write where everything is to stderr (pytest shows
    it with the failure): the flow's pending tasks, this process's threads, every rank's stacks.
    A run of the killed-rank test once hung in CI, and its thread dump was cut before the group's
    worker thread: this says, in a few lines each, what waits on what."""

    def innermost(frames: Sequence[Any]) -> str:
        return " < ".join(f"{f.f_code.co_name}:{f.f_lineno}" for f in frames)

    def awaiting(task: asyncio.Task[Any]) -> list[Any]:
        """The task's chain of awaited coroutines' frames, innermost first."""
        chain, coro = [], task.get_coro()
        while coro is not None and getattr(coro, "cr_frame", None) is not None:
            chain.append(coro.cr_frame)
            coro = coro.cr_await
        return chain[::-1][:5]

    def report() -> None:
        lines = [f"=== still running after {after_s:g} s; pending tasks (innermost frame first):"]
        tasks = [o for o in gc.get_objects() if isinstance(o, asyncio.Task) and not o.done()]
        lines += [f"{task.get_name()}: {innermost(awaiting(task))}" for task in tasks]
        lines.append("=== threads:")
        names = {thread.ident: thread.name for thread in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            stack: list[Any] = []
            while frame is not None and len(stack) < 4:
                stack.append(frame)
                frame = frame.f_back
            lines.append(f"{names.get(ident, ident)}: {innermost(stack)}")
        for rank, stacks in group.rank_stacks().items():
            lines.append(f"=== rank {rank}:\n{stacks}")
        print("\n".join(lines), file=sys.stderr, flush=True)

    timer = threading.Timer(after_s, report)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def test_a_killed_fsdp2_rank_stops_the_run_naming_it_and_one_rank_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    others = rank_processes()
    cfg = short_job(tmp_path, "run.name=fsdp2", "run.max_steps=4", "run.save_steps=1", "engines.data_parallel=fsdp2",
                    "engines.train_world_size=2")  # fmt: skip
    components = build_components(cfg)
    assert isinstance(components.trainer, TrainerGroup) and components.trainer.size == 2
    inner = components.trainer.train_step

    async def train_step(
        batch: Sequence[Trajectory], objective: LossObjective, mini_batches: Sequence[Sequence[int]] | None = None
    ) -> dict[str, float]:
        if components.trainer.version == 2:  # steps 0 and 1 done and checkpointed
            rank1 = next(p for p in rank_processes(besides=others) if p.name == "tandem-train-rank1")
            rank1.kill()
            rank1.join()
        return await inner(batch, objective, mini_batches)

    components.trainer.train_step = train_step
    try:
        with pytest.raises(Exception, match="train rank 1 died"), reports_a_hang(components.trainer, after_s=300):
            run(cfg, components)
    finally:
        components.close()
    assert rank_processes(besides=others) == []  # closing the group stopped the surviving rank
    checkpoints = sorted(p.name for p in (tmp_path / "fsdp2" / "checkpoints").iterdir())
    assert checkpoints[-1] == "step_00000002"

    # Five steps: at k = 1 step 4 may start only on weights of version >= 3, so the resumed rank's
    # weights must reach the rollout (with four, steps 2 and 3 can both run on the checkpoint's v2
    # and the run may end before any sync lands).
    resumed = short_job(tmp_path, "run.name=fsdp2", "run.max_steps=5", "run.resume=true", "engines.data_parallel=fsdp2")
    result = run(resumed)
    assert result.resumed_from_version == 2 and result.final_version == 5
    assert [s.step for s in result.steps][-3:] == [2, 3, 4]
    assert result.syncs and max(s.version for s in result.syncs) >= 3  # the resumed rank's weights reached the rollout


def test_megatron_ranks_train_the_default_job_export_it_and_resume_on_one_rank(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is an optional extra: pip install tandem[megatron]")
    megatron = ["run.name=megatron", "engines.train=megatron"]
    cfg = short_job(tmp_path, *megatron, "run.max_steps=2", "engines.train_world_size=2", "engines.tensor_parallel_size=2")
    result = run(cfg)
    assert result.final_version == 2 and [s.version for s in result.syncs] == sorted(s.version for s in result.syncs)
    export = tmp_path / "megatron" / "checkpoint"
    exported = unique_weights(AutoModelForCausalLM.from_pretrained(export))
    shipped = unique_weights(AutoModelForCausalLM.from_pretrained(MODEL_DIR))
    assert exported.keys() == shipped.keys()  # tied: the head travels as the embedding
    assert any(not torch.equal(exported[name], shipped[name]) for name in shipped)  # trained

    resumed = run(short_job(tmp_path, *megatron, "run.max_steps=3", "run.resume=true"))
    assert resumed.resumed_from_version == 2 and resumed.final_version == 3


@pytest.mark.parametrize("layout", ["fsdp2", "ddp"])
def test_on_ray_a_group_of_two_train_actors_runs_the_default_job(ray_cluster: Any, tmp_path: Path, layout: str) -> None:
    cfg = short_job(
        tmp_path, "run.name=ray_group", "run.max_steps=3", "cluster.backend=ray", f"engines.data_parallel={layout}",
        "engines.train_world_size=2", "cluster.device_mapping={train: [0, 1], generate: [1]}",
    )  # fmt: skip
    assert cfg.engines.trainer_group == layout
    components = build_components(cfg)
    try:
        group = components.trainer
        assert isinstance(group, TrainerGroup) and group.size == 2
        result = run(cfg, components)
    finally:
        components.close()
    assert result.final_version == 3
    assert result.ledger["balanced"] and result.ledger["trained"] == 3 * cfg.train.prompts_per_step
    assert result.syncs and max(s.version for s in result.syncs) >= 2  # rank 0 shipped the group's weights
    assert (tmp_path / "ray_group" / "checkpoint" / "config.json").is_file()  # exported by rank 0
