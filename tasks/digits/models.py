"""The networks of the digits task: the generator (a diffusers SD3 transformer), its prompt encoder, the classifier.

Owns their architectures and how each is saved and loaded:

- the generator is ``diffusers.SD3Transformer2DModel`` with a tiny config (about 1 M
  parameters, 2×2 patches over the 8×8 image), so an engine written for it runs a real
  SD3-family checkpoint unchanged; it predicts the rectified-flow velocity ``ε - x_0`` and
  takes the timestep ``sigma · 1000``; saved with ``save_pretrained`` next to its
  ``FlowMatchEulerDiscreteScheduler`` config;
- :class:`DigitPromptEncoder` stands in for SD3's text encoders: a learned table from a
  prompt index (the digit, or :data:`~tasks.digits.UNCONDITIONAL_INDEX` for the empty
  prompt) to ``encoder_hidden_states [B, L, joint_attention_dim]`` and ``pooled_projections
  [B, pooled_projection_dim]``; a diffusers model, so it saves and loads the same way;
- :class:`DigitClassifier`, the task's OCR, is plain torch (safetensors plus a JSON config)
  so a reward process loads it without diffusers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from safetensors.torch import load_file, save_file
from torch import nn

from tandem.tasks.digits import (
    CLASSIFIER_DIR,
    IMAGE_SIZE,
    MODEL_DIR,
    NUM_DIGITS,
    PROMPT_ENCODER_DIR,
    SCHEDULER_DIR,
    TRANSFORMER_DIR,
    UNCONDITIONAL_INDEX,
    parse_prompt,
)

__all__ = [
    "JOINT_ATTENTION_DIM",
    "MODEL_INDEX",
    "MODEL_INDEX_FILE",
    "POOLED_PROJECTION_DIM",
    "ClassifierConfig",
    "DigitClassifier",
    "DigitGenerator",
    "DigitPromptEncoder",
    "build_scheduler",
    "build_transformer",
    "load_classifier",
    "load_generator",
    "save_classifier",
]

JOINT_ATTENTION_DIM = 64
POOLED_PROJECTION_DIM = 64


def build_transformer() -> SD3Transformer2DModel:
    """A ~0.96 M-parameter SD3 transformer for 1-channel 8×8 latents: 3 joint blocks of width 96."""
    heads, head_dim, patch = 3, 32, 2
    return SD3Transformer2DModel(
        sample_size=IMAGE_SIZE,
        patch_size=patch,
        in_channels=1,
        out_channels=1,
        num_layers=3,
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=JOINT_ATTENTION_DIM,
        caption_projection_dim=heads * head_dim,  # SD3 requires the caption width to equal the inner width
        pooled_projection_dim=POOLED_PROJECTION_DIM,
        pos_embed_max_size=IMAGE_SIZE // patch,
        qk_norm="rms_norm",  # as in SD3.5
    )


def build_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """The sampling schedule: rectified flow, no shift (shift > 1 serves high resolutions, not 8×8)."""
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)


class DigitPromptEncoder(ModelMixin, ConfigMixin):
    """A learned embedding per prompt index, shaped like SD3's text-encoder outputs.

    Row ``d`` (0–9) is "draw the digit d"; row :data:`~tasks.digits.UNCONDITIONAL_INDEX` the
    empty prompt that pretraining's label dropout teaches, for classifier-free guidance.
    """

    @register_to_config
    def __init__(
        self,
        num_prompts: int = NUM_DIGITS + 1,
        sequence_length: int = 1,
        joint_attention_dim: int = JOINT_ATTENTION_DIM,
        pooled_projection_dim: int = POOLED_PROJECTION_DIM,
    ) -> None:
        super().__init__()
        self.tokens = nn.Embedding(num_prompts, sequence_length * joint_attention_dim)
        self.pooled = nn.Embedding(num_prompts, pooled_projection_dim)

    def forward(self, prompt_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(encoder_hidden_states [B, L, joint_attention_dim], pooled_projections [B, pooled_dim])``."""
        tokens = self.tokens(prompt_indices).view(
            prompt_indices.shape[0], self.config.sequence_length, self.config.joint_attention_dim
        )
        return tokens, self.pooled(prompt_indices)

    def encode(self, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """The conditioning of prompt texts, as an engine that knows no task asks for it: ``"draw the digit d"``
        is row ``d``, the empty prompt ``""`` the unconditional row (ValueError for any other text)."""
        indices = [UNCONDITIONAL_INDEX if prompt == "" else parse_prompt(prompt) for prompt in prompts]
        return self(torch.tensor(indices, dtype=torch.long, device=self.tokens.weight.device))


@dataclass(frozen=True, slots=True)
class ClassifierConfig:
    """The classifier's shape, saved as ``config.json`` beside its weights."""

    channels: tuple[int, int] = (16, 32)
    hidden: int = 64
    num_classes: int = NUM_DIGITS


class DigitClassifier(nn.Module):
    """A small CNN from an 8×8 image in [-1, 1] (``[B, 1, 8, 8]``) to digit logits ``[B, 10]``."""

    def __init__(self, config: ClassifierConfig) -> None:
        super().__init__()
        self.config = config
        c1, c2 = config.channels
        self.net = nn.Sequential(
            nn.Conv2d(1, c1, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(c1, c2, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(c2 * (IMAGE_SIZE // 2) ** 2, config.hidden),
            nn.ReLU(),
            nn.Linear(config.hidden, config.num_classes),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)


# The generator's components for a loader that knows no task: [library (a module path), class] per sub-folder.
MODEL_INDEX_FILE = "model_index.json"
MODEL_INDEX: dict[str, list[str]] = {
    "transformer": ["diffusers", "SD3Transformer2DModel"],
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "prompt_encoder": ["tandem.tasks.digits.models", "DigitPromptEncoder"],
}

_CLASSIFIER_CONFIG = "config.json"
_CLASSIFIER_WEIGHTS = "model.safetensors"


def save_classifier(classifier: DigitClassifier, folder: Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / _CLASSIFIER_CONFIG).write_text(json.dumps(asdict(classifier.config), indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in classifier.state_dict().items()}, folder / _CLASSIFIER_WEIGHTS)


def load_classifier(folder: Path = CLASSIFIER_DIR) -> DigitClassifier:
    """The classifier saved in ``folder``, in eval mode."""
    raw = json.loads((folder / _CLASSIFIER_CONFIG).read_text())
    config = ClassifierConfig(channels=tuple(raw["channels"]), hidden=raw["hidden"], num_classes=raw["num_classes"])
    classifier = DigitClassifier(config)
    classifier.load_state_dict(load_file(folder / _CLASSIFIER_WEIGHTS))
    return classifier.eval()


@dataclass(slots=True)
class DigitGenerator:
    """What sampling needs: the velocity model, the prompt encoder and the schedule's config."""

    transformer: SD3Transformer2DModel
    prompt_encoder: DigitPromptEncoder
    scheduler: FlowMatchEulerDiscreteScheduler

    def save(self, folder: Path) -> None:
        """Three ``save_pretrained`` folders (``transformer/``, ``prompt_encoder/``, ``scheduler/``) and the
        ``model_index.json`` naming their classes, diffusers' pipeline layout that the diffusion engines load."""
        self.transformer.save_pretrained(folder / TRANSFORMER_DIR.name)
        self.prompt_encoder.save_pretrained(folder / PROMPT_ENCODER_DIR.name)
        self.scheduler.save_pretrained(folder / SCHEDULER_DIR.name)
        (folder / MODEL_INDEX_FILE).write_text(json.dumps(MODEL_INDEX, indent=2) + "\n")


def load_generator(folder: Path = MODEL_DIR) -> DigitGenerator:
    """The generator saved in ``folder`` (the shipped one by default), in eval mode, float32."""
    # low_cpu_mem_usage=False: the default asks for `accelerate` (and warns without it), pointless at 4 MB.
    return DigitGenerator(
        transformer=SD3Transformer2DModel.from_pretrained(folder / TRANSFORMER_DIR.name, low_cpu_mem_usage=False).eval(),
        prompt_encoder=DigitPromptEncoder.from_pretrained(folder / PROMPT_ENCODER_DIR.name, low_cpu_mem_usage=False).eval(),
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(folder / SCHEDULER_DIR.name),
    )
