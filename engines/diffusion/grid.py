"""Pictures of generated images: a grid per held-out evaluation, so change across versions is visible.

Pure image arithmetic over numpy arrays plus one PNG write (Pillow, which matplotlib already
brings with the ``torch`` extra). Images are ``[C, H, W]`` float in [-1, 1] (values outside
are clipped), one or three channels; tiles are scaled up by whole pixels (nearest neighbour)
so an 8×8 digit stays crisp.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["image_grid", "write_grid"]

_GAP = 2  # pixels between tiles
_MIN_TILE = 64  # tiles are scaled up to at least this many pixels per side


def image_grid(images: Sequence[np.ndarray], columns: int) -> np.ndarray:
    """The images tiled row-major, ``columns`` per row, as uint8 ``[H, W]`` (grey) or ``[H, W, 3]``."""
    if not images:
        raise ValueError("no images to tile")
    channels, height, width = images[0].shape
    if channels not in (1, 3) or any(image.shape != images[0].shape for image in images):
        raise ValueError(f"images must all be [1 or 3, H, W] of one shape, got {sorted({i.shape for i in images})}")
    scale = max(1, math.ceil(_MIN_TILE / max(height, width)))
    tile_h, tile_w = height * scale, width * scale
    rows = math.ceil(len(images) / columns)
    canvas = np.full((rows * (tile_h + _GAP) - _GAP, columns * (tile_w + _GAP) - _GAP, channels), 255, dtype=np.uint8)
    for i, image in enumerate(images):
        pixels = np.round((np.clip(image, -1.0, 1.0) + 1.0) * 127.5).astype(np.uint8).transpose(1, 2, 0)
        tile = pixels.repeat(scale, axis=0).repeat(scale, axis=1)
        top, left = (i // columns) * (tile_h + _GAP), (i % columns) * (tile_w + _GAP)
        canvas[top : top + tile_h, left : left + tile_w] = tile
    return canvas[..., 0] if channels == 1 else canvas


def write_grid(images: Sequence[np.ndarray], columns: int, path: Path) -> None:
    """Write :func:`image_grid` as a PNG (the folder is created)."""
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image_grid(images, columns)).save(path)
