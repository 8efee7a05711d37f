"""Param sync: end-to-end bandwidth per transport, and the generation stall per load mode.

Transports (in-process, shared memory to a spawned rollout process, shared memory into a rollout
server process over HTTP (``server``: the path of ``engines.rollout: server``, the trainer's
``HttpShmTransport`` and the server's shared-memory endpoint), gloo broadcast between two
spawned ranks) each sync a synthetic model of 100 MiB and 1 GiB (bf16 matrices, fp32 norms,
an int64 buffer) into a rollout module in ``swap`` mode. Each row reports the median of
``--reps`` syncs after one warm-up (which plans the layout and allocates the buffer):
end-to-end GB/s (bytes / wall time of ``sync()``) and the seconds of each phase, next to the
memcpy bandwidth (``np.copyto`` of the same size, best of 3) measured right before that row:
the physical limit of one copy at that moment. The ``rollout`` column says what the rollout side does with the
bytes: ``maps`` (serves straight from the buffer half: the bytes are copied once, by the
gather, and checksummed twice), ``copies`` (checksums each piece, then copies it into its
idle weight set: the path of targets that cannot map, shown for comparison), ``cuda`` (a
rollout module on the GPU, loaded from pinned halves; compared with the pinned host-to-device
bandwidth measured in the same run). Sender and receiver run pipelined in two threads or
processes.

Load modes: a fake generator runs decode steps of ``--decode-step-ms`` (a sleep: its compute
is elsewhere, e.g. a GPU) through the rollout module's step gate while the weights are
updated; ``stall_decode_steps`` is the longest time the generator waited to start a step
during one update, in decode steps. ``naive`` stops generation, copies the full state dict
and loads it; ``pause`` stops it only for the copy into the live weights; ``swap`` only for
swapping two weight sets.

``--repeat N`` measures every transport row N times (each the median of ``--reps`` syncs) and
reports the spread of the fraction of memcpy (min, median, max) beside each row.

Also measures the bucket checksum (a 64-bit word sum) against zlib's crc32 and adler32.
Writes ``benchmarks/results/param_sync.json``.

    python benchmarks/param_sync.py [--quick] [--reps 5] [--repeat 1] [--bucket-mb 16] [--decode-step-ms 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import threading
import time
import zlib
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from tandem.param_sync import (
    DistTransport,
    InProcessTransport,
    ModuleSource,
    ModuleTarget,
    ParamSyncer,
    Receiver,
    ShmTransport,
    StepGate,
    checksum,
    serve_dist,
    serve_shm,
)
from tandem.param_sync.bucket import FUSE_NBYTES, MiB
from tandem.param_sync.synthetic import SyntheticModel, memcpy_gb_per_s

RESULTS = Path(__file__).resolve().parent / "results" / "param_sync.json"
CTX = mp.get_context("spawn")
SHM_TARGET = 0.5  # shared memory: at least this fraction of memcpy bandwidth
SWAP_TARGET = 1.0  # swap: at most this many decode steps of stall


class CopyingTarget(ModuleTarget):
    """A host-memory target that declines to map: the copying path, for comparison."""

    @property
    def can_map(self) -> bool:
        return False


def rollout_target(rollout: str, size_mib: int) -> ModuleTarget:
    """The rollout module's sync target for a row's ``rollout`` column."""
    if rollout == "cuda":
        return ModuleTarget(SyntheticModel(size_mib).cuda(), load_mode="swap")
    return (ModuleTarget if rollout == "maps" else CopyingTarget)(SyntheticModel(size_mib), load_mode="swap")


def h2d_gb_per_s(nbytes: int) -> float:
    """Pinned host memory to the GPU, one copy of ``nbytes``, best of 3."""
    src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def checksum_costs(nbytes: int = 64 * MiB) -> dict[str, float]:
    data = np.frombuffer(np.random.default_rng(0).bytes(nbytes), np.uint8)
    fns: dict[str, Callable[[], object]] = {
        "sum64_gb_per_s": lambda: checksum(data),
        "crc32_gb_per_s": lambda: zlib.crc32(data),
        "adler32_gb_per_s": lambda: zlib.adler32(data),
    }
    out = {}
    for key, fn in fns.items():
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        out[key] = nbytes / best / 1e9
    return out


async def timed_syncs(syncer: ParamSyncer, reps: int) -> dict[str, float]:
    """One warm-up sync, then the median (by wall time) of ``reps`` more."""
    await syncer.sync(1)
    runs = [await syncer.sync(version) for version in range(2, reps + 2)]
    return sorted(runs, key=lambda m: m["total_s"])[len(runs) // 2]


# --- transports --------------------------------------------------------------------------


def bench_inprocess(size_mib: int, reps: int, bucket_mb: float, rollout: str) -> dict[str, float]:
    async def run() -> dict[str, float]:
        target = rollout_target(rollout, size_mib)
        transport = InProcessTransport([Receiver(target, consume_bucket_mb=bucket_mb)])
        syncer = ParamSyncer(ModuleSource(SyntheticModel(size_mib)), transport, produce_bucket_mb=bucket_mb)
        try:
            return await timed_syncs(syncer, reps)
        finally:
            await syncer.aclose()

    return asyncio.run(run())


def shm_rollout(conn: Connection, size_mib: int, bucket_mb: float, rollout: str) -> None:
    torch.set_num_threads(1)
    serve_shm(conn, Receiver(rollout_target(rollout, size_mib), consume_bucket_mb=bucket_mb))


def bench_shm(size_mib: int, reps: int, bucket_mb: float, rollout: str) -> dict[str, float]:
    ours, theirs = CTX.Pipe()
    process = CTX.Process(target=shm_rollout, args=(theirs, size_mib, bucket_mb, rollout), daemon=True)
    process.start()
    theirs.close()

    async def run() -> dict[str, float]:
        transport = ShmTransport([ours], timeout_s=120)
        syncer = ParamSyncer(ModuleSource(SyntheticModel(size_mib)), transport, produce_bucket_mb=bucket_mb)
        try:
            return await timed_syncs(syncer, reps)
        finally:
            await syncer.aclose()

    try:
        return asyncio.run(run())
    finally:
        process.join(60)


def server_rollout(ports: mp.SimpleQueue, size_mib: int, bucket_mb: float, rollout: str) -> None:
    """A rollout server process reduced to its weight endpoint (the engine would only add noise)."""
    torch.set_num_threads(1)
    from aiohttp import web

    from tandem.engines.server.app import report_body, shm_transfer
    from tandem.engines.server.receive import WeightUpdates

    target = rollout_target(rollout, size_mib)
    updates = WeightUpdates(Receiver(target, consume_bucket_mb=bucket_mb, engine="server"), target.module, timeout_s=120)

    async def transfer(request: web.Request) -> web.Response:
        return web.json_response(report_body(await shm_transfer(request.content, updates, "server")))

    async def serve() -> None:
        app = web.Application()
        app.router.add_post("/tandem/update_weights_from_shm", transfer)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        ports.put(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        await asyncio.Event().wait()  # until terminated

    asyncio.run(serve())


def bench_server(size_mib: int, reps: int, bucket_mb: float, rollout: str) -> dict[str, float]:
    from tandem.engines.server.weights import HttpShmTransport

    ports: mp.SimpleQueue = CTX.SimpleQueue()
    process = CTX.Process(target=server_rollout, args=(ports, size_mib, bucket_mb, rollout), daemon=True)
    process.start()
    url = f"http://127.0.0.1:{ports.get()}"

    async def run() -> dict[str, float]:
        transport = HttpShmTransport(lambda: [url], timeout_s=120)
        syncer = ParamSyncer(ModuleSource(SyntheticModel(size_mib)), transport, produce_bucket_mb=bucket_mb)
        try:
            return await timed_syncs(syncer, reps)
        finally:
            await syncer.aclose()

    try:
        return asyncio.run(run())
    finally:
        process.terminate()
        process.join(60)


def dist_rank(rank: int, init_file: str, size_mib: int, reps: int, bucket_mb: float, results: mp.SimpleQueue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        if rank == 1:
            serve_dist(Receiver(ModuleTarget(SyntheticModel(size_mib), load_mode="swap"), consume_bucket_mb=bucket_mb))
            return

        async def run() -> dict[str, float]:
            syncer = ParamSyncer(ModuleSource(SyntheticModel(size_mib)), DistTransport(), produce_bucket_mb=bucket_mb)
            try:
                return await timed_syncs(syncer, reps)
            finally:
                await syncer.aclose()

        results.put(asyncio.run(run()))
    finally:
        dist.destroy_process_group()


def bench_dist(size_mib: int, reps: int, bucket_mb: float, rollout: str) -> dict[str, float]:
    init_file = f"/tmp/tandem-bench-dist-{os.getpid()}-{size_mib}"
    results: mp.SimpleQueue = CTX.SimpleQueue()
    ranks = [CTX.Process(target=dist_rank, args=(r, init_file, size_mib, reps, bucket_mb, results)) for r in (0, 1)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(600)
    if os.path.exists(init_file):
        os.unlink(init_file)
    if any(p.exitcode != 0 for p in ranks):
        raise RuntimeError(f"dist ranks exited with {[p.exitcode for p in ranks]}")
    return results.get()


TRANSPORTS: dict[str, Callable[[int, int, float, str], dict[str, float]]] = {
    "inprocess": bench_inprocess,
    "shm": bench_shm,
    "server": bench_server,
    "dist": bench_dist,
}
# (transport, rollout) rows; a broadcast lands in a staging buffer, which is never mapped.
ROWS_RUN = [("inprocess", "maps"), ("shm", "maps"), ("shm", "copies"), ("server", "maps"), ("dist", "copies")]
SHARED_MEMORY = ("shm", "server")


# --- load modes --------------------------------------------------------------------------


class FakeGenerator:
    """Decode steps of ``step_s`` each inside ``gate.step()``; records when each step asked to
    start and how long it waited."""

    def __init__(self, gate: StepGate, step_s: float) -> None:
        self.gate = gate
        self.step_s = step_s
        self.waits: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            asked = time.perf_counter()
            with self.gate.step():
                self.waits.append((asked, time.perf_counter() - asked))
                time.sleep(self.step_s)

    def __enter__(self) -> FakeGenerator:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(10)


async def stall_per_update(
    gate: StepGate, update: Callable[[int], Awaitable[object]], updates: int, step_s: float
) -> tuple[float, float, float]:
    """Worst generator wait during one update (s), and the mean update wall time (s)."""
    await update(1)  # warm-up: layout, buffers, first-touch pages
    worst, walls = 0.0, []
    with FakeGenerator(gate, step_s) as generator:
        await asyncio.sleep(2.5 * step_s)  # updates land in the middle of decode steps
        for version in range(2, updates + 2):
            t0 = time.perf_counter()
            await update(version)
            t1 = time.perf_counter()
            walls.append(t1 - t0)
            await asyncio.sleep(2.5 * step_s)  # the step waiting at the end of the update has started
            worst = max([worst, *(w for asked, w in generator.waits if t0 <= asked <= t1)])
    return worst, statistics.mean(walls), worst / step_s


def bench_load_mode(mode: str, size_mib: int, updates: int, step_s: float, bucket_mb: float) -> dict[str, float]:
    async def run() -> dict[str, float]:
        trainer, rollout = SyntheticModel(size_mib), SyntheticModel(size_mib)
        if mode == "naive":
            gate = StepGate()

            def stop_copy_resume() -> None:
                gate.hold()
                try:
                    rollout.load_state_dict({k: v.detach().clone() for k, v in trainer.state_dict().items()})
                finally:
                    gate.release()

            async def naive(version: int) -> None:
                await asyncio.to_thread(stop_copy_resume)

            stall_s, update_s, steps = await stall_per_update(gate, naive, updates, step_s)
        else:
            target = ModuleTarget(rollout, load_mode="pause" if mode == "pause" else "swap")
            transport = InProcessTransport([Receiver(target, consume_bucket_mb=bucket_mb)])
            syncer = ParamSyncer(ModuleSource(trainer), transport, produce_bucket_mb=bucket_mb)
            try:
                stall_s, update_s, steps = await stall_per_update(target.gate, syncer.sync, updates, step_s)
            finally:
                await syncer.aclose()
        return {"stall_s": stall_s, "update_s": update_s, "stall_decode_steps": steps}

    return asyncio.run(run())


# --- main --------------------------------------------------------------------------------


def measure_beside_memcpy(
    bench: Callable[[int, int, float, str], dict[str, float]], size_mib: int, reps: int, bucket_mb: float, rollout: str
) -> dict[str, float]:
    """One measurement of a transport row with its own memcpy reference: the faster of one
    memcpy right before and one right after it. On this shared machine a single reference
    was once disturbed to a quarter of its speed (a row at 151 % of "memcpy"); the physical
    limit at that moment is the better of the two, and a ratio of two moments measures the
    neighbours. Also records a memcpy done in the gather's pieces (:data:`FUSE_NBYTES`), the
    copy Python code can do: glibc streams past the cache (non-temporal stores) only for one
    copy of at least ``x86_non_temporal_threshold`` (192 MiB here), which roughly doubles
    the whole-size memcpy at 1 GiB and not at 100 MiB."""
    before = memcpy_gb_per_s(size_mib * MiB)
    result = bench(size_mib, reps, bucket_mb, rollout)
    memcpy = max(before, memcpy_gb_per_s(size_mib * MiB))
    return {
        **result,
        "memcpy_gb_per_s": memcpy,
        "fraction_of_memcpy": result["gb_per_s"] / memcpy,
        "memcpy_in_pieces_gb_per_s": memcpy_gb_per_s(size_mib * MiB, piece_nbytes=FUSE_NBYTES),
    }


def add_best_memcpy_fractions(rows: list[dict[str, object]]) -> None:
    """Each run of each row also against the best memcpy of its size in this whole invocation
    (``fraction_of_best_memcpy_runs``): a disturbed reference can only raise a ratio, the best
    one only lower it, so the target is judged on this one. Seen here: both references around
    one run read 3.6 GB/s, a fifth of the usual, and put that run at 173 % of "memcpy"."""
    best: dict[object, float] = {}
    for r in rows:
        best[r["size_mb"]] = max(best.get(r["size_mb"], 0.0), *r["memcpy_gb_per_s_runs"])  # type: ignore[arg-type]
    for r in rows:
        reference = best[r["size_mb"]]
        r["best_memcpy_gb_per_s"] = reference
        r["fraction_of_best_memcpy_runs"] = [g / reference for g in r["gb_per_s_runs"]]  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 and 64 MiB instead of 100 MiB and 1 GiB")
    parser.add_argument("--reps", type=int, default=5, help="timed syncs per transport and size")
    parser.add_argument("--repeat", type=int, default=1, help="measurements per transport row (the spread is reported)")
    parser.add_argument("--updates", type=int, default=3, help="updates per load mode")
    parser.add_argument("--decode-step-ms", type=float, default=20.0)
    parser.add_argument("--bucket-mb", type=float, default=16.0, help="produce and consume bucket size (MiB)")
    parser.add_argument("--rows", nargs="+", choices=[f"{n}:{r}" for n, r in ROWS_RUN],
                        help="measure only these transport rows (e.g. shm:maps); default: all")
    parser.add_argument("--no-load-modes", action="store_true", help="skip the generation-stall rows")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)  # two cores: one per side of each sync
    sizes = [16, 64] if args.quick else [100, 1024]
    step_s = args.decode_step_ms / 1e3
    console = Console(width=160)

    costs = checksum_costs()
    rows: list[dict[str, object]] = []
    runs = ROWS_RUN + ([("inprocess", "cuda")] if torch.cuda.is_available() else [])
    if args.rows:
        runs = [(n, r) for n, r in runs if f"{n}:{r}" in args.rows]
    for size in sizes:
        for name, rollout in runs:
            console.log(f"{name} ({rollout}): {size} MiB")
            measured = sorted((measure_beside_memcpy(TRANSPORTS[name], size, args.reps, args.bucket_mb, rollout)
                               for _ in range(args.repeat)), key=lambda r: r["fraction_of_memcpy"])
            m = measured[len(measured) // 2]  # the median run
            row: dict[str, object] = {
                "transport": name,
                "rollout": rollout,
                "size_mb": size,
                "bytes": int(m["bytes"]),
                "gb_per_s": m["gb_per_s"],
                "memcpy_gb_per_s": m["memcpy_gb_per_s"],
                "fraction_of_memcpy": m["fraction_of_memcpy"],
                "gb_per_s_runs": [r["gb_per_s"] for r in measured],
                "fraction_of_memcpy_runs": [r["fraction_of_memcpy"] for r in measured],
                "memcpy_gb_per_s_runs": [r["memcpy_gb_per_s"] for r in measured],
                "memcpy_in_pieces_gb_per_s": m["memcpy_in_pieces_gb_per_s"],
                **{k: m[k] for k in ("gather_s", "checksum_s", "send_s", "verify_s", "load_s", "stall_s", "total_s")},
            }
            if rollout == "cuda":
                h2d = h2d_gb_per_s(size * MiB)
                row.update(h2d_gb_per_s=h2d, fraction_of_h2d=m["gb_per_s"] / h2d)
            rows.append(row)
    for mode in () if args.no_load_modes else ("naive", "pause", "swap"):
        console.log(f"load mode {mode}: {sizes[-1]} MiB")
        rows.append(
            {
                "load_mode": mode,
                "size_mb": sizes[-1],
                "decode_step_s": step_s,
                **bench_load_mode(mode, sizes[-1], args.updates, step_s, args.bucket_mb),
            }
        )

    transport_rows = [r for r in rows if "transport" in r]
    add_best_memcpy_fractions(transport_rows)
    mode_rows = [r for r in rows if "load_mode" in r]
    shm_ok = all(
        min(r["fraction_of_best_memcpy_runs"]) >= SHM_TARGET
        for r in transport_rows if r["transport"] in SHARED_MEMORY and r["rollout"] == "maps"
    )
    swap_ok = all(r["stall_decode_steps"] <= SWAP_TARGET for r in mode_rows if r["load_mode"] == "swap")

    table = Table(title="param sync: end-to-end bandwidth (swap mode, median of reps)")
    for col in ("transport", "rollout", "MiB", "GB/s", "memcpy GB/s", "in pieces", "% memcpy", "spread %", "vs best memcpy %",
                "gather s", "checksum s", "send s", "verify s", "load s", "total s"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in transport_rows:
        table.add_row(
            str(r["transport"]), str(r["rollout"]), str(r["size_mb"]), f"{r['gb_per_s']:.2f}", f"{r['memcpy_gb_per_s']:.2f}",
            f"{r['memcpy_in_pieces_gb_per_s']:.2f}",
            f"{100 * r['fraction_of_memcpy']:.0f}%",
            "-".join(f"{100 * f:.0f}" for f in (min(r["fraction_of_memcpy_runs"]), max(r["fraction_of_memcpy_runs"]))),
            "-".join(f"{100 * f:.0f}" for f in (min(r["fraction_of_best_memcpy_runs"]), max(r["fraction_of_best_memcpy_runs"]))),
            *(f"{r[k]:.3f}" for k in ("gather_s", "checksum_s", "send_s", "verify_s", "load_s", "total_s")),
        )  # fmt: skip
    console.print(table)
    for r in transport_rows:
        if r["rollout"] == "cuda":
            console.print(
                f"cuda rollout, {r['size_mb']} MiB: {r['gb_per_s']:.2f} GB/s = {r['fraction_of_h2d']:.0%} of pinned "
                f"host-to-device ({r['h2d_gb_per_s']:.2f} GB/s)"
            )
    modes = Table(title=f"generation stall per update ({sizes[-1]} MiB, decode step {args.decode_step_ms:g} ms)")
    for col in ("load mode", "stall s", "stall decode steps", "update s"):
        modes.add_column(col, justify="right")
    for r in mode_rows:
        modes.add_row(str(r["load_mode"]), f"{r['stall_s']:.4f}", f"{r['stall_decode_steps']:.3f}", f"{r['update_s']:.3f}")
    console.print(modes)
    console.print(
        "checksum (64 MiB): "
        + ", ".join(f"{k.removesuffix('_gb_per_s')} {v:.1f} GB/s" for k, v in costs.items())
    )
    console.print(f"targets: shm >= {SHM_TARGET:.0%} of memcpy: {shm_ok}; swap stall <= {SWAP_TARGET:g} decode step: {swap_ok}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "benchmark": "param_sync",
                "quick": args.quick,
                "config": {
                    "reps": args.reps,
                    "repeat": args.repeat,
                    "updates": args.updates,
                    "bucket_mb": args.bucket_mb,
                    "transport_load_mode": "swap",
                    "torch_threads_per_process": 1,
                    "cpus": len(os.sched_getaffinity(0)),  # the cores this run may use
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                    # Other work on the machine shares its cores: read the numbers with this.
                    "load_average_1m_at_end": os.getloadavg()[0],
                },
                "checksum": costs,
                "targets": {
                    "shm_fraction_of_memcpy_min": SHM_TARGET,
                    "shm_met": shm_ok,
                    "swap_stall_decode_steps_max": SWAP_TARGET,
                    "swap_met": swap_ok,
                },
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
