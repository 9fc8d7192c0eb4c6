"""The one preprocessing callable shared by training, export and serving.

An image (a decoded uint8 frame, any array, or a PIL image; grey or colour, any size) becomes a
uint8 array of the model's side and channel count (`to_uint8`), and a uint8 batch becomes the normalised float
batch the network takes (`normalize`). Training stores its data after `to_uint8` and normalises
each batch with the same formula; the model package records the spec in `metadata.json` and the
service calls this code, so no component re-implements it. NumPy and Pillow only: serving must
run without torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from PIL import Image

from tafl.imaging.pixels import minmax_u8, pil_to_uint8

_RESAMPLE = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC,
             "nearest": Image.Resampling.NEAREST}


@dataclass(frozen=True)
class Preprocess:
    size: int  # square side the network takes, pixels
    channels: int  # 1 (grey) or 3 (RGB)
    mean: tuple[float, ...]  # per channel, on the [0, 1] scale
    std: tuple[float, ...]  # per channel, on the [0, 1] scale
    resample: str = "bilinear"  # Pillow filter; antialiased when shrinking
    resize: str = "squash"  # the whole image is resized to size x size (aspect ratio not kept)

    def __post_init__(self) -> None:
        if self.channels not in (1, 3):
            raise ValueError(f"channels must be 1 or 3, got {self.channels!r}")
        if len(self.mean) != self.channels or len(self.std) != self.channels:
            raise ValueError(f"mean {self.mean} and std {self.std} must have {self.channels} entries")
        if any(s <= 0 for s in self.std):
            raise ValueError(f"std must be positive, got {self.std}")
        if self.resample not in _RESAMPLE:
            raise ValueError(f"resample must be one of {sorted(_RESAMPLE)}, got {self.resample!r}")

    # -- image -> uint8 (size, size, channels) --
    def to_uint8(self, image: Image.Image | np.ndarray) -> np.ndarray:
        """Alpha is composited on black and deeper-than-8-bit grey is min-max stretched (tafl.imaging.pixels),
        exactly as the decoder does for files, then grey/RGB conversion and the resize."""
        frame = pil_to_uint8(image) if isinstance(image, Image.Image) else _array_to_uint8(image)
        pil = Image.fromarray(frame, "L" if frame.ndim == 2 else "RGB")
        mode = "L" if self.channels == 1 else "RGB"
        if pil.mode != mode:
            pil = pil.convert(mode)
        if pil.size != (self.size, self.size):
            pil = pil.resize((self.size, self.size), _RESAMPLE[self.resample])
        arr = np.asarray(pil, dtype=np.uint8)
        return arr[:, :, None] if arr.ndim == 2 else arr  # (H, W, C)

    # -- uint8 batch (N, H, W, C) -> float32 (N, C, H, W) --
    def normalize(self, batch: np.ndarray) -> np.ndarray:
        if batch.ndim == 3:
            batch = batch[None]
        mean = np.asarray(self.mean, np.float32).reshape(1, -1, 1, 1)
        std = np.asarray(self.std, np.float32).reshape(1, -1, 1, 1)
        x = np.ascontiguousarray(batch.transpose(0, 3, 1, 2), dtype=np.float32)
        x /= np.float32(255.0)
        x -= mean
        x /= std  # in place: the same operations and rounding as (x / 255 - mean) / std, two fewer copies
        return x

    def __call__(self, images: list[Image.Image | np.ndarray] | Image.Image | np.ndarray) -> np.ndarray:
        if not isinstance(images, list):
            images = [images]
        return self.normalize(np.stack([self.to_uint8(im) for im in images]))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["mean"], d["std"] = list(self.mean), list(self.std)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Preprocess:
        return cls(size=int(d["size"]), channels=int(d["channels"]), mean=tuple(float(v) for v in d["mean"]),
                   std=tuple(float(v) for v in d["std"]), resample=d.get("resample", "bilinear"),
                   resize=d.get("resize", "squash"))


def _array_to_uint8(a: np.ndarray) -> np.ndarray:
    """An image array becomes uint8 (H, W) grey or (H, W, 3) RGB: non-uint8 values are min-max stretched,
    a fourth (alpha) channel is composited on black."""
    a = np.asarray(a)
    if a.ndim == 3 and a.shape[2] == 1:
        a = a[:, :, 0]
    if not (a.ndim == 2 or (a.ndim == 3 and a.shape[2] in (3, 4))):
        raise ValueError(f"expected an image array of shape (H, W), (H, W, 1), (H, W, 3) or (H, W, 4), got {a.shape}")
    if a.dtype != np.uint8:
        a = minmax_u8(a)
    if a.ndim == 3 and a.shape[2] == 4:
        return pil_to_uint8(Image.fromarray(a, "RGBA"))
    return a
