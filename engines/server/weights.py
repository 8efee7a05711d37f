"""The trainer's side of weight sync into rollout servers: three transports and the flow's ``WeightSync``.

What it owns: :class:`~param_sync.Transport` implementations that take a transfer from the
trainer's dual buffer to every server the router has in service, each server answering with a
:class:`~param_sync.LoadReport` (a server that cannot be reached answers with a failed one):

- :class:`HttpShmTransport` (same host): the buffer halves are shared-memory segments; one
  streaming ``POST /tandem/update_weights_from_shm`` per server announces the segment and
  manifest, then each bucket as the gather finishes it, so the server verifies bucket ``k``
  while ``k + 1`` is gathered, and maps the half (zero copy: it serves from the trainer's buffer);
- :class:`HttpDistTransport` (across hosts): sglang's ``/init_weights_update_group`` once,
  then per version ``/update_weights_from_distributed`` while this process, rank 0, broadcasts
  each tensor straight from the buffer half (gloo on CPU, NCCL on GPU). To tandem's servers it
  also broadcasts the bucket checksums (a real sglang server is not asked for them);
- :class:`DiskTransport` (the fallback): a safetensors checkpoint written from the half, with
  the layout and checksums in its metadata, then ``/update_weights_from_disk``.

and :class:`ServerWeightSync`, the flow's ``WeightSync`` over them, which tells the router the
version every server serves, and which, for servers that cannot change weights under running
requests (sglang), pauses generation for the update (requests in flight come back aborted and
the router resumes them under the new weights, recomputing their prefix).

Invariants: the send functions block (they run on the syncer's send thread); a transfer ends
with exactly one report per server it was sent to; versions and checksums are checked by each
server's receiver as in-process; a failed transfer leaves every server on its old weights.
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import numpy as np
import torch

from tandem.core.protocols import SyncReport, WeightSync
from tandem.engines.server.auth import ApiKeys, bearer
from tandem.engines.server.dist_group import broadcast, destroy_weight_group, init_weight_group
from tandem.engines.server.receive import CHECKSUMS_KEY, LAYOUT_KEY
from tandem.engines.server.router import ServerRolloutEngine
from tandem.engines.server.schemas import header_to_json, manifest_to_json
from tandem.param_sync import BucketHeader, BufferHalf, LoadReport, Manifest
from tandem.param_sync.bucket import dtype_from_name
from tandem.param_sync.buffer import host_half
from tandem.param_sync.transports.shm import segment_half

__all__ = [
    "ClosableWeightSync",
    "DiskTransport",
    "HttpDistTransport",
    "HttpShmTransport",
    "ServerWeightSync",
    "free_port",
    "post_json",
]

Targets = Callable[[], list[str]]  # the URLs of the servers a transfer goes to, asked per transfer


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _connection(url: str, timeout_s: float) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=timeout_s)


def post_json(url: str, path: str, body: Any, timeout_s: float, keys: ApiKeys | None = None) -> tuple[int, Any]:
    """A blocking JSON POST (the transports run on worker threads, away from any event loop),
    with the key ``keys`` give for ``path``."""
    conn = _connection(url, timeout_s)
    try:
        headers = {"Content-Type": "application/json", **bearer((keys or ApiKeys()).for_client(path))}
        conn.request("POST", path, body=json.dumps(body), headers=headers)
        resp = conn.getresponse()
        text = resp.read().decode()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(text) if text else None
    except ValueError:
        return resp.status, {"message": text}


def _failed(url: str, error: str) -> LoadReport:
    return LoadReport(url, -1, ok=False, error=error)


def _in_threads(
    urls: list[str], work: Callable[[int, str], LoadReport]
) -> tuple[list[threading.Thread], list[LoadReport | None]]:
    """Start ``work(i, url)`` for each URL on a thread of its own; the reports fill in as they end."""
    reports: list[LoadReport | None] = [None] * len(urls)

    def run(i: int, url: str) -> None:
        try:
            reports[i] = work(i, url)
        except Exception as exc:
            reports[i] = _failed(url, f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run, args=(i, url), name=f"weights-{i}", daemon=True) for i, url in enumerate(urls)]
    for thread in threads:
        thread.start()
    return threads, reports


def _join(
    urls: list[str], threads: list[threading.Thread], reports: list[LoadReport | None], deadline: float
) -> list[LoadReport]:
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [r if r is not None else _failed(url, "no answer in time") for url, r in zip(urls, reports, strict=True)]


def _success_report(url: str, status: int, body: Any, version: int) -> LoadReport:
    """sglang's ``{success, message}`` answer as a load report."""
    ok = status == 200 and isinstance(body, dict) and bool(body.get("success"))
    message = body.get("message", "") if isinstance(body, dict) else str(body)
    return LoadReport(url, version if ok else -1, ok, "" if ok else f"HTTP {status}: {message}")


# ------------------------------------------------------------------------ shared memory


class HttpShmTransport:
    """Same-host servers map the trainer's buffer halves (shared-memory segments)."""

    def __init__(self, targets: Targets, *, timeout_s: float, keys: ApiKeys | None = None) -> None:
        self._keys = keys or ApiKeys()
        self._targets = targets
        self._timeout_s = timeout_s

    def allocate(self, nbytes: int) -> BufferHalf:
        return segment_half(nbytes)

    def send(self, manifest: Manifest, half: BufferHalf, buckets: Iterable[BucketHeader]) -> list[LoadReport]:
        if half.segment is None:
            raise ValueError("the shared-memory transport sends only halves it allocated")
        urls = self._targets()
        feeds: list[queue.SimpleQueue[bytes | None]] = [queue.SimpleQueue() for _ in urls]
        threads, reports = _in_threads(urls, lambda i, url: self._post(url, feeds[i]))

        def say(message: dict[str, Any] | None) -> None:
            line = None if message is None else json.dumps(message).encode() + b"\n"
            for feed in feeds:
                feed.put(line)

        say({"type": "begin", "segment": half.segment, "manifest": manifest_to_json(manifest)})
        try:
            for header in buckets:
                say({"type": "bucket", "header": header_to_json(header)})
        except BaseException as exc:
            say({"type": "abort", "reason": str(exc)})
            say(None)
            _join(urls, threads, reports, time.monotonic() + self._timeout_s)
            raise
        say({"type": "end"})
        say(None)  # the end of each request's body
        return _join(urls, threads, reports, time.monotonic() + self._timeout_s)

    def _post(self, url: str, feed: queue.SimpleQueue[bytes | None]) -> LoadReport:
        def body() -> Iterator[bytes]:
            while (line := feed.get()) is not None:
                yield line

        conn = _connection(url, self._timeout_s)
        try:
            # An iterable body goes out chunked, each line as the gather announces its bucket.
            path = "/tandem/update_weights_from_shm"
            headers = {"Content-Type": "application/x-ndjson", **bearer(self._keys.for_client(path))}
            conn.request("POST", path, body=body(), headers=headers)
            resp = conn.getresponse()
            answer = json.loads(resp.read().decode())
        except (OSError, http.client.HTTPException, ValueError) as exc:
            return _failed(url, f"server gone: {type(exc).__name__}: {exc}")
        finally:
            conn.close()
        if resp.status == 200 or (resp.status == 400 and "ok" in answer):  # 400: the server's report of a failed transfer
            return LoadReport(**answer)
        return _failed(url, f"HTTP {resp.status}: {answer}")

    def close(self) -> None:
        """Nothing to tell: each server copies its weights out of a segment it serves from
        before the segment goes (it keeps the segment mapped; unlinking only removes the name)."""


# ------------------------------------------------------------------- torch.distributed


class HttpDistTransport:
    """Rank 0 of a weight group that every server joins (sglang's distributed update)."""

    def __init__(self, targets: Targets, *, master_address: str, backend: str, checksums: bool, timeout_s: float,
                 group_name: str = "weight_update_group", keys: ApiKeys | None = None) -> None:
        self._targets = targets
        self._keys = keys
        self._address = master_address
        self._backend = backend
        self._checksums = checksums
        self._timeout_s = timeout_s
        self._group_name = group_name
        self._group: Any = None
        self._members: list[str] = []

    def allocate(self, nbytes: int) -> BufferHalf:
        return host_half(nbytes)

    def send(self, manifest: Manifest, half: BufferHalf, buckets: Iterable[BucketHeader]) -> list[LoadReport]:
        # The whole gather first: once the servers are told to receive, every broadcast must
        # happen, and a real sglang server cannot be told that the bytes were bad.
        headers = list(buckets)
        urls = self._targets()
        if urls != self._members:
            self._join(urls)
        body = {
            "names": [t.name for t in manifest.tensors], "dtypes": [t.dtype for t in manifest.tensors],
            "shapes": [list(t.shape) for t in manifest.tensors], "group_name": self._group_name,
            "weight_version": str(manifest.version),
        }
        if self._checksums:
            body["bucket_nbytes"] = manifest.bucket_nbytes

        def post(_: int, url: str) -> LoadReport:
            status, answer = post_json(url, "/update_weights_from_distributed", body, self._timeout_s, self._keys)
            return _success_report(url, status, answer, manifest.version)

        threads, reports = _in_threads(urls, post)
        try:
            flat = torch.from_numpy(half.array)
            for meta in manifest.tensors:
                dtype = dtype_from_name(meta.dtype)
                broadcast(self._group, flat[meta.offset : meta.offset + meta.nbytes].view(dtype).view(meta.shape))
            if self._checksums:
                sums = np.array([h.checksum for h in headers], dtype=np.uint64).view(np.int64)
                broadcast(self._group, torch.from_numpy(sums.copy()))
        except Exception:
            self._leave()  # a broken group is re-formed at the next transfer
            raise
        out = _join(urls, threads, reports, time.monotonic() + self._timeout_s)
        if not all(r.ok for r in out):
            self._leave()  # a server that failed may have left the group's sequence
        return out

    def _join(self, urls: list[str]) -> None:
        """(Re-)form the group: this process is rank 0 and hosts the rendezvous."""
        self._leave()
        port = free_port(self._address)
        world = len(urls) + 1
        threads, reports = _in_threads(urls, lambda i, url: self._init(url, i + 1, port, world))
        self._group = init_weight_group(self._backend, self._address, port, 0, world, self._group_name, self._timeout_s)
        failed = [r for r in _join(urls, threads, reports, time.monotonic() + self._timeout_s) if not r.ok]
        if failed:
            self._leave()
            raise ConnectionError(f"weights update group not formed: {'; '.join(f'{r.engine}: {r.error}' for r in failed)}")
        self._members = list(urls)

    def _init(self, url: str, rank: int, port: int, world: int) -> LoadReport:
        body = {"master_address": self._address, "master_port": port, "rank_offset": rank, "world_size": world,
                "group_name": self._group_name, "backend": self._backend}
        return _success_report(url, *post_json(url, "/init_weights_update_group", body, self._timeout_s, self._keys), 0)

    def _leave(self) -> None:
        if self._group is not None:
            destroy_weight_group(self._group)
        self._group, self._members = None, []

    def close(self) -> None:
        self._leave()


# -------------------------------------------------------------------------------- disk

_ST_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64", "int32": "I32",
              "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def write_safetensors(path: Path, manifest: Manifest, stream: np.ndarray, metadata: dict[str, str]) -> None:
    """Write the manifest's tensors from ``stream`` as a safetensors file, packed (the format
    allows no gaps) and without a copy in memory. Written by hand because safetensors' own
    writer refuses tensors that share one buffer, which is what the half is."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for meta in manifest.tensors:
        header[meta.name] = {
            "dtype": _ST_DTYPES[meta.dtype], "shape": list(meta.shape), "data_offsets": [offset, offset + meta.nbytes]
        }
        offset += meta.nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts aligned
    with path.open("wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for meta in manifest.tensors:
            f.write(memoryview(stream[meta.offset : meta.offset + meta.nbytes]))
        f.flush()
        os.fsync(f.fileno())


class DiskTransport:
    """A checkpoint per version in ``folder`` (the two newest kept), loaded by every server."""

    def __init__(self, targets: Targets, folder: Path, *, timeout_s: float, keys: ApiKeys | None = None) -> None:
        self._targets = targets
        self._keys = keys
        self._folder = folder
        self._timeout_s = timeout_s

    def allocate(self, nbytes: int) -> BufferHalf:
        return host_half(nbytes)

    def send(self, manifest: Manifest, half: BufferHalf, buckets: Iterable[BucketHeader]) -> list[LoadReport]:
        headers = list(buckets)  # the whole gather: the file is written from a complete half
        folder = self._folder / f"v{manifest.version:08d}"
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        metadata = {LAYOUT_KEY: json.dumps(manifest_to_json(manifest)), CHECKSUMS_KEY: json.dumps([h.checksum for h in headers])}
        write_safetensors(tmp / "model.safetensors", manifest, half.array, metadata)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
        for old in sorted(self._folder.glob("v*"))[:-2]:
            shutil.rmtree(old, ignore_errors=True)
        urls = self._targets()
        body = {"model_path": str(folder), "weight_version": str(manifest.version)}
        def post(_: int, url: str) -> LoadReport:
            status, answer = post_json(url, "/update_weights_from_disk", body, self._timeout_s, self._keys)
            return _success_report(url, status, answer, manifest.version)

        threads, reports = _in_threads(urls, post)
        return _join(urls, threads, reports, time.monotonic() + self._timeout_s)

    def close(self) -> None:
        shutil.rmtree(self._folder, ignore_errors=True)


# --------------------------------------------------------------------------- WeightSync


class ClosableWeightSync(WeightSync, Protocol):
    """A weight sync that holds threads or buffers until closed (``TorchWeightSync`` and its wrappers)."""

    def close(self) -> None: ...


class ServerWeightSync:
    """``core.protocols.WeightSync`` into rollout servers (see the module docstring)."""

    def __init__(self, inner: ClosableWeightSync, router: ServerRolloutEngine) -> None:
        self._inner = inner
        self._router = router

    async def sync(self, version: int) -> SyncReport:
        router = self._router
        await router.start()
        if not router.live_updates:
            await router.pause_generation()
        try:
            report = await self._inner.sync(version)
            router.loaded(report.version)  # before resuming: resumed segments carry the new version
        except Exception:
            await router.check()  # a server that went away leaves service: a retry goes to the others
            raise
        finally:
            if not router.live_updates:
                await router.continue_generation()
        return report

    async def reload(self) -> None:
        """Load the trainer's current weights (into a server that came back)."""
        await self.sync(0)

    def close(self) -> None:
        self._inner.close()
