"""A rollout server's side of weight sync: shared memory, a torch.distributed group, or disk.

What it owns: the server's :class:`~param_sync.Receiver` over its engine's ``target`` (so
every path checks versions and bucket checksums the way the in-process path does, and the
old weights serve until the commit), the shared-memory segments it has mapped, and the
distributed group it joined. Every method blocks; the HTTP app runs them one at a time on a
worker thread under one lock, so transfers never interleave.

- shared memory (``/tandem/update_weights_from_shm``): the trainer's buffer halves are
  ``multiprocessing.shared_memory`` segments; the server maps the segment a transfer names and,
  with its weights in host memory in ``swap`` mode, serves straight from it (zero copy: the
  target's ``map_update``). A segment stays mapped while it may be served from: only segments
  older than the two newest are unmapped;
- a distributed group (``/init_weights_update_group``, ``/update_weights_from_distributed``):
  rank 0 broadcasts each tensor into a staging stream laid out as the trainer's (same plan,
  same bucket size), then, as tandem's extension, the bucket checksums and a status word;
  the receiver verifies and loads the stream;
- disk (``/update_weights_from_disk``): a safetensors checkpoint; when the trainer wrote it
  (``engines.server.weights.DiskTransport``) its metadata holds the layout and the checksums,
  otherwise they are computed here (integrity of the file is then the filesystem's).

Invariants: a failed update of any kind leaves the previous weights serving, and the answer
says why (a :class:`~param_sync.LoadReport`); weights are read from disk only under the folders
the server was started with (symbolic links and ``..`` resolved first), and a weight group is
joined only at the addresses it was started with, its rendezvous given ``connect_timeout_s`` to
answer (a wrong address fails in seconds, not after the weight timeout).
"""

from __future__ import annotations

import _posixshmem  # the module SharedMemory maps segments with (POSIX)
import contextlib
import gc
import json
import mmap
import os
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from tandem.engines.server.dist_group import broadcast, destroy_weight_group, init_weight_group
from tandem.engines.server.limits import CONNECT_TIMEOUT_S
from tandem.engines.server.schemas import (
    InitWeightsUpdateGroupReqInput,
    UpdateWeightsFromDistributedReqInput,
    manifest_from_json,
)
from tandem.param_sync import LoadReport, Manifest, Receiver, unique_weights
from tandem.param_sync.bucket import BucketHeader, MiB, checksum, dtype_from_name, plan_manifest

__all__ = ["CHECKSUMS_KEY", "DIST_STATUS_ABORTED", "DIST_STATUS_OK", "LAYOUT_KEY", "WeightUpdates", "parse_version"]

# safetensors metadata keys written by the trainer's disk transport.
LAYOUT_KEY = "tandem_manifest"
CHECKSUMS_KEY = "tandem_checksums"
# The status word the trainer broadcasts after the checksums (dist extension).
DIST_STATUS_OK = 0
DIST_STATUS_ABORTED = 1
_DISK_BUCKET_NBYTES = 64 * MiB


def parse_version(weight_version: str | None, current: int) -> int:
    """sglang carries ``weight_version`` as a string; tandem's are step counts. None keeps the
    version served (a reload of the same step)."""
    if weight_version is None:
        return current
    try:
        return int(weight_version)
    except ValueError:
        raise ValueError(f"weight_version must be an integer step count, got {weight_version!r}") from None


def attach_segment(name: str) -> mmap.mmap:
    """Map the trainer's shared-memory segment ``name``. Not through ``SharedMemory``: attaching
    with it registers the segment with this process's resource tracker (Python < 3.13), which
    would unlink the trainer's segment when this server exits; the trainer owns it."""
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def stream_headers(manifest: Manifest, stream: np.ndarray, checksums: list[int] | None) -> list[BucketHeader]:
    """One header per bucket of ``stream``; ``checksums`` as the sender computed them, or
    computed here when the sender gave none."""
    headers = []
    for seq in range(manifest.bucket_count):
        start, stop = manifest.bucket_range(seq)
        value = checksums[seq] if checksums is not None else checksum(stream[start:stop])
        headers.append(BucketHeader(manifest.version, seq, manifest.bucket_count, start, stop - start, value))
    return headers


class WeightUpdates:
    """The server's receiving end of every weight path (see the module docstring)."""

    def __init__(self, receiver: Receiver, module: torch.nn.Module, *, timeout_s: float,
                 weight_dirs: tuple[Path, ...] = (), group_addresses: tuple[str, ...] = (),
                 connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        """``weight_dirs`` and ``group_addresses`` empty: no disk update, no weight group allowed."""
        self.receiver = receiver
        self._module = module
        self._timeout_s = timeout_s
        self._weight_dirs = tuple(Path(d).resolve() for d in weight_dirs)
        self._group_addresses = frozenset(group_addresses)
        self._connect_timeout_s = connect_timeout_s
        self._segments: OrderedDict[str, mmap.mmap] = OrderedDict()
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._staging = np.empty(0, np.uint8)

    @property
    def version(self) -> int:
        return self.receiver.target.loaded_version

    def close(self) -> None:
        self.receiver.close()  # a target serving from a segment copies its weights out first
        gc.collect()  # views of a segment caught in reference cycles would keep it mapped
        for segment in self._segments.values():
            with contextlib.suppress(BufferError):  # still viewed: unmapped when the last view goes
                segment.close()
        self._segments.clear()
        for group in self._groups.values():
            destroy_weight_group(group)
        self._groups.clear()

    # ------------------------------------------------------------------- shared memory

    def shm_begin(self, segment: str, manifest: Manifest) -> None:
        self.receiver.begin(manifest, self._map(segment, manifest.total_nbytes), persistent=True)

    def shm_bucket(self, header: BucketHeader) -> None:
        self.receiver.bucket(header)

    def shm_finish(self, *, ok: bool, reason: str = "") -> LoadReport:
        report = self.receiver.end() if ok else self.receiver.abort(reason)
        while len(self._segments) > 2:  # the target serves from the newest or its own memory
            with contextlib.suppress(BufferError):  # still viewed: unmapped when the last view goes
                self._segments.popitem(last=False)[1].close()
        return report

    def _map(self, name: str, nbytes: int) -> np.ndarray:
        if name not in self._segments:
            try:
                self._segments[name] = attach_segment(name)
            except FileNotFoundError:
                return np.empty(0, np.uint8)  # the receiver refuses the short stream, naming sizes
        self._segments.move_to_end(name)
        segment = self._segments[name]
        if len(segment) < nbytes:
            return np.empty(0, np.uint8)
        return np.frombuffer(segment, np.uint8, count=nbytes)

    # ------------------------------------------------------------------ distributed group

    def check_address(self, address: str) -> None:
        """PermissionError naming ``master_address`` unless the server may rendezvous there."""
        if address not in self._group_addresses:
            raise PermissionError(f"master_address: {address!r} is not an address this server joins weight groups at "
                                  f"(--weight-group-address: {sorted(self._group_addresses)})")

    def init_group(self, req: InitWeightsUpdateGroupReqInput) -> None:
        self.check_address(req.master_address)
        if req.group_name in self._groups:
            destroy_weight_group(self._groups.pop(req.group_name))
        try:
            self._groups[req.group_name] = init_weight_group(
                req.backend, req.master_address, req.master_port, req.rank_offset, req.world_size, req.group_name,
                self._timeout_s, connect_timeout_s=self._connect_timeout_s,
            )
        except (RuntimeError, OSError) as exc:  # torch's DistNetworkError/DistStoreError are RuntimeErrors
            raise ConnectionError(f"master_address: no weight-group rendezvous at {req.master_address}:{req.master_port} "
                                  f"within {self._connect_timeout_s:g} s ({type(exc).__name__}: {exc})") from exc

    def from_distributed(self, req: UpdateWeightsFromDistributedReqInput) -> LoadReport:
        group = self._groups.get(req.group_name)
        if group is None:
            raise ValueError(f"no weights update group {req.group_name!r}: call /init_weights_update_group first")
        version = parse_version(req.weight_version, self.version)
        entries = []
        for name, dtype, shape in zip(req.names, req.dtypes, req.shapes, strict=True):
            torch_dtype = dtype_from_name(dtype.removeprefix("torch."))
            entries.append((name, torch_dtype, tuple(shape), int(np.prod(shape, dtype=np.int64)) * torch_dtype.itemsize))
        manifest = plan_manifest(entries, bucket_nbytes=req.bucket_nbytes or _DISK_BUCKET_NBYTES, version=version)
        stream = self._staging_for(manifest.total_nbytes)
        flat = torch.from_numpy(stream)
        # Every broadcast is received, whatever happens, or the group would hang the trainer.
        for meta, (_, dtype, shape, _) in zip(manifest.tensors, entries, strict=True):
            broadcast(group, flat[meta.offset : meta.offset + meta.nbytes].view(dtype).view(shape))
        checksums: list[int] | None = None
        if req.bucket_nbytes is not None:
            tail = torch.zeros(manifest.bucket_count + 1, dtype=torch.int64)
            broadcast(group, tail)
            if int(tail[-1]) != DIST_STATUS_OK:
                return LoadReport(self.receiver.engine, self.version, False, "the trainer aborted the transfer")
            checksums = [int(v) % (1 << 64) for v in tail[:-1].tolist()]
        return self._load(manifest, stream, checksums)

    # ---------------------------------------------------------------------------- disk

    def check_folder(self, model_path: str, field: str = "model_path") -> Path:
        """``model_path`` resolved; PermissionError naming ``field`` unless it lies under an allowed folder."""
        path = Path(model_path).resolve()
        if not any(path == d or path.is_relative_to(d) for d in self._weight_dirs):
            raise PermissionError(f"{field}: {model_path!r} is outside the folders this server loads weights from "
                                  f"(--weight-dir: {[str(d) for d in self._weight_dirs]})")
        return path

    def from_disk(self, model_path: str, weight_version: str | None) -> LoadReport:
        from safetensors import safe_open

        path = self.check_folder(model_path)
        files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no safetensors file at {model_path}")
        version = parse_version(weight_version, self.version)
        tensors: dict[str, torch.Tensor] = {}
        metadata: dict[str, str] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                metadata.update(f.metadata() or {})
                tensors.update({name: f.get_tensor(name) for name in f.keys()})
        if LAYOUT_KEY in metadata:
            manifest = manifest_from_json(json.loads(metadata[LAYOUT_KEY])).with_version(version)
            checksums: list[int] | None = [int(v) for v in json.loads(metadata[CHECKSUMS_KEY])]
        else:
            # A checkpoint of the model's own: its weights in the order the target holds them,
            # tied aliases once (the file may carry them under either name).
            order = [name for name in unique_weights(self._module) if name in tensors]
            entries = [(n, tensors[n].dtype, tuple(tensors[n].shape), tensors[n].numel() * tensors[n].element_size())
                       for n in order]
            manifest, checksums = plan_manifest(entries, bucket_nbytes=_DISK_BUCKET_NBYTES, version=version), None
        stream = self._staging_for(manifest.total_nbytes)
        for meta in manifest.tensors:
            if meta.name not in tensors:
                raise KeyError(f"{model_path} has no weight {meta.name!r}")
            data = tensors[meta.name].contiguous().reshape(-1).view(torch.uint8).numpy()
            stream[meta.offset : meta.offset + meta.nbytes] = data
        return self._load(manifest, stream, checksums)

    def from_tensors(self, tensors: dict[str, torch.Tensor], version: int) -> LoadReport:
        """Load ``tensors`` (every weight the target holds, by its name, in its order) at
        ``version``, checksummed here: the load of an adapter folder or of a cleared adapter."""
        entries = [(n, t.dtype, tuple(t.shape), t.numel() * t.element_size()) for n, t in tensors.items()]
        manifest = plan_manifest(entries, bucket_nbytes=_DISK_BUCKET_NBYTES, version=version)
        stream = self._staging_for(manifest.total_nbytes)
        for meta, tensor in zip(manifest.tensors, tensors.values(), strict=True):
            stream[meta.offset : meta.offset + meta.nbytes] = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
        return self._load(manifest, stream, None)

    # ------------------------------------------------------------------------ shared

    def _staging_for(self, nbytes: int) -> np.ndarray:
        """Scratch bytes for a transfer that arrives by copy; this server's own memory, so the
        target copies out of it (never maps it) and it may be rewritten by the next transfer."""
        if self._staging.size < nbytes:
            self._staging = np.empty(nbytes, np.uint8)
        return self._staging[:nbytes]

    def _load(self, manifest: Manifest, stream: np.ndarray, checksums: list[int] | None) -> LoadReport:
        self.receiver.begin(manifest, stream)
        for header in stream_headers(manifest, stream, checksums):
            self.receiver.bucket(header)
        return self.receiver.end()
