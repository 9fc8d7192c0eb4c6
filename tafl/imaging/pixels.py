"""Pixel conversions every reader uses: one min-max stretch and one Pillow-mode-to-uint8 rule.

Both work in uint8 / uint16 / float32 and in bounded chunks of rows, never in float64 over a whole
image: a 7000×7000 image costs its own size and a few MB of temporaries, not gigabytes.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

_CHUNK_PIXELS = 1 << 20  # temporaries are bounded to this many pixels at a time


def minmax_u8(values: np.ndarray, *, overwrite: bool = False) -> np.ndarray:
    """Stretch [min, max] to [0, 255]; a constant (or all-NaN) image becomes zeros; NaN and ±inf count as 0.

    One float32 copy of the input (none with `overwrite`, when `values` is a float32 array the caller
    gives up), then in-place arithmetic: the same numbers as the out-of-place formula."""
    if overwrite and isinstance(values, np.ndarray) and values.dtype == np.float32:
        work = values
    else:
        work = np.array(values, dtype=np.float32, copy=True)
    np.nan_to_num(work, copy=False, nan=0.0, posinf=0.0, neginf=0.0)
    lo, hi = float(work.min()), float(work.max())
    if hi <= lo:
        return np.zeros(work.shape, dtype=np.uint8)
    work -= lo
    work *= 255.0 / (hi - lo)
    np.rint(work, out=work)
    np.clip(work, 0, 255, out=work)
    return work.astype(np.uint8)


def _onto_black(colour: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """round(colour × alpha / 255) in uint16, row chunk by row chunk (exact: a product over 255 is never
    a half, so (c·a + 127) // 255 is the float formula's rounding)."""
    out = np.empty(colour.shape, dtype=np.uint8)
    row_px = int(np.prod(colour.shape[1:])) or 1
    step = max(1, _CHUNK_PIXELS // row_px)
    for r in range(0, colour.shape[0], step):
        tmp = colour[r:r + step].astype(np.uint16)
        tmp *= alpha[r:r + step] if alpha.ndim == tmp.ndim else alpha[r:r + step, ..., None]
        tmp += 127
        tmp //= 255
        out[r:r + step] = tmp
    return out


def _palette_rgb(im: Image.Image) -> np.ndarray:
    """A 'P' image through its palette (and transparency) onto black: a 256-entry table, then indexing."""
    table = Image.new("P", (256, 1))
    table.putdata(list(range(256)))
    mode = im.palette.mode if im.palette.mode in ("RGB", "RGBA") else "RGB"
    table.putpalette(im.getpalette(mode), mode)
    if "transparency" in im.info:
        table.info["transparency"] = im.info["transparency"]
    rgba = np.asarray(table.convert("RGBA"), dtype=np.uint8)[0]
    lut = _onto_black(rgba[np.newaxis, :, :3], rgba[np.newaxis, :, 3])[0]
    return lut[np.asarray(im, dtype=np.uint8)]


def pil_to_uint8(im: Image.Image) -> np.ndarray:
    """Any Pillow mode becomes uint8 grey (H, W) or RGB (H, W, 3); alpha is composited on black,
    16/32-bit grey and float are min-max stretched."""
    mode = im.mode
    if mode in ("1", "L"):
        return np.asarray(im.convert("L") if mode == "1" else im, dtype=np.uint8)
    if mode.startswith("I") or mode == "F":
        return minmax_u8(np.asarray(im).astype(np.float32))
    if mode in ("LA", "La"):
        arr = np.asarray(im.convert("LA"), dtype=np.uint8)
        return _onto_black(arr[..., 0], arr[..., 1])
    if mode == "RGB":
        return np.asarray(im, dtype=np.uint8)
    if mode == "P" and im.palette is not None:
        try:
            return _palette_rgb(im)
        except Exception:  # noqa: BLE001, S110 - an unusual palette: Pillow's own conversion below
            pass
    # PA, RGBA, RGBa, CMYK, YCbCr, LAB, HSV, ...: through RGBA, then onto black.
    arr = np.asarray(im.convert("RGBA"), dtype=np.uint8)
    return _onto_black(arr[..., :3], arr[..., 3])
