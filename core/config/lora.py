"""The LoRA section (``engines.lora``) and the rules it imposes on the rest of the config.

With it the torch engines train a peft LoRA adapter on the frozen base model (the causal LM of a
text workload and its critic's decoder, the transformer of the image workload's generator) instead of every weight: only
the adapter's tensors train, sit in the optimizer, travel to the rollout engine and fill the
checkpoints, on one process's trainer or a trainer group of FSDP2 or DDP ranks. What is refused
here is what was not built for adapters (megatron-core ranks, rollout engines other than the
embedded one, ``tandem serve`` and vLLM in process, Ray): each rule names the fields.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import Field, field_validator

from tandem.core.config.section import Section

if TYPE_CHECKING:
    from tandem.core.config.schema import TandemConfig

__all__ = ["LoraConfig", "check_lora", "default_probe_gap"]


def default_probe_gap(dtype: str) -> float:
    """The largest log-prob gap (nats) a weight probe accepts by default for weights in ``dtype``:
    1e-3 in float32 (measured gaps: ~1e-6 in vLLM, ~1e-7 in the embedded engine), 0.25 in
    bfloat16/float16 (rounding of a 16-bit forward alone)."""
    return 1e-3 if dtype == "float32" else 0.25


class LoraConfig(Section):
    """A LoRA adapter (peft's ``LoraConfig``) trained on the frozen base model: ``W x + (alpha / rank) B A x``."""

    rank: int = Field(8, ge=1)
    """Rank ``r`` of each adapter (A is ``r x in``, B is ``out x r``; B starts at zero, so the
    adapted model starts as the base)."""
    alpha: float = Field(16.0, gt=0)
    """peft's ``lora_alpha``: the adapter's output is scaled by ``alpha / rank``."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on each adapter's input, in the train step's forward only (the one its gradient
    comes from): every scoring forward (log-probs, reference, the probe) and generation run
    without it, so the log-probs the losses compare stay those of one policy."""
    target_modules: list[str] | None = None
    """Names (or name endings) of the linear layers that get an adapter, as peft matches them.
    None: the architecture's defaults (``engines.shared.lora``): a causal LM's attention and MLP
    projections (e.g. ``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj`` for
    Llama/Qwen2), the SD3 transformer's attention projections (``to_q to_k to_v to_out.0`` and the
    prompt stream's ``add_q_proj add_k_proj add_v_proj to_add_out``). Every name must match a
    layer of the model (checked before the run starts)."""
    lr: float | None = Field(None, gt=0)
    """AdamW learning rate of the adapter (and of the critic's own adapter and head, unless
    ``engines.critic_lr``); None: ``engines.lr``. Adapters usually train at a
    larger rate than full fine-tuning (``configs/lora_arithmetic.yaml`` says what was measured)."""
    probe_max_gap: float | None = Field(None, gt=0)
    """After every sync a fixed probe is scored by the rollout engine and its log-probs compared
    with the trainer's at the synced version: a larger gap (nats, any action) fails the sync (the
    adapter did not land). The probe: a 32-token sequence (text), the per-step log-probs of a
    4-step denoising trajectory (images). None: 1e-3 in float32, 0.25 in bfloat16/float16."""
    export_merged: bool = False
    """Also export merged weights (base + scaled adapter product) to ``checkpoint/merged``,
    loadable with plain ``from_pretrained`` (images: a whole generator folder); the adapter itself
    is always exported to ``checkpoint``, in peft's format (``PeftModel.from_pretrained`` on the
    base) or, for images, as diffusers' LoRA file (a pipeline's ``load_lora_weights``)."""

    @field_validator("target_modules")
    @classmethod
    def _names(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and (not value or not all(name.strip() for name in value)):
            raise ValueError("engines.lora.target_modules: give at least one module name (no empty names), or leave it out")
        return value

    def max_gap(self, dtype: str) -> float:
        return self.probe_max_gap if self.probe_max_gap is not None else default_probe_gap(dtype)

    @property
    def structure(self) -> dict[str, Any]:
        """What decides the adapter's tensors and what they compute: a checkpoint resumes only
        into the same (``core.checkpoint``)."""
        return {"rank": self.rank, "alpha": self.alpha, "target_modules": self.target_modules}


def check_lora(config: TandemConfig) -> None:
    """Refuse ``engines.lora`` where adapters are not built (naming the fields)."""
    engines = config.engines
    if engines.type != "torch" or engines.lora is None:
        return
    if engines.rollout not in ("embedded", "server", "vllm"):
        raise ValueError(
            f"engines.lora with engines.rollout={engines.rollout}: adapter-only weight sync reaches the embedded "
            "rollout engine, tandem serve and vLLM in process only (engines.rollout=embedded, server or vllm)"
        )
    if engines.trainer_group == "megatron":
        raise ValueError(
            "engines.lora with engines.train=megatron: adapters train on torch ranks (engines.train=torch, with "
            "engines.data_parallel=fsdp2 or ddp and any engines.train_world_size)"
        )
    if config.cluster.backend != "local":
        raise ValueError("engines.lora with cluster.backend=ray: adapters train and sync in one process (cluster.backend=local)")
