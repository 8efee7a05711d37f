"""The digits task's rewards: plain functions of (images, digits) over numpy arrays, and their per-sample forms.

- :func:`ocr_reward`: the probability the shipped classifier gives the prompted digit (the
  task's OCR, as Flow-GRPO scores text rendering with an OCR model);
- :func:`ink_reward`: the share of the canvas covered in ink, an optional second reward in
  the spirit of DDPO's compressibility (Black et al. 2023, "Training Diffusion Models with
  Reinforcement Learning"): image statistics with no notion of the prompt; weight it
  negatively to prefer thin strokes.

Both take images ``[B, 8, 8]`` or ``[B, 1, 8, 8]`` in the generator's range ([-1, 1]; values
outside are clipped first, so a sample cannot score by leaving the pixel range) and digits
``[B]``, and return float64 ``[B]`` in [0, 1]. They are pure: the classifier is read once per
process and never changes.

The classifier's forward runs here in numpy, from the weights :mod:`tasks.digits.models`
saved (its ``DigitClassifier`` in torch computes the same numbers to float rounding): a
reward worker process then imports numpy and safetensors only and starts in well under a
second, where torch and diffusers took 20 s on a busy 2-core machine, longer than the reward
timeout, and a worker is started again after every judge that hangs.

:func:`ocr` and :func:`ink` are the same scores in the form a task's reward functions take
(``fn(response, answer, **context)``, see ``core.task``): ``response`` is one image as a numpy
array (the image workload's rendering of a trajectory, ``[1, 8, 8]``), ``answer`` the prompted
digit as text. A per-sample call rather than a batch one, because that is the seam every
workload's rewards share and what lets one bad sample fail alone; an image costs about 0.2 ms
to classify here, so batching would save nothing that matters beside the denoising.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view
from safetensors.numpy import load_file

from tandem.tasks.digits import CLASSIFIER_DIR, IMAGE_SIZE, NUM_DIGITS

__all__ = [
    "REWARDS",
    "ImageReward",
    "ink",
    "ink_reward",
    "ocr",
    "ocr_reward",
]

ImageReward = Callable[[np.ndarray, Sequence[int] | np.ndarray], np.ndarray]


@cache
def _weights() -> dict[str, np.ndarray]:
    """The shipped classifier's tensors by ``DigitClassifier.net`` position (``net.0.weight``...)."""
    return load_file(CLASSIFIER_DIR / "model.safetensors")


def _conv3x3(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """``Conv2d(kernel 3, padding 1)``: ``[B, C, H, W] -> [B, O, H, W]``."""
    windows = sliding_window_view(np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1))), (3, 3), axis=(2, 3))
    return np.einsum("bchwij,ocij->bohw", windows, weight, optimize=True) + bias[None, :, None, None]


def _logits(images: np.ndarray) -> np.ndarray:
    """``DigitClassifier``'s forward: conv-relu, conv-relu, max-pool 2, flatten, linear-relu, linear."""
    w = _weights()
    x = np.maximum(_conv3x3(images, w["net.0.weight"], w["net.0.bias"]), 0.0)
    x = np.maximum(_conv3x3(x, w["net.2.weight"], w["net.2.bias"]), 0.0)
    b, c, h, width = x.shape
    x = x.reshape(b, c, h // 2, 2, width // 2, 2).max(axis=(3, 5)).reshape(b, -1)
    x = np.maximum(x @ w["net.6.weight"].T + w["net.6.bias"], 0.0)
    return x @ w["net.8.weight"].T + w["net.8.bias"]


def _as_images(images: np.ndarray, digits: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Clipped float32 ``[B, 1, 8, 8]`` images and int64 ``[B]`` digits, checked against each other."""
    images = np.asarray(images, dtype=np.float32)
    if images.ndim == 3:
        images = images[:, None]
    if images.ndim != 4 or images.shape[1:] != (1, IMAGE_SIZE, IMAGE_SIZE):
        raise ValueError(f"images must be [B, 8, 8] or [B, 1, 8, 8], got shape {images.shape}")
    digits = np.asarray(digits, dtype=np.int64)
    if digits.shape != (images.shape[0],):
        raise ValueError(f"one digit per image: {images.shape[0]} images, digits of shape {digits.shape}")
    if digits.size and not (0 <= digits.min() and digits.max() < NUM_DIGITS):
        raise ValueError(f"digits must be in [0, {NUM_DIGITS - 1}], got {digits.tolist()}")
    return np.clip(images, -1.0, 1.0), digits


def ocr_reward(images: np.ndarray, digits: Sequence[int] | np.ndarray) -> np.ndarray:
    """Probability the classifier assigns to the prompted digit, per image: ``[B]`` in [0, 1]."""
    images, digits = _as_images(images, digits)
    logits = _logits(images).astype(np.float64)
    logits -= logits.max(axis=-1, keepdims=True)
    probs = np.exp(logits) / np.exp(logits).sum(axis=-1, keepdims=True)
    return probs[np.arange(len(digits)), digits]


def ink_reward(images: np.ndarray, digits: Sequence[int] | np.ndarray) -> np.ndarray:
    """Mean ink per image (0 blank canvas, 1 fully inked), whatever the digit: ``[B]`` in [0, 1]."""
    images, _ = _as_images(images, digits)
    return ((images.astype(np.float64) + 1.0) / 2.0).mean(axis=(1, 2, 3))


REWARDS: dict[str, ImageReward] = {"ocr": ocr_reward, "ink": ink_reward}


def _digit(answer: str | None) -> int:
    if answer is None or not answer.strip().isdigit():
        raise ValueError(f"the answer must be the prompted digit, got {answer!r}")
    return int(answer)


def ocr(response: np.ndarray, answer: str | None, meta: Mapping[str, Any] | None = None) -> float:
    """The classifier's probability of digit ``answer`` in the image ``response`` (``[1, 8, 8]`` or ``[8, 8]``).

    First spends ``meta["judge_cost_s"]`` seconds (0 when absent): the artificial cost of a slow
    judge, such as the served VLM judges of GeRL and MM-GRPO, so a benchmark can reproduce one.
    It is wall time, not compute (a served judge's compute happens elsewhere): in the reward
    pool it holds a worker, inline it holds the event loop, as an in-process judge holds its process.
    """
    cost = float((meta or {}).get("judge_cost_s", 0.0))
    if cost > 0:
        time.sleep(cost)
    return float(ocr_reward(np.asarray(response)[None], [_digit(answer)])[0])


def ink(response: np.ndarray, answer: str | None) -> float:
    """The inked share of the canvas of the image ``response``, whatever the digit."""
    return float(ink_reward(np.asarray(response)[None], [_digit(answer)])[0])
