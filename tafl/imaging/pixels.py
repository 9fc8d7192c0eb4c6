"""Pixel conversions every reader uses: one min-max stretch and one Pillow-mode-to-uint8 rule."""

from __future__ import annotations

import numpy as np
from PIL import Image


def minmax_u8(values: np.ndarray) -> np.ndarray:
    """Stretch [min, max] to [0, 255]; a constant (or all-NaN) image becomes zeros; NaN and ±inf count as 0."""
    values = np.nan_to_num(np.asarray(values, dtype=np.float32), nan=0.0, posinf=0.0, neginf=0.0)
    lo, hi = float(values.min()), float(values.max())
    if hi <= lo:
        return np.zeros(values.shape, dtype=np.uint8)
    return np.clip(np.rint((values - lo) * (255.0 / (hi - lo))), 0, 255).astype(np.uint8)


def pil_to_uint8(im: Image.Image) -> np.ndarray:
    """Any Pillow mode becomes uint8 grey (H, W) or RGB (H, W, 3); alpha is composited on black,
    16/32-bit grey and float are min-max stretched."""
    mode = im.mode
    if mode in ("1", "L"):
        return np.asarray(im.convert("L"), dtype=np.uint8)
    if mode.startswith("I") or mode == "F":
        return minmax_u8(np.asarray(im).astype(np.float32))
    if mode in ("LA", "La"):
        arr = np.asarray(im.convert("LA"), dtype=np.float64)
        return np.rint(arr[..., 0] * arr[..., 1] / 255.0).astype(np.uint8)
    if mode == "RGB":
        return np.asarray(im, dtype=np.uint8)
    # P, PA, RGBA, RGBa, CMYK, YCbCr, LAB, HSV, ...: through RGBA, then onto black.
    arr = np.asarray(im.convert("RGBA"), dtype=np.float64)
    return np.rint(arr[..., :3] * arr[..., 3:4] / 255.0).astype(np.uint8)
