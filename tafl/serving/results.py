"""What a model's outputs say about one decoded frame, as the service's JSON answers it: the one function the
REST routes, the Open Inference Protocol's callers (through the same outputs), the page and the DICOM listener
share (docs/design.md, "The image path and the service"). Pure: no request, no service state."""

from __future__ import annotations

from typing import Any

import numpy as np

from tafl.packaging.package import ModelPackage

OVERLAY_MAX_SIDE = 1024  # the longest side of the frame a heatmap overlay is drawn on (PNG and secondary capture)


def frame_result(package: ModelPackage, out: dict[str, np.ndarray], i: int, posteriors: bool = False) -> dict[str, Any]:
    """Row `i` of the graph's outputs `out`: label, class name, probability, every class's probability, each
    expert's vote (ensembles) and, with `posteriors`, the calibrated probabilities under the request's prior."""
    names = package.class_names
    label = int(out["label"][i])
    probs = out["probs"][i]
    res: dict[str, Any] = {"label": label, "class_name": names[label], "probability": float(probs[label]),
                           "probabilities": {n: float(p) for n, p in zip(names, probs)}}
    experts = []
    if "expert_labels" in out:
        for e, ename in enumerate(package.expert_names):
            el = int(out["expert_labels"][i, e])
            experts.append({"name": ename, "label": el, "class_name": names[el],
                            "probability": float(out["expert_probs"][i, e, el])})
        res["votes"] = {n: float(v) for n, v in zip(names, out["votes"][i])}
    res["experts"] = experts
    if posteriors and "calibrated_probs" in out:  # under the request's prior (prior=train: the source prior)
        res["calibrated_probabilities"] = {n: float(p) for n, p in zip(names, out["calibrated_probs"][i])}
    verdict = domain_verdict(package, out, i)
    if verdict is not None:
        res["domain"] = verdict
    return res


def domain_verdict(package: ModelPackage, out: dict[str, np.ndarray], i: int) -> dict[str, Any] | None:
    """The learned in-domain detector's verdict on row `i` (docs/design.md, "The input domain"): its distance, the
    package's threshold, in or out, and why; None for a package without a detector."""
    det = package.meta.domain.detector
    threshold = det.threshold
    if threshold is None or "domain_distance" not in out:
        return None
    d = float(out["domain_distance"][i])
    inside = d <= threshold
    keep = det.keep
    why = (f"its features lie {'within' if inside else 'beyond'} the distance that keeps {100 * keep:.0f}% of the "
           f"model's validation images ({d:.1f} {'≤' if inside else '>'} {threshold:.1f})")
    return {"in_domain": inside, "distance": d, "threshold": threshold, "reason": why}


def overlay_frame(frame: np.ndarray, max_side: int = OVERLAY_MAX_SIDE) -> np.ndarray:
    """The frame a heatmap overlay is drawn on: at most `max_side` pixels a side."""
    h, w = frame.shape[:2]
    if max(h, w) <= max_side:
        return frame
    from PIL import Image

    s = max_side / max(h, w)
    return np.asarray(Image.fromarray(frame).resize((max(1, int(w * s)), max(1, int(h * s)))))


def overlay_png(frame: np.ndarray, heat: np.ndarray) -> bytes:
    """The heatmap over the frame, as PNG bytes."""
    from tafl.imaging.heatmap import overlay, png_bytes

    return png_bytes(overlay(overlay_frame(frame), heat))
