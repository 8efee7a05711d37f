"""The task's images: scikit-learn's 8×8 handwritten digits, scaled to [-1, 1], in a fixed split.

Owns the one train / held-out split every part of the task uses (the classifier trains on
``train`` and reports its accuracy on ``heldout``; the generator trains on ``train`` only), and
the pixel scaling between the dataset's 0–16 ink levels and the generator's [-1, 1] latents.
The split is stratified and seeded, so it is the same on every machine and run.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

__all__ = [
    "HELDOUT_FRACTION",
    "SPLIT_SEED",
    "Split",
    "load_split",
]

Split = Literal["train", "heldout"]
HELDOUT_FRACTION = 0.2
SPLIT_SEED = 0
_MAX_INK = 16.0  # load_digits' pixel values are ink counts 0..16


def load_split(split: Split) -> tuple[np.ndarray, np.ndarray]:
    """``(images, labels)`` of one split: float32 ``[N, 8, 8]`` in [-1, 1] (-1 blank, 1 full ink), int64 ``[N]``."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    digits = load_digits()
    train_x, heldout_x, train_y, heldout_y = train_test_split(
        digits.images, digits.target, test_size=HELDOUT_FRACTION, random_state=SPLIT_SEED, stratify=digits.target
    )
    images, labels = (train_x, train_y) if split == "train" else (heldout_x, heldout_y)
    return (images / (_MAX_INK / 2) - 1.0).astype(np.float32), labels.astype(np.int64)
