"""The vLLM side of weight sync: a worker extension that loads the trainer's buffer half in place.

What it owns: inside each vLLM worker (the model's runner, in the engine core's process: see
``VllmSettings``), a :class:`~param_sync.Receiver` over a
:class:`VllmModelTarget`, so a transfer into vLLM is checked exactly as one into the embedded
engine (versions, bucket order, every bucket's checksum) before a byte reaches the model, and
the shared-memory segment it maps for the length of one transfer. With LoRA (the engine started
with ``enable_lora``), a second receiver takes the adapter's transfers: each verified adapter
becomes a new vLLM adapter (:meth:`TandemWorkerExtension.tandem_load_adapter_shm`).

vLLM mixes :class:`TandemWorkerExtension` into its worker class (``worker_extension_cls``); the
engine calls :meth:`TandemWorkerExtension.tandem_load_shm` through ``collective_rpc`` (in
process) or ``POST /collective_rpc`` (a server), while generation is paused with the KV cache
cleared. Tensors cannot travel as RPC arguments: the call names a shared-memory segment and
sends the layout (manifest) and bucket headers as JSON; the worker maps the segment and hands
vLLM views of it.

Loading: ``reload_weights(weights_iterator=...)`` with the checkpoint's (transformers') names,
so vLLM fuses and repacks as it does at start-up. Not ``param.copy_`` nor ``model.load_weights``:
on CPU the linear layers keep repacked (oneDNN) copies that those would leave stale.

Adapters: built from the transfer's tensors in memory (vLLM's ``LoRAModel.from_lora_tensors``,
copied out of the segment, ~2 ms for the tiny test model) and added to the worker's adapter
cache under the id the engine chose; no folder is written. vLLM's public path,
``add_lora(LoRARequest(name, id, path))``, reads a peft folder: the engine's requests name this
id, already cached, so vLLM never reads their (placeholder) path.

Invariants: a transfer whose manifest, headers or bytes are wrong fails before the model is
touched, and the report says why; a model with tied embeddings has its output projection
re-packed after every reload (:meth:`TandemWorkerExtension.refresh_output_projection`).
"""

from __future__ import annotations

import json
import mmap
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandem.engines.server.receive import attach_segment
from tandem.engines.server.schemas import header_from_json, manifest_from_json
from tandem.param_sync import LayoutError, Manifest, Receiver, StaleVersionError, TensorSlice
from tandem.param_sync.bucket import dtype_from_name

__all__ = ["TandemWorkerExtension", "VllmModelTarget", "adapter_id", "checkpoint_weight_names"]


def _ask_for_amx() -> None:
    """Let this process use AMX tiles. vLLM's CPU attention runs on AMX in bfloat16 when the CPU
    has it, but Linux grants a process AMX only once it asks (``ARCH_REQ_XCOMP_PERM``); torch asks
    for its own oneDNN kernels only. Unasked, the worker dies of SIGILL (exit code -4) at its first
    bfloat16 forward (seen here on a Xeon with AMX). vLLM imports this module in every worker
    process before the model runs, hence here."""
    init = getattr(torch.cpu, "_init_amx", None)
    if init is not None:
        init()


_ask_for_amx()


def adapter_id(version: int) -> int:
    """vLLM's id of the adapter at ``version`` (ids must be positive; versions start at 0)."""
    return version + 1


def checkpoint_weight_names(model_path: str | Path) -> frozenset[str]:
    """The weight names of the safetensors checkpoint at ``model_path`` (what a transfer must name)."""
    from safetensors import safe_open

    folder = Path(model_path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return frozenset(json.loads(index.read_text())["weight_map"])
    names: set[str] = set()
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    return frozenset(names)


class VllmModelTarget:
    """A :class:`~param_sync.SyncTarget` over a vLLM model, in ``pause`` mode (the caller paused
    generation): the slices of a verified transfer are collected, then loaded in one
    ``reload_weights`` at the commit. The slices are views of a mapped segment that stays
    mapped until the transfer ends, so collecting them copies nothing."""

    def __init__(self, reload: Any, expected_names: frozenset[str], *, version: int = 0) -> None:
        self._reload = reload  # (Iterable[(name, tensor)], version) -> None
        self._expected = expected_names
        self._version = version
        self._manifest: Manifest | None = None
        self._slices: dict[str, list[TensorSlice]] = {}

    @property
    def load_mode(self) -> str:
        return "pause"

    @property
    def loaded_version(self) -> int:
        return self._version

    def begin_update(self, manifest: Manifest) -> None:
        if manifest.version < self._version:
            raise StaleVersionError(f"version {manifest.version} is older than loaded version {self._version}")
        names = {t.name for t in manifest.tensors}
        if names != self._expected:
            missing, extra = sorted(self._expected - names), sorted(names - self._expected)
            raise LayoutError(f"the transfer does not name the checkpoint's weights: missing {missing[:5]}, unknown {extra[:5]}")
        self._manifest, self._slices = manifest, {}

    def load_bucket(self, slices: Sequence[TensorSlice]) -> None:
        for piece in slices:
            self._slices.setdefault(piece.name, []).append(piece)

    def commit(self, version: int) -> float:
        assert self._manifest is not None, "commit without begin_update"
        self._reload(self._tensors(self._manifest), version)
        self._version, self._manifest, self._slices = version, None, {}
        return 0.0  # generation was paused by the caller, who times the stall

    def abort(self) -> None:
        self._manifest, self._slices = None, {}

    def _tensors(self, manifest: Manifest) -> Iterator[tuple[str, torch.Tensor]]:
        for meta in manifest.tensors:
            pieces = sorted(self._slices.get(meta.name, []), key=lambda s: s.start)
            raw = pieces[0].data if len(pieces) == 1 else np.concatenate([p.data for p in pieces])
            if raw.size != meta.nbytes:
                raise LayoutError(f"{meta.name}: {raw.size} of {meta.nbytes} bytes arrived")
            yield meta.name, torch.from_numpy(raw).view(dtype_from_name(meta.dtype)).view(meta.shape)


class TandemWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls="tandem.engines.vllm.worker.TandemWorkerExtension"``).

    ``self`` is the vLLM worker: ``self.model_runner`` and ``self.vllm_config`` are its own.
    """

    def tandem_load_shm(self, segment: str, manifest: dict[str, Any], headers: list[dict[str, int]]) -> dict[str, Any]:
        """Verify and load one transfer from the trainer's shared-memory segment ``segment``;
        returns the :class:`~param_sync.LoadReport` as a dict."""
        return _receive(self._tandem_receiver(), segment, manifest, headers)

    def tandem_load_adapter_shm(
        self, segment: str, manifest: dict[str, Any], headers: list[dict[str, int]], names: list[str],
        settings: dict[str, Any],
    ) -> dict[str, Any]:  # fmt: skip
        """Verify one adapter transfer (tensors ``names``, peft's, the adapter's ``settings``) and
        add it to vLLM's adapter cache as id ``version + 1`` (:func:`adapter_id`), replacing one of
        that id; returns the :class:`~param_sync.LoadReport` as a dict."""
        receiver: Receiver | None = getattr(self, "_tandem_adapter_receiver", None)
        if receiver is None:
            target = VllmModelTarget(lambda tensors, version: self._tandem_add_adapter(tensors, version, settings),
                                     frozenset(names))  # fmt: skip
            receiver = self._tandem_adapter_receiver = Receiver(target, consume_bucket_mb=1024.0, engine="vllm")
        return _receive(receiver, segment, manifest, headers)

    def tandem_loaded_version(self) -> int:
        return self._tandem_receiver().target.loaded_version

    def _tandem_add_adapter(self, tensors: Iterator[tuple[str, torch.Tensor]], version: int, settings: dict[str, Any]) -> None:
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        workers = self.model_runner.lora_manager  # vLLM's LRUCacheWorkerLoRAManager
        helper = PEFTHelper.from_dict(settings)
        helper.validate_legal(workers.lora_config)
        renames = getattr(workers._adapter_manager.model, "hf_to_vllm_mapper", None)
        adapter = LoRAModel.from_lora_tensors(
            adapter_id(version), {name: t.clone() for name, t in tensors},  # out of the segment, unmapped after
            helper, device="cpu", dtype=workers.lora_config.lora_dtype, model_vocab_size=workers.vocab_size,
            weights_mapper=None if renames is None else renames.get_rename_mapper(),
        )  # fmt: skip
        cache = workers._adapter_manager
        cache.remove_adapter(adapter.id)  # a version sent again replaces its adapter
        if len(cache) >= cache.capacity:  # the engine removes unused adapters first: never evict one in use
            raise RuntimeError(f"vLLM's adapter cache is full ({len(cache)} of {cache.capacity})")
        cache.add_adapter(adapter)

    def tandem_plain_logits(self) -> None:
        """Compute logits without vLLM's LoRA wrapper of the logits processor (the engine calls it
        at start-up when it serves adapters; idempotent).

        vLLM wraps the output projection for adapters of ``lm_head``, which the engine never
        serves (it refuses them). On CPU that wrapper breaks prompt log-probs (the probe's) whenever
        other requests share the batch: it indexes the prompt's positions by the batch's requests
        (``einsum(): subscript b has size 17 ... 31``) and the engine core dies. Without an
        ``lm_head`` adapter its contribution is zero, so the plain processor computes the same logits.
        """
        from vllm.lora.layers import LogitsProcessorWithLoRA

        model = self.model_runner.get_model()
        wrapper = getattr(model, "logits_processor", None)
        if isinstance(wrapper, LogitsProcessorWithLoRA):
            model.logits_processor = wrapper.base_layer

    def refresh_output_projection(self) -> None:
        """Re-pack the output projection from the (re)loaded weights.

        vLLM's CPU backend keeps a packed copy of the LM head for its GEMM; after an in-place
        reload a head tied to the input embedding keeps the old embedding's copy (log-probs
        then off by 0.3 to 0.8 nats whenever the embedding changed). Re-processing the head
        rebuilds that copy from the live weight; on GPU it does nothing.
        """
        head = getattr(self.model_runner.get_model(), "lm_head", None)
        method = getattr(head, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(head)

    def _tandem_receiver(self) -> Receiver:
        receiver: Receiver | None = getattr(self, "_tandem_receiver_instance", None)
        if receiver is None:
            names = checkpoint_weight_names(self.vllm_config.model_config.model)
            receiver = Receiver(VllmModelTarget(self._tandem_reload, names), consume_bucket_mb=1024.0, engine="vllm")
            self._tandem_receiver_instance = receiver
        return receiver

    def _tandem_reload(self, weights: Iterator[tuple[str, torch.Tensor]], version: int) -> None:
        self.reload_weights(weights_iterator=weights)  # the worker's: under its vLLM config
        self.refresh_output_projection()


def _receive(receiver: Receiver, segment: str, manifest: dict[str, Any], headers: list[dict[str, int]]) -> dict[str, Any]:
    """One transfer from shared-memory segment ``segment`` through ``receiver``; its report as a dict."""
    layout = manifest_from_json(manifest)
    mapping: mmap.mmap | None = None
    try:
        mapping = attach_segment(segment)
        stream = np.frombuffer(mapping, dtype=np.uint8)
        receiver.begin(layout, stream)
        for header in headers:
            receiver.bucket(header_from_json(header))
        report = receiver.end()
    except Exception as exc:  # a segment that cannot be mapped fails this transfer only
        report = receiver.abort(f"{type(exc).__name__}: {exc}")
    finally:
        stream = None  # the views go before the mapping
        if mapping is not None:
            _close_mapping(mapping)
    return {"engine": report.engine, "version": report.version, "ok": report.ok, "error": report.error,
            "verify_s": report.verify_s, "load_s": report.load_s, "stall_s": report.stall_s}


def _close_mapping(mapping: mmap.mmap) -> None:
    try:
        mapping.close()
    except BufferError:  # a view still exists somewhere (an exception's frame): unmapped when it goes
        pass
