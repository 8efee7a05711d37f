"""Draw the digit d: class-conditional image generation on scikit-learn's 8×8 handwritten digits.

The public face of the task, so other code never hard-codes paths or formats: the task plugin
(``make_task``, found by ``task.name: digits``, in :mod:`tasks.digits.task`), the prompt
format and its parser, the image geometry, and the folders of what ships in ``model/`` (a
diffusers ``SD3Transformer2DModel``, its ``FlowMatchEulerDiscreteScheduler`` config, the
prompt encoder and the digit classifier that scores samples). Load them with
:mod:`tasks.digits.models`; score images with :mod:`tasks.digits.reward`.

Importing this package pulls in neither torch, diffusers nor scikit-learn, so configs and
reward routing stay light; the data, model, sampling and reward modules import them.
"""

from __future__ import annotations

import re
from pathlib import Path

MODEL_DIR: Path = Path(__file__).resolve().parent / "model"
TRANSFORMER_DIR: Path = MODEL_DIR / "transformer"  # SD3Transformer2DModel.from_pretrained
SCHEDULER_DIR: Path = MODEL_DIR / "scheduler"  # FlowMatchEulerDiscreteScheduler.from_pretrained
PROMPT_ENCODER_DIR: Path = MODEL_DIR / "prompt_encoder"  # DigitPromptEncoder.from_pretrained
CLASSIFIER_DIR: Path = MODEL_DIR / "classifier"  # load_classifier
PRETRAIN_METRICS_PATH: Path = MODEL_DIR / "pretrain_metrics.json"

NUM_DIGITS = 10
# The prompt encoder's row for the empty prompt: the unconditional branch of classifier-free guidance.
UNCONDITIONAL_INDEX = NUM_DIGITS
IMAGE_SIZE = 8  # pixels per side; the images are the generator's latents (1 channel, no VAE), in [-1, 1]

_PROMPT = re.compile(r"draw the digit ([0-9])")


def format_prompt(digit: int) -> str:
    """The prompt asking for ``digit``: ``"draw the digit 3"``."""
    if not 0 <= digit < NUM_DIGITS:
        raise ValueError(f"digit must be in [0, {NUM_DIGITS - 1}], got {digit}")
    return f"draw the digit {digit}"


def parse_prompt(prompt: str) -> int:
    """The digit a prompt asks for (the label the reward checks); ValueError for any other text."""
    match = _PROMPT.fullmatch(prompt.strip())
    if match is None:
        raise ValueError(f"not a digits prompt: {prompt!r} (expected 'draw the digit d')")
    return int(match.group(1))


# The task plugin (``task.name: digits``); imported last, as it reads the constants above.
from tandem.tasks.digits.task import DigitsTask, make_task  # noqa: E402

__all__ = [
    "CLASSIFIER_DIR",
    "IMAGE_SIZE",
    "MODEL_DIR",
    "NUM_DIGITS",
    "PRETRAIN_METRICS_PATH",
    "PROMPT_ENCODER_DIR",
    "SCHEDULER_DIR",
    "TRANSFORMER_DIR",
    "UNCONDITIONAL_INDEX",
    "DigitsTask",
    "format_prompt",
    "make_task",
    "parse_prompt",
]
