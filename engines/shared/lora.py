"""LoRA adapters with peft, on causal LMs and diffusers transformers: which layers get one, what trains and syncs, the exports.

What it owns: the per-architecture default target modules; :func:`lora_settings` (causal LMs)
and :func:`transformer_lora_settings` (diffusers transformers), which turn ``engines.lora`` into
peft's ``LoraConfig`` after checking every target against the model's layers (on a skeleton on
the meta device, before any engine loads weights); adding an adapter to a model
(:func:`with_adapter`: peft's ``get_peft_model`` wraps a causal LM; :func:`with_diffusers_adapter`:
diffusers' ``add_adapter`` injects into a transformer in place; :func:`with_injected_adapter`:
peft's ``inject_adapter_in_model`` into any module in place, the critic's decoder body); the adapter's live tensors under
peft's own names (:func:`adapter_tensors`, :func:`load_adapter`) and what of a trainer's model syncs and fills its
checkpoints, adapter or not (:class:`TrainedWeights`); dropout in the gradient forward only
(:func:`adapter_dropout`); the KL reference of a LoRA run, the base with the adapter disabled
(:class:`BaseModelReference`); and the exports (:func:`save_adapter`, :func:`save_merged` for
causal LMs; :func:`save_diffusers_adapter`, :func:`merged_transformer` for transformers). No LoRA
layer is written here: peft's are used.

Why diffusers' ``add_adapter`` for transformers rather than ``get_peft_model``: it injects peft's
layers in place, so the transformer stays a diffusers model (its forward signature, config and
``save_pretrained``), and peft names its adapter tensors as diffusers' LoRA files do
(``transformer_blocks.0.attn.to_q.lora_A.weight``, under ``transformer.`` in
``pytorch_lora_weights.safetensors``): sync, checkpoints and export share one naming, no renames.

peft is imported inside the functions: only runs that train an adapter pay for it (seconds).

Invariants:
- a freshly wrapped model computes exactly its base model (peft starts every B at zero,
  whatever A was drawn), so a rollout engine that has received no sync yet serves the trainer's
  version 0;
- :func:`adapter_tensors` names each adapter tensor as peft's ``adapter_model.safetensors``
  does (the adapter's name removed), in the same order on every model given an adapter with the
  same settings: the trainer's sync, the rollout engine's target, the checkpoints and the export
  all use these names;
- a model given an adapter here scores in ``eval()`` mode: the adapter's dropout drops only
  inside :func:`adapter_dropout`.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from tandem.core.config import ConfigError, LoraConfig
from tandem.core.records import Trajectory
from tandem.param_sync import unique_weights

if TYPE_CHECKING:
    import peft

__all__ = [
    "CAUSAL_LM_TARGETS",
    "DIFFUSERS_TARGETS",
    "DIFFUSERS_WEIGHTS_FILE",
    "BaseModelReference",
    "TrainedWeights",
    "adapter_dropout",
    "adapter_names",
    "adapter_tensors",
    "load_adapter",
    "lora_settings",
    "merged_transformer",
    "save_adapter",
    "save_diffusers_adapter",
    "save_merged",
    "transformer_lora_settings",
    "with_adapter",
    "with_diffusers_adapter",
    "with_injected_adapter",
]

_LLAMA_LIKE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Attention and MLP projections by ``model_type``: every linear layer of a decoder block, as
# QLoRA found adapting all of them matches full fine-tuning where attention alone does not.
# Checked against each architecture's layers by tests/unit/engines/shared/test_lora.py.
CAUSAL_LM_TARGETS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo2"), _LLAMA_LIKE),
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    "gpt2": ("c_attn", "c_proj", "c_fc"),
    "gpt_neox": ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
}
# Attention projections by diffusers transformer class: the image stream's and the prompt
# stream's (SD3's joint blocks; the last block has no ``to_add_out``), as Flow-GRPO's reference
# adapts SD3.5-M. Of a default, the names the model has are kept (every given name must match).
DIFFUSERS_TARGETS: dict[str, tuple[str, ...]] = {
    "SD3Transformer2DModel": ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
}
# The file diffusers' ``load_lora_weights`` reads from a folder.
DIFFUSERS_WEIGHTS_FILE = "pytorch_lora_weights.safetensors"


def lora_settings(spec: LoraConfig, model_path: str | Path) -> peft.LoraConfig:
    """peft's ``LoraConfig`` for ``spec`` on the causal LM at ``model_path``; :class:`ConfigError`
    naming ``engines.lora.target_modules`` when the architecture has no default or a name
    matches no layer peft can adapt (each name must match one, so a typo beside good names fails)."""
    peft_lora = _peft_lora_config()
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    config = AutoConfig.from_pretrained(str(model_path))
    targets = spec.target_modules or CAUSAL_LM_TARGETS.get(config.model_type)
    if targets is None:
        raise ConfigError(
            f"engines.lora.target_modules: no default for model type {config.model_type!r} ({model_path}); name the "
            f"layers to adapt (defaults exist for {sorted(CAUSAL_LM_TARGETS)})"
        )
    settings = peft_lora(
        r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=list(targets), bias="none",
        task_type="CAUSAL_LM",
    )  # fmt: skip
    with torch.device("meta"):  # the layers' names and types, no weights
        skeleton = AutoModelForCausalLM.from_config(config)
    linear = (nn.Linear, Conv1D)  # GPT-2's projections are Conv1D
    _check_targets(skeleton, targets, lambda: with_adapter(skeleton, settings), linear, f"{model_path} ({config.model_type})")
    return settings


def transformer_lora_settings(spec: LoraConfig, model_class: type, folder: str | Path) -> peft.LoraConfig:
    """peft's ``LoraConfig`` for ``spec`` on the diffusers transformer ``model_class`` saved in
    ``folder``; :class:`ConfigError` naming ``engines.lora.target_modules`` as :func:`lora_settings`
    does. Of a default (:data:`DIFFUSERS_TARGETS`), the names the model has."""
    peft_lora = _peft_lora_config()
    class_name = model_class.__name__
    with torch.device("meta"):  # the layers' names and types, no weights
        skeleton = model_class.from_config(model_class.load_config(str(folder)))  # type: ignore[attr-defined]
    if spec.target_modules:
        targets = spec.target_modules
    elif class_name in DIFFUSERS_TARGETS:
        layers = [name for name, m in skeleton.named_modules() if isinstance(m, nn.Linear)]
        targets = [t for t in DIFFUSERS_TARGETS[class_name] if _matching(t, layers)]
    else:
        raise ConfigError(
            f"engines.lora.target_modules: no default for the transformer {class_name} ({folder}); name the layers to "
            f"adapt (defaults exist for {sorted(DIFFUSERS_TARGETS)})"
        )
    settings = peft_lora(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=list(targets), bias="none")
    _check_targets(
        skeleton, targets, lambda: with_diffusers_adapter(skeleton, settings), (nn.Linear,), f"{folder} ({class_name})"
    )
    return settings


def _peft_lora_config() -> type[peft.LoraConfig]:
    try:
        from peft import LoraConfig as PeftLoraConfig
    except ImportError:
        raise ConfigError("engines.lora needs peft: pip install 'tandem[lora]' (make installs it)") from None
    return PeftLoraConfig


def _matching(target: str, names: Sequence[str]) -> list[str]:
    """The module names peft's ``target_modules`` entry ``target`` matches (the name or its ending)."""
    return [name for name in names if name == target or name.endswith(f".{target}")]


def _check_targets(
    skeleton: nn.Module, targets: Sequence[str], adapt: Callable[[], nn.Module], linear: tuple[type, ...], what: str
) -> None:
    """Adapt ``skeleton`` (``adapt``) and check that every target matched a layer peft adapted."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = sorted({name.rsplit(".", 1)[-1] for name, m in skeleton.named_modules() if isinstance(m, linear)})
    try:
        adapted = [name for name, m in adapt().named_modules() if isinstance(m, BaseTunerLayer)]
    except ValueError as err:  # peft: nothing matched, or a match it cannot adapt
        raise ConfigError(f"engines.lora.target_modules={list(targets)}: {err} (linear layers: {layers})") from None
    unmatched = [t for t in targets if not _matching(t, adapted)]
    if unmatched:
        raise ConfigError(
            f"engines.lora.target_modules: {unmatched} match no layer of {what}; its linear layers are named {layers}"
        )


def with_adapter(model: nn.Module, settings: peft.LoraConfig, *, seed: int | None = None) -> peft.PeftModel:
    """``model`` wrapped with a fresh adapter (peft's ``get_peft_model``): the base frozen, the
    adapter's tensors requiring grad. ``seed``: draw the adapter's A matrices from it (torch's
    global generator left as it was), so every rank of a trainer group starts from the same adapter;
    None draws them from the global generator."""
    from peft import get_peft_model

    with warnings.catch_warnings(), torch.random.fork_rng(devices=[], enabled=seed is not None):
        # peft asks the model a deprecated transformers question; the answer is right, the warning noise.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        if seed is not None:
            torch.manual_seed(seed)
        return get_peft_model(model, settings)


def with_diffusers_adapter(transformer: nn.Module, settings: peft.LoraConfig) -> nn.Module:
    """``transformer`` (a diffusers model) with a fresh adapter injected in place (diffusers'
    ``add_adapter``), returned in ``eval()`` mode: the base frozen, the adapter's tensors requiring grad."""
    transformer.add_adapter(settings)  # type: ignore[operator]
    return transformer.eval()  # the injected layers (the adapter's dropout) start in train mode


def with_injected_adapter(model: nn.Module, settings: peft.LoraConfig) -> nn.Module:
    """``model`` with a fresh adapter injected in place (peft's ``inject_adapter_in_model``: no
    wrapper, so a module inside a larger one, the critic's decoder, stays where it is), returned in
    ``eval()`` mode: the base frozen, the adapter's tensors requiring grad."""
    from peft import inject_adapter_in_model

    return inject_adapter_in_model(settings, model).eval()


def adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's live parameters (not copies: loading into their ``.data`` changes the
    model) under peft's saved names, e.g. ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``
    (a wrapped causal LM) or ``transformer_blocks.0.attn.to_q.lora_A.weight`` (an injected transformer)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, state_dict=model.state_dict(keep_vars=True), save_embedding_layers=False)


def adapter_names(model_path: str | Path, settings: peft.LoraConfig) -> frozenset[str]:
    """The names :func:`adapter_tensors` gives the adapter of ``settings`` on the causal LM at
    ``model_path``, found on a skeleton on the meta device (no weights load): what a rollout
    engine outside this process checks each transfer against."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_path)))
    return frozenset(adapter_tensors(with_adapter(skeleton, copy.deepcopy(settings))))


def load_adapter(model: nn.Module, adapter: Mapping[str, torch.Tensor]) -> None:
    """Copy ``adapter`` (tensors under :func:`adapter_tensors`' names) into ``model``'s adapter;
    ``ValueError`` naming the difference unless it holds exactly this adapter's tensors. A sharded
    model (FSDP2's DTensor parameters) keeps its own shard of each whole tensor given (no collective)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    live = adapter_tensors(model)
    if adapter.keys() != live.keys():
        raise ValueError(
            f"{len(adapter)} tensors given for an adapter of {len(live)} (e.g. {sorted(adapter.keys() ^ live.keys())[:2]}): "
            "saved with other engines.lora settings, or without an adapter"
        )
    with torch.no_grad():
        for name, tensor in live.items():
            value = adapter[name]
            if isinstance(tensor, DTensor):
                value = distribute_tensor(value.to(tensor.dtype), tensor.device_mesh, tensor.placements, src_data_rank=None)
            tensor.copy_(value)


class TrainedWeights:
    """What of a trainer's model syncs and fills its checkpoints: every weight, or with an adapter
    (``adapted``) the adapter alone, the base staying as loaded. Read on the trainer's worker
    thread or under its weights lock, like the model."""

    def __init__(self, model: nn.Module, *, adapted: bool) -> None:
        self.model = model
        self.adapted = adapted
        # The adapter's parameters live as long as the model and are only ever written in place
        # (optimizer steps, load_adapter's copy_): listed once here, not by peft's walk over the
        # whole state dict at every sync (3.5 ms of a 1M model's sync, against 0.16 ms for all weights).
        self._adapter = {name: t.detach() for name, t in adapter_tensors(model).items()} if adapted else None

    def synced(self) -> dict[str, torch.Tensor]:
        """The live tensors a sync reads, by name: every weight, tied storage once
        (``param_sync.unique_weights``), or the adapter's under :func:`adapter_tensors`' names."""
        if self._adapter is None:
            return unique_weights(self.model)
        return dict(self._adapter)

    def state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint holds of the model: its ``state_dict``, or the adapter's tensors."""
        return self.synced() if self.adapted else self.model.state_dict()

    def load(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore what :meth:`state` returned; another adapter's tensors (or a whole model's
        into an adapter) are refused, naming the difference."""
        if self.adapted:
            load_adapter(self.model, state)
        else:
            self.model.load_state_dict(state)


class BaseModelReference:
    """A LoRA trainer's base model as a ``LogProbEngine``: its log-probs with the adapter disabled
    (peft's ``disable_adapter``), scored by the trainer itself between its steps (``score_base``:
    on the one-process trainer's worker thread, or by a trainer group's ranks), so the KL reference
    costs no second copy of the base. Frozen: its version stays 0."""

    version = 0

    def __init__(self, score_base: Callable[[Sequence[Trajectory]], Awaitable[list[list[float]]]]) -> None:
        self._score_base = score_base

    async def logprobs(self, trajectories: Sequence[Trajectory]) -> list[list[float]]:
        return await self._score_base(trajectories)


@contextmanager
def adapter_dropout(model: nn.Module) -> Iterator[None]:
    """Run the block with the adapters' dropout on, the rest of the model in ``eval()`` as always."""
    dropouts = [m for name, m in model.named_modules() if isinstance(m, nn.Dropout) and ".lora_dropout." in name]
    for m in dropouts:
        m.train()
    try:
        yield
    finally:
        for m in dropouts:
            m.eval()


def save_adapter(model: peft.PeftModel, adapter: Mapping[str, torch.Tensor], folder: Path) -> None:
    """Write ``adapter`` (a snapshot under :func:`adapter_tensors`' names) with ``model``'s
    settings in peft's format (``adapter_config.json``, ``adapter_model.safetensors``), loadable
    with ``PeftModel.from_pretrained`` on the base."""
    # save_embedding_layers=False: the base's embeddings never train here, and peft's "auto"
    # would load the base's config again to find out.
    model.save_pretrained(folder, state_dict=dict(adapter), save_embedding_layers=False)


def save_merged(
    model_path: str | Path, settings: peft.LoraConfig, adapter: Mapping[str, torch.Tensor], folder: Path, dtype: torch.dtype
) -> None:
    """Write the base at ``model_path`` with ``adapter`` merged in (each adapted weight
    ``W + (alpha / rank) B A``, by peft's ``merge_and_unload``) to ``folder``, loadable with plain
    ``from_pretrained``. Loads a copy of the base for it: the trainer's own keeps its adapter apart."""
    from transformers import AutoModelForCausalLM

    model = with_adapter(AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype), settings)
    load_adapter(model, adapter)
    model.merge_and_unload().save_pretrained(folder)


def save_diffusers_adapter(transformer: nn.Module, adapter: Mapping[str, torch.Tensor], folder: Path) -> None:
    """Write ``adapter`` (a snapshot under :func:`adapter_tensors`' names) of ``transformer`` as
    diffusers' LoRA file (:data:`DIFFUSERS_WEIGHTS_FILE`, keys under ``transformer.``, the
    adapter's settings in its metadata so ``alpha / rank`` survives): a pipeline over the base
    loads it with ``load_lora_weights(folder)``."""
    from diffusers.loaders import SD3LoraLoaderMixin  # any pipeline's transformer LoRA file has this layout

    settings = transformer.peft_config["default"]  # type: ignore[index]
    SD3LoraLoaderMixin.save_lora_weights(
        folder, transformer_lora_layers=dict(adapter), transformer_lora_adapter_metadata=settings.to_dict()
    )


def merged_transformer(transformer: nn.Module) -> nn.Module:
    """A copy of ``transformer`` with its adapter merged in (each adapted weight ``W + (alpha /
    rank) B A``, diffusers' ``fuse_lora``) and peft's layers removed: a plain diffusers model."""
    merged = copy.deepcopy(transformer)
    merged.fuse_lora()  # type: ignore[operator]
    merged.unload_lora()  # type: ignore[operator]
    return merged
