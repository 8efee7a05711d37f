"""Trainer groups (DDP, FSDP2, megatron-core) at 1 and 2 ranks on CPU: train-step throughput, weight gather into the dual buffer.

For each engine and rank count a group is started (``engines.trainers.group``: every rank a
spawned process with one torch thread, gloo between them) on a synthetic Llama (``--hidden``,
``--layers``; random weights written to a temporary folder), takes one warm-up step, then
``--steps`` timed steps on the same batch of ``--sequences`` token trajectories (prompt
``--prompt`` + response ``--response`` tokens, advantages +-1, plain policy-gradient loss).

- ``tokens_per_s``: tokens of the batch (prompt + response, no padding) / median step wall time,
  as the driver sees it (``TrainerGroup.train_step``: split, accumulate, reduce, step);
- ``scaling_efficiency``: ``tokens_per_s(N) / (N * tokens_per_s(1))`` for the same engine;
- ``gather_gb_per_s``: weight sync's gather, the trainer side of ``engines.shared.weight_sync``: a
  ``ParamSyncer`` over ``TrainerSyncSource(group)`` loads an in-process rollout module; its
  ``gather_s`` covers the ranks' gather (FSDP2 unshards every weight, megatron all-gathers its
  tensor-parallel shards), rank 0's copy into its shared-memory staging and the copy into the
  dual buffer; bytes / ``gather_s``, median of ``--syncs`` after a warm-up sync.

A ``torch`` row (``TorchTrainEngine``, one process, no group) is the baseline both are read
against. ``megatron`` at 2 ranks is data parallel 2; ``megatron-tp2`` is tensor parallel 2.

What 2 cores can show: one thread per rank, so 2 ranks use both cores and 1 rank one. On an
otherwise idle 2-core machine ideal scaling is 2x; what is measured is the group's overhead
(pickling trajectories to the ranks, gloo all-gathers / reduce-scatters / all-reduces between
processes that share the cores, filler passes) against that ideal. On a machine shared with
other work the numbers swing: the load average before and after is recorded with the rows.

Writes ``benchmarks/results/train_scaling.json``.

    python benchmarks/train_scaling.py [--steps 3] [--syncs 3] [--engines torch ddp fsdp2 megatron megatron-tp2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM, LlamaConfig

from tandem.core.records import FinishReason, Trajectory, token_trajectory
from tandem.engines.shared.weight_sync import TrainerSyncSource
from tandem.engines.trainers.group import RankSpec, TrainerGroup
from tandem.engines.trainers.torch_train import TorchTrainEngine
from tandem.param_sync import InProcessTransport, ModuleTarget, ParamSyncer, Receiver

RESULTS = Path(__file__).resolve().parent / "results" / "train_scaling.json"
# engine name -> (rank engine, tensor-parallel size)
ENGINES = {"ddp": ("ddp", 1), "fsdp2": ("fsdp2", 1), "megatron": ("megatron", 1), "megatron-tp2": ("megatron", 2)}


class PolicyGradient:
    """-advantage * log-prob, token mean over the micro-batch (picklable: it travels to the ranks)."""

    mean_over = "tokens"

    def __call__(self, inputs: Any) -> tuple[torch.Tensor, dict[str, float]]:
        loss = -(inputs.logprobs * inputs.advantages * inputs.mask).sum() / inputs.mask.sum()
        return loss, {}


def synthetic_model(folder: Path, hidden: int, layers: int, vocab: int) -> Path:
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64), max_position_embeddings=1024,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def batch(sequences: int, prompt: int, response: int, vocab: int) -> list[Trajectory]:
    rng = random.Random(0)
    out = []
    for i in range(sequences):
        ids = [rng.randrange(vocab) for _ in range(prompt + response)]
        t = token_trajectory(i, 0, ids[:prompt], ids[prompt:], [-1.0] * response, [0] * response, FinishReason.LENGTH)
        t.advantage = 1.0 if i % 2 == 0 else -1.0
        out.append(t)
    return out


async def gather_gb_per_s(engine: Any, model_path: Path, syncs: int) -> float:
    """Median bytes / gather seconds of ``syncs`` weight syncs (after a warm-up) into a rollout module."""
    rollout = ModuleTarget(AutoModelForCausalLM.from_pretrained(model_path))
    source = TrainerSyncSource(engine)
    syncer = ParamSyncer(source, InProcessTransport([Receiver(rollout)]), produce_bucket_mb=16)
    try:
        rates = []
        for i in range(syncs + 1):
            source.expect(engine.version)
            metrics = await syncer.sync(i + 1)
            if i > 0:
                rates.append(metrics["bytes"] / metrics["gather_s"] / 1e9)
        return statistics.median(rates)
    finally:
        await syncer.aclose()


async def measure(engine: Any, trajectories: list[Trajectory], steps: int) -> float:
    """Median step seconds of ``steps`` steps after a warm-up one."""
    objective = PolicyGradient()
    await engine.train_step(trajectories, objective)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        await engine.train_step(trajectories, objective)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def row(name: str, ranks: int, model_path: Path, args: argparse.Namespace) -> dict[str, Any]:
    trajectories = batch(args.sequences, args.prompt, args.response, args.vocab)
    tokens = sum(len(t.payload.prompt_ids) + t.num_actions for t in trajectories)
    started = time.perf_counter()
    if name == "torch":
        engine: Any = TorchTrainEngine(str(model_path), lr=1e-4, max_tokens_per_micro_batch=args.micro_batch_tokens)
    else:
        rank_engine, tensor_parallel = ENGINES[name]
        spec = RankSpec(
            engine=rank_engine, model_path=str(model_path), device="cpu", dtype="float32", temperature=1.0, lr=1e-4,
            weight_decay=0.0, warmup_steps=0, max_grad_norm=1.0, max_tokens_per_micro_batch=args.micro_batch_tokens,
            num_threads=1, tensor_parallel_size=tensor_parallel,
        )  # fmt: skip
        engine = TrainerGroup.local(spec, ranks)
    start_s = time.perf_counter() - started
    try:
        step_s = await measure(engine, trajectories, args.steps)
        gather = await gather_gb_per_s(engine, model_path, args.syncs)
    finally:
        engine.close()
    return {"engine": name, "ranks": ranks, "tokens_per_s": tokens / step_s, "step_s": step_s, "start_s": start_s,
            "gather_gb_per_s": gather}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", nargs="+", default=["torch", "ddp", "fsdp2", "megatron", "megatron-tp2"])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per row (after one warm-up step)")
    parser.add_argument("--syncs", type=int, default=3, help="timed weight syncs per row (after one warm-up sync)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--micro-batch-tokens", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        model_path = synthetic_model(Path(folder), args.hidden, args.layers, args.vocab)
        params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_path).parameters())
        for name in args.engines:
            if name == "megatron-tp2":
                runs = [2]  # tensor parallel 2 needs two ranks
            else:
                runs = [1] if name == "torch" else [1, 2]
            for ranks in runs:
                rows.append(asyncio.run(row(name, ranks, model_path, args)))
                print(f"{name} x{ranks}: {rows[-1]['tokens_per_s']:.0f} tokens/s", flush=True)
    single = {r["engine"]: r["tokens_per_s"] for r in rows if r["ranks"] == 1}
    if "megatron" in single:
        single["megatron-tp2"] = single["megatron"]  # tensor parallel 2 against megatron on one rank
    for r in rows:
        r["scaling_efficiency"] = r["tokens_per_s"] / (r["ranks"] * single[r["engine"]]) if r["engine"] in single else None

    table = Table(title=f"Train scaling on CPU: Llama {params / 1e6:.1f}M params, {args.sequences} x "
                        f"({args.prompt}+{args.response}) tokens per step, one thread per rank")  # fmt: skip
    for column in ("engine", "ranks", "tokens/s", "scaling efficiency", "gather GB/s", "step s", "start s"):
        table.add_column(column, justify="right")
    for r in rows:
        efficiency = "—" if r["scaling_efficiency"] is None else f"{r['scaling_efficiency']:.2f}"
        table.add_row(r["engine"], str(r["ranks"]), f"{r['tokens_per_s']:.0f}", efficiency, f"{r['gather_gb_per_s']:.3f}",
                      f"{r['step_s']:.2f}", f"{r['start_s']:.1f}")  # fmt: skip
    Console().print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "rows": [{k: r[k] for k in ("engine", "ranks", "tokens_per_s", "scaling_efficiency", "gather_gb_per_s",
                                    "step_s", "start_s")} for r in rows],
        "settings": {**vars(args), "parameters": params},
        "machine": {"cores": os.cpu_count(), "load_average_before": load_before, "load_average_after": os.getloadavg()},
    }, indent=1))  # fmt: skip
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
