"""Param sync between Ray actors: the object-store transport and a gloo group, against the
in-process transport, on the same synthetic model.

A trainer actor syncs a synthetic model (bf16 matrices, fp32 norms; ``--sizes`` MiB) into one
rollout actor's module in ``swap`` mode, through (a) the object store (each bucket ``ray.put``
once as a numpy view, read zero-copy by the actor, copied into its staging buffer) and (b) a
torch.distributed gloo group of the two actors (the trainer broadcasts each bucket). The
``inprocess`` row syncs the same model inside one actor (no transfer: the rollout side loads
from the trainer's buffer). Each row is the median of ``--reps`` syncs after one warm-up:
end-to-end GB/s (bytes / wall time of ``sync()``) and the phases, next to ``np.copyto`` of the
same size measured in the same run. Writes ``benchmarks/results/param_sync_ray.json``.

    python benchmarks/param_sync_ray.py [--sizes 100 512] [--reps 5] [--bucket-mb 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import threading
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from rich.console import Console
from rich.table import Table

from tandem.param_sync import (
    DistTransport,
    InProcessTransport,
    ModuleSource,
    ModuleTarget,
    ParamSyncer,
    Receiver,
    serve_dist,
)
from tandem.param_sync.bucket import MiB
from tandem.param_sync.synthetic import SyntheticModel, memcpy_gb_per_s
from tandem.param_sync.transports.object_store import (
    ObjectStoreEndpoint,
    ObjectStoreTransport,
    RemoteReceiver,
)

RESULTS = Path(__file__).resolve().parent / "results" / "param_sync_ray.json"
PHASES = ("gather_s", "send_s", "load_s", "total_s")


@ray.remote(num_cpus=0)
class Rollout:
    """A rollout actor's sync endpoints over a SyntheticModel, as ``RolloutActor`` has over its engine."""

    def __init__(self, size_mib: int, bucket_mb: float) -> None:
        torch.set_num_threads(1)
        self.receiver = Receiver(ModuleTarget(SyntheticModel(size_mib), load_mode="swap"), consume_bucket_mb=bucket_mb)
        self.endpoint = ObjectStoreEndpoint(self.receiver)

    async def begin(self, transfer: int, manifest: Any) -> None:
        await self.endpoint.begin(transfer, manifest)

    async def bucket(self, transfer: int, index: int, header: Any, chunk: np.ndarray) -> None:
        await self.endpoint.bucket(transfer, index, header, chunk)

    async def end(self, transfer: int, index: int) -> Any:
        return await self.endpoint.end(transfer, index)

    async def abort(self, transfer: int, index: int, reason: str) -> Any:
        return await self.endpoint.abort(transfer, index, reason)

    def join(self, address: str) -> None:
        torch.distributed.init_process_group("gloo", init_method=address, rank=1, world_size=2)
        threading.Thread(target=serve_dist, args=(self.receiver,), daemon=True).start()


@ray.remote(num_cpus=0)
class Trainer:
    def __init__(self, size_mib: int) -> None:
        torch.set_num_threads(1)
        self.source = ModuleSource(SyntheticModel(size_mib))

    def address(self) -> str:
        host = ray.util.get_node_ip_address()
        with socket.socket() as probe:
            probe.bind((host, 0))
            return f"tcp://{host}:{probe.getsockname()[1]}"

    def time_syncs(self, transport: str, reps: int, bucket_mb: float, peer: Any = None, arg: Any = None) -> list[dict]:
        if transport == "object_store":
            chosen: Any = ObjectStoreTransport([RemoteReceiver("rollout", peer)])
        elif transport == "dist":
            torch.distributed.init_process_group("gloo", init_method=arg, rank=0, world_size=2)
            chosen = DistTransport()
        else:
            target = ModuleTarget(SyntheticModel(arg), load_mode="swap")
            chosen = InProcessTransport([Receiver(target, consume_bucket_mb=bucket_mb)])
        syncer = ParamSyncer(self.source, chosen, produce_bucket_mb=bucket_mb)

        async def run() -> list[dict]:
            out = []
            for version in range(reps + 1):  # the first plans the layout and allocates the buffer
                out.append(await syncer.sync(version))
            await syncer.aclose()
            return out[1:]

        return asyncio.run(run())


def bench(transport: str, size_mib: int, reps: int, bucket_mb: float) -> dict[str, Any]:
    trainer = Trainer.remote(size_mib)
    rollout = Rollout.remote(size_mib, bucket_mb) if transport != "inprocess" else None
    try:
        if transport == "dist":
            address = ray.get(trainer.address.remote())
            joined = rollout.join.remote(address)  # blocks in the actor until rank 0 joins
            runs = ray.get(trainer.time_syncs.remote(transport, reps, bucket_mb, None, address))
            ray.get(joined)
        else:
            runs = ray.get(trainer.time_syncs.remote(transport, reps, bucket_mb, rollout, size_mib))
    finally:
        for actor in (trainer, rollout):
            if actor is not None:
                ray.kill(actor)
    row: dict[str, Any] = {"transport": transport, "size_mb": size_mib, "bytes": runs[0]["bytes"]}
    row.update({p: statistics.median(r[p] for r in runs) for p in PHASES})
    row["gb_per_s"] = row["bytes"] / row["total_s"] / 1e9
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 512])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=16.0)
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        for size in args.sizes:
            memcpy = memcpy_gb_per_s(size * MiB)
            for transport in ("inprocess", "object_store", "dist"):
                row = bench(transport, size, args.reps, args.bucket_mb)
                row["memcpy_gb_per_s"] = memcpy
                rows.append(row)
    finally:
        ray.shutdown()
    table = Table(title=f"Param sync between Ray actors, swap mode, {cores} cores, median of {args.reps}")
    for col in ("transport", "MiB", "GB/s", "memcpy GB/s", *PHASES):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["transport"], str(r["size_mb"]), f"{r['gb_per_s']:.2f}", f"{r['memcpy_gb_per_s']:.2f}",
                      *(f"{r[p]:.3f}" for p in PHASES))
    Console(width=140).print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "rows": rows,
        "settings": vars(args),
        "machine": {"cores": cores, "python": platform.python_version(), "machine": platform.machine()},
    }
    RESULTS.write_text(json.dumps(doc, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
