"""What a model's outputs say about one decoded frame, as the service's JSON answers it: the one function the
REST routes, the Open Inference Protocol's callers (through the same outputs), the page and the DICOM listener
share (docs/design.md, "The image path and the service"). Pure: no request, no service state."""

from __future__ import annotations

from typing import Any

import numpy as np

from tafl.packaging.domain import domain_verdict
from tafl.packaging.package import ModelPackage
from tafl.packaging.sets import set_answer

OVERLAY_MAX_SIDE = 1024  # the longest side of the frame a heatmap overlay is drawn on (PNG and secondary capture)


def frame_result(package: ModelPackage, out: dict[str, np.ndarray], i: int, posteriors: bool = False,
                 abstain: bool = True, coverage: float | None = None, site: str | None = None) -> dict[str, Any]:
    """Row `i` of the graph's outputs `out`: label, class name, probability, every class's probability, each
    expert's vote (ensembles) and, with `posteriors`, the calibrated probabilities under the request's prior; the
    in-domain verdict (`domain`) when the package has a detector, and `abstained`; the conformal prediction set
    (`prediction_set`, at `coverage`, None: the export's level; with `site`, from that training site's own
    thresholds) when the package has sets; an image outside the model's domain gets none (null).

    An image outside the model's domain gets no finding: with `abstain` (the default) the answer has no label,
    class, probability or votes, only the verdict and its reason; without it (a request's `abstain=false`) the
    label comes back marked by `outside_domain_note`, never to be filed as a finding."""
    verdict = domain_verdict(package.meta, out, i)
    outside = verdict is not None and not verdict["in_domain"]
    if outside and abstain:
        return {"abstained": True, "label": None, "class_name": None, "probability": None, "probabilities": None,
                "experts": [], "domain": verdict, **({"prediction_set": None} if package.meta.sets.fitted else {}),
                "reason": f"the model abstained: the image lies outside its domain ({verdict['reason']})"}
    names = package.class_names
    label = int(out["label"][i])
    probs = out["probs"][i]
    res: dict[str, Any] = {"abstained": False, "label": label, "class_name": names[label],
                           "probability": float(probs[label]),
                           "probabilities": {n: float(p) for n, p in zip(names, probs)}}
    experts = []
    if "expert_labels" in out:
        for e, ename in enumerate(package.expert_names):
            el = int(out["expert_labels"][i, e])
            experts.append({"name": ename, "label": el, "class_name": names[el],
                            "probability": float(out["expert_probs"][i, e, el])})
        res["votes"] = {n: float(v) for n, v in zip(names, out["votes"][i])}
    res["experts"] = experts
    if package.meta.sets.fitted:  # no set outside the domain: the guarantee is for images like the calibration's
        res["prediction_set"] = None if outside else set_answer(package.meta, out, i, coverage, site)
    if posteriors and "calibrated_probs" in out:  # under the request's prior (prior=train: the source prior)
        res["calibrated_probabilities"] = {n: float(p) for n, p in zip(names, out["calibrated_probs"][i])}
    if verdict is not None:
        res["domain"] = verdict
    if outside:
        res["outside_domain_note"] = OUTSIDE_NOTE
    return res


OUTSIDE_NOTE = ("returned because the request asked for it (abstain=false): the image lies outside the model's "
                "domain, so this label is not a finding")


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
