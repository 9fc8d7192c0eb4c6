"""Heatmap overlays as images (NumPy and Pillow only, shared by `tafl explain` and the service).

A map in [0, 1] at any resolution is resized to the image, coloured with a jet-like colour map
and blended over the image.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def jet(v: np.ndarray) -> np.ndarray:
    """Jet colour map: v in [0, 1] (H, W) -> uint8 (H, W, 3)."""
    v = np.clip(v, 0.0, 1.0)
    r = np.clip(1.5 - np.abs(4 * v - 3), 0, 1)
    g = np.clip(1.5 - np.abs(4 * v - 2), 0, 1)
    b = np.clip(1.5 - np.abs(4 * v - 1), 0, 1)
    return (np.stack([r, g, b], axis=-1) * 255).astype(np.uint8)


def overlay(image: np.ndarray, heat: np.ndarray, alpha: float = 0.45) -> np.ndarray:
    """Blend a heatmap (h, w) in [0, 1] over an image (H, W[, C]) uint8 -> (H, W, 3) uint8."""
    img = np.asarray(image)
    if img.ndim == 2:
        img = np.repeat(img[:, :, None], 3, axis=2)
    elif img.shape[2] == 1:
        img = np.repeat(img, 3, axis=2)
    elif img.shape[2] == 4:
        img = img[:, :, :3]
    h, w = img.shape[:2]
    heat = np.nan_to_num(np.asarray(heat, np.float32), nan=0.0)
    resized = np.asarray(Image.fromarray(heat).resize((w, h), Image.Resampling.BILINEAR))
    colour = jet(resized).astype(np.float32)
    out = (1 - alpha) * img.astype(np.float32) + alpha * colour
    return np.clip(out, 0, 255).astype(np.uint8)


def png_bytes(rgb: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()
