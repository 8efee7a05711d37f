"""LoRA adapters on ``tandem serve``: the server's adapter slot, sglang's adapter routes, the probe of each server.

How a trained adapter reaches the servers: through the weight update every full sync takes (the
trainer's dual buffer, the configured transport, the receiver's bucket checksums and versioned
commit), carrying the adapter's tensors alone, so a sync's bytes are the adapter's size. Not as a
peft folder announced to ``/load_lora_adapter``: that writes the adapter to disk and reads it back
every step, has no per-bucket checksums, no shared-memory or broadcast path, and would be a second
way for weights to arrive beside the one every transport already proves.

A server started with the run's adapter settings (``--lora-rank``, ``--lora-alpha``,
``--lora-target-modules``: the trainer's ``engines.lora``) holds peft's layers over its base,
unmerged, and its weight target is the adapter's tensors only (``engines.text.rollout``): a sync
replaces the whole adapter and never writes the base, and until the commit the previous adapter serves.

What it owns:
- :class:`AdapterSlot`, sglang's ``/load_lora_adapter`` and ``/unload_lora_adapter`` on that one
  slot (the one the trainer syncs), with sglang's bodies, so a client written against sglang
  works: loading a peft folder replaces the slot's tensors through the same receiver (its
  settings must equal the server's), unloading clears them (B = 0: the base serves). One adapter
  at a time: a second name is refused until the first is unloaded;
- :class:`ServerProbe`, the trainer's side of the weight probe for servers: each server's
  scoring of the probe (``/tandem/probe_logprobs``), which ``engines.shared.probe.ProbedTransport``
  compares with the trainer's after every sync (a gap above the bound fails the sync: the adapter
  did not land).

Invariants: a refused request (bad name, folder, settings or tensors) leaves the slot as it was
and its 4xx names the field; a request never reaches the engine but through the receiver.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tandem.engines.server.auth import ApiKeys
from tandem.engines.server.receive import WeightUpdates
from tandem.engines.server.schemas import LoadLoRAAdapterReqInput, LoRAUpdateResult, UnloadLoRAAdapterReqInput
from tandem.engines.server.weights import post_json
from tandem.param_sync import LoadReport, SyncError

if TYPE_CHECKING:
    import peft

__all__ = ["AdapterRequestError", "AdapterSlot", "ServerProbe"]


class AdapterRequestError(ValueError):
    """A request the slot refuses (a 400 naming the field)."""


class AdapterSlot:
    """The server's one adapter (``adapter``: its live tensors by peft's names, with ``settings``),
    loaded and cleared by name as sglang's routes do (see the module docstring)."""

    def __init__(self, settings: peft.LoraConfig, adapter: Mapping[str, torch.Tensor], updates: WeightUpdates) -> None:
        self._settings = settings
        self._adapter = adapter
        self._updates = updates
        self.loaded: dict[str, str] = {}  # name -> folder, as sglang's ``loaded_adapters``

    def load(self, req: LoadLoRAAdapterReqInput) -> LoadReport:
        """Load the peft folder ``req.lora_path`` into the slot (blocking: a worker thread's)."""
        if req.lora_name in self.loaded:
            raise AdapterRequestError(f"lora_name: an adapter named {req.lora_name!r} is already loaded")
        if self.loaded:
            raise AdapterRequestError(f"lora_name: this server holds one adapter and {next(iter(self.loaded))!r} is "
                                      "loaded; unload it first")
        folder = self._updates.check_folder(req.lora_path, "lora_path")  # PermissionError: a 403
        self._check_settings(folder)
        tensors = self._read(folder)
        report = self._updates.from_tensors(tensors, self._updates.version)
        if report.ok:
            self.loaded[req.lora_name] = req.lora_path
        return report

    def unload(self, req: UnloadLoRAAdapterReqInput) -> LoadReport:
        """Clear the slot (every adapter tensor zero: the base serves)."""
        if req.lora_name not in self.loaded:
            raise AdapterRequestError(f"lora_name: no adapter named {req.lora_name!r} is loaded "
                                      f"(loaded: {sorted(self.loaded)})")
        zeros = {name: torch.zeros_like(t, device="cpu") for name, t in self._adapter.items()}
        report = self._updates.from_tensors(zeros, self._updates.version)
        if report.ok:
            del self.loaded[req.lora_name]
        return report

    def result(self, *, ok: bool, error: str | None = None) -> LoRAUpdateResult:
        return LoRAUpdateResult(success=ok, error_message=error, loaded_adapters=dict(self.loaded))

    def _check_settings(self, folder: Path) -> None:
        """The folder's ``adapter_config.json`` computes what the server's layers compute: the
        same rank, scale and adapted layers (the layers are built at start, not per adapter)."""
        try:
            config = json.loads((folder / "adapter_config.json").read_text())
        except (OSError, ValueError) as exc:
            raise AdapterRequestError(f"lora_path: no readable adapter_config.json in {folder} ({exc})") from None
        ours = self._settings
        theirs = {"r": config.get("r"), "lora_alpha": config.get("lora_alpha"),
                  "target_modules": sorted(_names(config.get("target_modules")))}
        wanted = {"r": ours.r, "lora_alpha": ours.lora_alpha, "target_modules": sorted(_names(ours.target_modules))}
        differ = [f"{key}={theirs[key]!r} (this server: {wanted[key]!r})" for key in wanted if theirs[key] != wanted[key]]
        if differ:
            raise AdapterRequestError(f"lora_path: {folder}'s adapter_config.json differs from the adapter this server "
                                      f"was started with (--lora-rank, --lora-alpha, --lora-target-modules): {'; '.join(differ)}")

    def _read(self, folder: Path) -> dict[str, torch.Tensor]:
        """The folder's tensors in the slot's order; every slot tensor present with its shape."""
        from safetensors.torch import load_file

        file = folder / "adapter_model.safetensors"
        if not file.is_file():
            raise AdapterRequestError(f"lora_path: no adapter_model.safetensors in {folder}")
        given = load_file(str(file))
        if given.keys() != self._adapter.keys():
            raise AdapterRequestError(
                f"lora_path: {file} holds {len(given)} tensors for an adapter of {len(self._adapter)} "
                f"(e.g. {sorted(given.keys() ^ self._adapter.keys())[:2]})"
            )
        wrong = [n for n, t in self._adapter.items() if given[n].shape != t.shape]
        if wrong:
            raise AdapterRequestError(f"lora_path: {file}: {wrong[0]!r} has shape {tuple(given[wrong[0]].shape)}, "
                                      f"this server's {tuple(self._adapter[wrong[0]].shape)}")
        return {n: given[n].to(t.dtype) for n, t in self._adapter.items()}


def _names(targets: object) -> list[str]:
    """peft's ``target_modules`` (a list, a set, or one name) as a list."""
    if targets is None:
        return []
    return [targets] if isinstance(targets, str) else list(targets)  # type: ignore[call-overload]


class ServerProbe:
    """The probe's scoring by the server a load report names (``engine``: its ``--name``), found
    among ``targets()`` (the URLs in service) by the name it answers with and remembered."""

    def __init__(self, targets: Callable[[], list[str]], *, timeout_s: float, keys: ApiKeys | None = None) -> None:
        self._targets = targets
        self._timeout_s = timeout_s
        self._keys = keys
        self._urls: dict[str, str] = {}  # server name -> URL

    def __call__(self, token_ids: Sequence[int], engine: str) -> list[float]:
        known = [self._urls[engine]] if engine in self._urls else []
        for url in known + [u for u in self._targets() if u not in known]:
            status, body = post_json(url, "/tandem/probe_logprobs", {"input_ids": list(token_ids)}, self._timeout_s, self._keys)
            if status != 200 or not isinstance(body, dict):
                raise SyncError(f"weight probe: {url}/tandem/probe_logprobs answered HTTP {status}: {body}")
            self._urls[body["name"]] = url
            if body["name"] == engine:
                return [float(v) for v in body["logprobs"]]
        raise SyncError(f"weight probe: no server in service answers as {engine!r}")
