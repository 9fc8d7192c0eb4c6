"""What the in-domain detector is measured against in every training report (docs/design.md, "The input domain"):
far-out-of-domain image sets built on any machine, and the detection metrics.

The far sets are images a model of this kind must never answer: real DICOM instances of other modalities (pydicom's
public test files, decoded by the service's own decoder, so a CT or MR slice reaches the model exactly as a
mis-routed study would), scikit-image's sample photographs (random crops), another dataset's images (scikit-learn's
handwritten digits; for a digits model, the medical images of `other_images`), uniform noise and constant frames.
Each is fitted to the model's input exactly as the service fits an upload (`Preprocess.to_uint8`).

The metrics follow pytorch-ood's `OODMetrics` (tests/training/test_detector.py checks them against it): the outlier
score is larger for out-of-domain images, out-of-domain images are the positive class; AUROC, and the false positive
rate (in-domain images flagged) at the threshold where 95 % of the out-of-domain images are flagged. Beside them the
operational number: the share of a set's images the package's own threshold lets through.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from tafl.imaging import Preprocess

log = logging.getLogger(__name__)

# scikit-image's sample photographs that are not medical images (retina, immunohistochemistry, microaneurysms are)
PHOTOS = ("astronaut", "camera", "cat", "coffee", "coins", "horse", "moon", "page", "rocket", "text", "grass", "gravel",
          "brick", "colorwheel", "hubble_deep_field", "logo", "clock")
CROPS_PER_PHOTO = 12
NOISE_IMAGES = 200
CONSTANT_IMAGES = 32


def _fit(images: Iterable[np.ndarray], size: int, channels: int) -> np.ndarray:
    pre = Preprocess(size=size, channels=channels, mean=(0.0,) * channels, std=(1.0,) * channels)
    out = [pre.to_uint8(im) for im in images]
    return np.stack(out) if out else np.zeros((0, size, size, channels), np.uint8)


def dicom_images(dirs: Iterable[Path] = ()) -> list[np.ndarray]:
    """The first frame of every DICOM image instance in pydicom's test files and `dirs`, as the service decodes it;
    instances it refuses (no pixels, unsupported transfer syntax) are left out."""
    from tafl.errors import TaflError
    from tafl.imaging import decode_image

    import pydicom.data

    # the files pydicom ships, read from its folder: its get_testdata_files would try to download more (seconds of
    # network timeouts on a machine without one, in every training report)
    files: list[Path] = sorted((Path(pydicom.data.__file__).parent / "test_files").glob("*.dcm"))
    for d in dirs:
        files += sorted(Path(d).glob("*.dcm"))
    seen, frames = set(), []
    for f in files:
        if f.name in seen:  # the same public file in both places
            continue
        seen.add(f.name)
        try:
            decoded = decode_image(f.read_bytes())
        except (TaflError, OSError):
            continue
        frames.append(decoded.frames[0])
    return frames


def photo_crops(seed: int, per_photo: int = CROPS_PER_PHOTO) -> list[np.ndarray]:
    """Random square crops (a quarter to all of the shorter side) of scikit-image's sample photographs."""
    import skimage.data

    rng = np.random.default_rng(seed)
    out = []
    for name in PHOTOS:
        try:
            im = np.asarray(getattr(skimage.data, name)())
        except Exception:  # noqa: BLE001 - a photo this scikit-image lacks or must download
            continue
        if im.ndim == 3 and im.shape[2] == 4:
            im = im[..., :3]
        if im.dtype != np.uint8:  # boolean or float photographs: scaled to 0-255
            f = im.astype(np.float64)
            im = (255 * (f - f.min()) / max(float(f.max() - f.min()), 1e-12)).astype(np.uint8)
        h, w = im.shape[:2]
        for _ in range(per_photo):
            side = int(rng.integers(min(h, w) // 4, min(h, w) + 1))
            y, x = int(rng.integers(0, h - side + 1)), int(rng.integers(0, w - side + 1))
            out.append(np.ascontiguousarray(im[y:y + side, x:x + side]))
    return out


def digit_images() -> list[np.ndarray]:
    from sklearn.datasets import load_digits

    from tafl.training.data import digits_u8

    return list(digits_u8(load_digits().images))


def far_sets(dataset: str, size: int, channels: int, seed: int, dicom_dirs: Iterable[Path] = (),
             other_images: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """name -> uint8 (N, size, size, channels) images. `other_images`: another dataset's images for a model trained
    on digits (without them a digits model has no 'other dataset' set)."""
    rng = np.random.default_rng(seed)
    sets: dict[str, np.ndarray] = {}
    sets["dicom"] = _fit(dicom_images(dicom_dirs), size, channels)
    sets["photos"] = _fit(photo_crops(seed), size, channels)
    if dataset.lower() != "digits":
        sets["digits"] = _fit(digit_images(), size, channels)
    elif other_images is not None and len(other_images):
        sets["other_dataset"] = _fit(list(other_images), size, channels)
    sets["noise"] = rng.integers(0, 256, (NOISE_IMAGES, size, size, channels), dtype=np.uint8)
    levels = np.linspace(0, 255, CONSTANT_IMAGES // 2).round()
    colours = rng.integers(0, 256, (CONSTANT_IMAGES - len(levels), channels))
    values = np.concatenate([np.repeat(levels[:, None], channels, 1), colours]).astype(np.uint8)
    sets["constant"] = np.broadcast_to(values[:, None, None, :], (len(values), size, size, channels)).copy()
    return {k: v for k, v in sets.items() if len(v)}


def detection(in_scores: np.ndarray, out_scores: np.ndarray, threshold: float | None = None) -> dict[str, Any]:
    """AUROC and FPR at 95 % TPR (out-of-domain positive, larger score = more out of domain: pytorch-ood's
    convention), and with a `threshold` the share of out-of-domain images it accepts (score ≤ threshold)."""
    from sklearn.metrics import roc_auc_score, roc_curve

    s_in, s_out = np.asarray(in_scores, np.float64), np.asarray(out_scores, np.float64)
    y = np.r_[np.zeros(len(s_in)), np.ones(len(s_out))]
    s = np.r_[s_in, s_out]
    fpr, tpr, _ = roc_curve(y, s, drop_intermediate=False)
    res: dict[str, Any] = {"images": int(len(s_out)), "auroc": float(roc_auc_score(y, s)),
                           "fpr95": float(fpr[np.searchsorted(tpr, 0.95, side="left")])}
    if threshold is not None:
        res["accepted"] = float((s_out <= threshold).mean())
    return res
