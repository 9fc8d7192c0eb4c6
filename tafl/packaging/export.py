"""`tafl export`: a training checkpoint becomes a verified ONNX model package (docs/design.md, "The model package").

Graphs take a normalised float batch `image` (N, C, H, W) with a dynamic batch size; resizing
and normalising stay outside the graph and are recorded in metadata.json (the shared
`Preprocess`). GTAFL/CReFF graph outputs: `label` (voted class), `probs` (mean of the experts'),
`expert_labels`, `expert_probs`, `votes` and `heatmap`; the vote, its weights and the tie rule
are ONNX operators. Single-head graphs (ViT-DAFL, FedAvg, FedProx): `label`, `probs`, `logits`,
`heatmap`. The heatmap is the attention rollout when the extractor is a ViT and the class
activation map of the predicted class when it is a CNN, computed inside the graph.
Every export is checked with `onnx.checker` (full check) and against PyTorch eager in ONNX
Runtime on real images at batch sizes 1 and 16; a mismatch fails the export.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import tafl
from tafl.errors import ConfigError, PackageError
from tafl.packaging.card import render_card
from tafl.packaging.domain import resolve as resolve_domain
from tafl.packaging.domain import split_detector
from tafl.packaging.export_sets import DEFAULT_COVERAGE, SetsHead, check_coverage, sets_head, sets_spec
from tafl.packaging.metadata import (SCHEMA, AdaptiveCheck, Decision, Detector, Estimator, Expert, InputSpec,
                                     Metrics, OutputSpec, PackageMetadata, Parent, PreprocessSpec, PriorSpec, Privacy,
                                     Provenance, Sets, Training, Verification, Vote)
from tafl.packaging.package import ModelPackage, bump_minor, load_package, write_checksums
from tafl.packaging.sets import MASK, SCORES
from tafl.imaging import Preprocess
from tafl.training.ensemble import ExpertEnsemble, vote_weights
from tafl.training.explain import maps_to_image, install_taps, rollout_from, vit_grid
from tafl.training.models import Classifier, ModelConfig, PreNormTap, build_model

log = logging.getLogger(__name__)

PROB_TOL, HEAT_TOL = 1e-4, 1e-3
DIST_TOL = 1e-3  # the detector's distance, relative to itself (at least 1)
OPSET = 17


class _Features(nn.Module):
    """Shared extractor pass that also yields what the heatmap needs (CNN maps or ViT attention)."""

    def __init__(self, model: Classifier, is_vit: bool, size: int):
        super().__init__()
        self.extractor = model.extractor
        self.is_vit = is_vit
        self.size = (size, size)  # the input side is fixed by the model; only the batch is dynamic
        self.taps = install_taps(model.extractor) if is_vit else []
        self.domain: torch.Tensor | None = None  # the last forward's detector features (Classifier.domain_features)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if self.is_vit:
            for t in self.taps:
                t.maps, t.record = [], True
            with PreNormTap(self.extractor) as tap:
                feats = self.extractor(x)
            self.domain = tap.domain_features()
            attns = [t.maps[-1] for t in self.taps]
            for t in self.taps:
                t.maps, t.record = [], False
            return feats, attns
        maps = self.extractor.forward_maps(x)  # (B, D, h, w)
        feats = maps.mean(dim=(2, 3))
        self.domain = feats
        return feats, maps

    def heatmap(self, x: torch.Tensor, aux: Any, class_weight: torch.Tensor) -> torch.Tensor:
        """(B, H, W) in [0, 1]: rollout (ViT) or CAM with per-sample class weights (B, D) (CNN)."""
        size = self.size
        if self.is_vit:
            return rollout_from(aux, int(self.extractor.num_prefix_tokens), vit_grid(self.extractor), size)
        cam = torch.relu((class_weight[:, :, None, None] * aux).sum(dim=1))[:, None]
        return maps_to_image(cam, size)


class _PriorAdaptation(nn.Module):
    """The prior-aware outputs (tafl.prior): calibrated posteriors softmax(a·z + b + r) (a one scale, or one per
    class for vector scaling; z log-probabilities) for the graph's optional
    input r = `log_prior_ratio` (log q − log π per class; (1, C) for the whole batch or (N, C) per image;
    default zeros). Where a row of r is 0 the outputs are the model's plain ones; where it is not, `label` and
    `probs` are the Bayes rule for that row's prior q, so the vote and the probabilities a caller reads follow the
    prior it gave."""

    def __init__(self, calibration: dict[str, Any] | None, num_classes: int):
        super().__init__()
        calibration = calibration or {"scale": 1.0, "bias": [0.0] * num_classes}
        scale = float(calibration["scale"])
        class_scale = calibration.get("class_scale")
        scale = torch.tensor(scale) if class_scale is None else scale * torch.tensor(class_scale, dtype=torch.float64)
        self.register_buffer("scale", scale.to(torch.float32))
        self.register_buffer("bias", torch.tensor(calibration["bias"], dtype=torch.float32))

    def forward(self, z: torch.Tensor, r: torch.Tensor | None, label: torch.Tensor, probs: torch.Tensor):
        if r is None:
            r = torch.zeros_like(self.bias)[None]
        adapted = torch.softmax(z * self.scale + self.bias + r, dim=-1)
        shifted = r.abs().sum(dim=-1) > 0  # per row of r: one row for the batch, or one per image
        return (torch.where(shifted, adapted.argmax(dim=-1), label), torch.where(shifted[:, None], adapted, probs),
                adapted)

    def source(self, z: torch.Tensor) -> torch.Tensor:
        """The calibrated posteriors under the source prior, whatever the request's: what the sets are made of."""
        return torch.softmax(z * self.scale + self.bias, dim=-1)


class _DomainDistance(nn.Module):
    """The in-domain detector (tafl.training.detector) inside the graph: the squared Mahalanobis distance of the
    detector features to the nearest class mean under the shared precision P = L·Lᵀ, as ‖f·L − μ·L‖² (B,); where
    training matched the head's energy to it, the larger of that and the energy's distance equivalent
    exp(μ_L + σ_L (E − μ_E) / σ_E), E = −logsumexp of the head's logits on its input features."""

    def __init__(self, means: torch.Tensor, precision: torch.Tensor, head: nn.Linear | None = None,
                 match: dict[str, list[float]] | None = None):
        super().__init__()
        whiten = torch.linalg.cholesky(precision.double())  # P = L·Lᵀ
        self.register_buffer("whiten", whiten.to(torch.float32))
        self.register_buffer("centres", (means.double() @ whiten).to(torch.float32))
        self.energy = match is not None and head is not None
        if self.energy:
            from tafl.training.detector import ENERGY_CAP

            (mu_l, sd_l), (mu_e, sd_e) = match["log_distance"], match["energy"]
            self.register_buffer("head_weight", head.weight.detach().clone().float())
            self.register_buffer("head_bias", head.bias.detach().clone().float())
            self.slope, self.offset, self.cap = sd_l / sd_e, mu_l - sd_l * mu_e / sd_e, ENERGY_CAP

    def forward(self, feats: torch.Tensor, head_feats: torch.Tensor,
                logits: torch.Tensor | None = None) -> torch.Tensor:
        """`logits`: the head's on `head_feats` where the graph has them already (one matrix product fewer)."""
        g = feats @ self.whiten
        dist = ((g[:, None, :] - self.centres[None]) ** 2).sum(dim=-1).min(dim=1).values
        if not self.energy:
            return dist
        if logits is None:
            logits = head_feats @ self.head_weight.T + self.head_bias
        # offset + slope · E with E = −logsumexp: as few graph nodes as it takes (they cost at batch 1)
        lse = torch.logsumexp(logits, dim=1)
        return torch.maximum(dist, torch.exp(torch.clamp(self.offset - self.slope * lse, max=self.cap)))


def _detector(model: Classifier, extras: dict[str, Any], state_meta: dict[str, Any]) -> _DomainDistance | None:
    """The checkpoint's fitted detector as a graph module, or None (a run from before it, or one without)."""
    rec = state_meta.get("domain_detector") or {}
    if "domain.means" not in extras or not rec.get("fitted"):
        return None
    return _DomainDistance(extras["domain.means"], extras["domain.precision"], model.head, rec.get("energy_match"))


def _outputs(base: tuple[str, ...], detector: Any, sets: Any) -> tuple[str, ...]:
    """A graph instance's outputs: the class's, then the detector's distance, then the sets' scores and mask."""
    return (*base, *(("domain_distance",) if detector is not None else ()),
            *((SCORES, MASK) if sets is not None else ()))


class EnsembleGraph(nn.Module):
    outputs = ("label", "probs", "expert_labels", "expert_probs", "votes", "heatmap", "calibrated_probs")

    def __init__(self, model: Classifier, ensemble: ExpertEnsemble, is_vit: bool, size: int,
                 calibration: dict[str, Any] | None = None, source: int | None = None,
                 detector: _DomainDistance | None = None, sets: SetsHead | None = None):
        super().__init__()
        self.feats = _Features(model, is_vit, size)
        self.ensemble = ensemble
        self.prior = _PriorAdaptation(calibration, ensemble.W.shape[1])
        self.source = source  # the expert whose posteriors are calibrated, or None: the experts' mean log-prob
        self.detector, self.sets = detector, sets
        self.outputs = _outputs(type(self).outputs, detector, sets)

    def forward(self, image: torch.Tensor, log_prior_ratio: torch.Tensor | None = None):
        feats, aux = self.feats(image)
        logits = self.ensemble.expert_logits(feats)
        out = self.ensemble.vote_from(torch.softmax(logits, dim=-1))
        lp = torch.log_softmax(logits, dim=-1)
        z = lp.mean(dim=1) if self.source is None else lp[:, self.source]
        label, probs, calibrated = self.prior(z, log_prior_ratio, out["label"], out["probs"])
        w = self.ensemble.W.mean(dim=0)[label]  # (B, D): the experts' mean row of the decided class
        heat = self.feats.heatmap(image, aux, w)
        outs = (label, probs, out["expert_labels"], out["expert_probs"], out["votes"], heat, calibrated)
        if self.detector is not None:
            outs = (*outs, self.detector(self.feats.domain, feats))
        return outs if self.sets is None else (*outs, *self.sets(self.prior.source(z)))


class SingleHeadGraph(nn.Module):
    outputs = ("label", "probs", "logits", "heatmap", "calibrated_probs")

    def __init__(self, model: Classifier, is_vit: bool, size: int, calibration: dict[str, Any] | None = None,
                 offset: np.ndarray | None = None, detector: _DomainDistance | None = None,
                 sets: SetsHead | None = None):
        super().__init__()
        self.detector, self.sets = detector, sets
        self.outputs = _outputs(type(self).outputs, detector, sets)
        self.feats = _Features(model, is_vit, size)
        self.head = model.head
        self.prior = _PriorAdaptation(calibration, model.head.out_features)
        # the operating point (tafl.training.decision): the plain label is argmax(logits + offset)
        C = model.head.out_features
        self.register_buffer("offset", torch.zeros(C) if offset is None else
                             torch.as_tensor(np.asarray(offset), dtype=torch.float32))

    def forward(self, image: torch.Tensor, log_prior_ratio: torch.Tensor | None = None):
        feats, aux = self.feats(image)
        logits = self.head(feats)
        # log-probabilities, as in training's calibration (tafl.training.methods.base.posterior_logits): one scale
        # cannot tell them from the logits, per-class scales can
        z = torch.log_softmax(logits, dim=1)
        label, probs, calibrated = self.prior(z, log_prior_ratio, (logits + self.offset).argmax(dim=1),
                                              torch.softmax(logits, dim=1))
        heat = self.feats.heatmap(image, aux, self.head.weight[label])
        outs = (label, probs, logits, heat, calibrated)
        if self.detector is not None:
            outs = (*outs, self.detector(self.feats.domain, feats, logits))
        return outs if self.sets is None else (*outs, *self.sets(self.prior.source(z)))


def calibration_of(ck: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's calibration (tafl.prior) with its source prior and the posteriors it applies to; a model
    fitted without one gets the identity and the prior its plain posteriors describe (docs/decisions.md, "Prior-aware inference")."""
    from tafl.prior import Calibration

    state_meta, extras = ck["state"].get("meta", {}), ck["state"].get("extras", {})  # the checkpoint's, not a package's
    C = len(ck["class_names"])
    cal = Calibration.from_dict(state_meta.get("calibration"), C)
    ensemble = "expert.weight" in extras
    names = tuple(state_meta.get("experts") or ("uniform",)) if ensemble else ()
    use = ck["run_config"].get("calib_source", "experts")
    source_expert = names.index("uniform") if ensemble and (use == "uniform" or len(names) == 1) and \
        "uniform" in names else None
    if cal.source_prior is None:
        if ensemble:
            cal.source_prior = np.full(C, 1.0 / C)
        else:
            counts = np.asarray(ck["train_class_counts"], np.float64)
            cal.source_prior = counts / counts.sum()
    d = cal.to_dict()
    d["bias"] = d["bias"] or [0.0] * C
    d["posteriors"] = ("the uniform expert's log-probabilities" if source_expert is not None else
                       "the mean of the experts' log-probabilities") if ensemble else "the head's logits"
    d["source_expert"] = source_expert
    return d


def build_graph(ck: dict[str, Any], sets: dict[str, Any] | None = None
                ) -> tuple[nn.Module, tuple[Expert, ...], Vote | None]:
    """The export module for a checkpoint, its experts and its vote rule (none for a single head); `sets`: metadata
    `sets` (tafl.packaging.export_sets.sets_spec), whose fitted sets the graph answers."""
    calibration = calibration_of(ck)
    mcfg = ModelConfig.from_dict(ck["model_config"])
    model = build_model(mcfg).eval()
    state = ck["state"]
    model.load_state_dict(state["weights"])
    extras, state_meta = state.get("extras", {}), state.get("meta", {})
    if "expert.weight" in extras:
        names = tuple(state_meta.get("experts") or ("uniform",))
        ens = ExpertEnsemble(model.extractor, extras["expert.weight"], extras["expert.bias"], names,
                             state_meta.get("vote", "hard"), vote_weights(state_meta)).eval()
        experts = tuple(Expert(n, float(w)) for n, w in zip(names, ens.vote_weights.tolist()))
        soft = ens.vote in ("soft", "learned")
        vote = Vote(ens.vote, tuple(e.weight for e in experts),
                    "argmax of the weighted mean probability" if soft else
                    f"the {names[ens.tie_expert]} expert's class wins ties (a bonus of {ens.tie_bonus:g} on its vote)")
        graph: nn.Module = EnsembleGraph(model, ens, mcfg.is_vit, mcfg.img_size, calibration,
                                         calibration["source_expert"], _detector(model, extras, state_meta),
                                         sets_head(sets))
        graph.prior_spec = calibration
        return graph.eval(), experts, vote
    from tafl.training.decision import check_record

    try:
        offset = check_record(state_meta.get("decision"), mcfg.num_classes)
    except ValueError as exc:
        raise PackageError(f"the checkpoint's operating point cannot be exported: {exc}") from None
    graph = SingleHeadGraph(model, mcfg.is_vit, mcfg.img_size, calibration, offset,
                            _detector(model, extras, state_meta), sets_head(sets))
    graph.prior_spec = calibration
    return graph.eval(), (), None


def _sample_images(ck: dict[str, Any], images_dir: str | None, data_root: str | None, n: int = 16) -> np.ndarray:
    """16 real uint8 images at the model's size: from --images, or the run's validation split."""
    pre = Preprocess.from_dict(ck["preprocess"])
    if images_dir:
        from PIL import Image

        files = sorted(p for p in Path(images_dir).rglob("*") if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
        if not files:
            raise PackageError(f"--images {images_dir}: no PNG or JPEG files to verify the export on")
        arrs = []
        for f in (files * n)[:n]:
            with Image.open(f) as im:
                arrs.append(pre.to_uint8(im))
        return np.stack(arrs)
    from tafl.errors import DataError
    from tafl.training.config import RunConfig
    from tafl.training.data import load_dataset

    cfg = RunConfig.from_dict(ck["run_config"], "checkpoint run_config")
    if data_root:
        cfg.data_root = data_root
    cfg.img_size, cfg.channels = pre.size, pre.channels
    try:
        ds = load_dataset(cfg.validate())
    except DataError as exc:
        raise PackageError(f"export verifies the graph on real images, but the run's data is not available "
                           f"({exc.message}); pass --images DIR or --data-root DIR") from exc
    return np.concatenate([ds.val.images, ds.test.images])[:n] if len(ds.val) < n else ds.val.images[:n]


def verify(graph: nn.Module, onnx_path: Path, x: np.ndarray, names: tuple[str, ...],
           prior_ratio: np.ndarray | None = None) -> dict[str, Any]:
    """ORT (CPU) vs PyTorch eager at batch sizes 1 and 16, without the optional `log_prior_ratio` input (its
    default, zeros) and with `prior_ratio` fed (one row for the batch, and one row per image); raises
    PackageError on any mismatch."""
    import onnx
    import onnxruntime as ort

    try:
        onnx.checker.check_model(str(onnx_path), full_check=True)
    except onnx.checker.ValidationError as exc:
        raise PackageError(f"the exported graph fails onnx.checker: {exc}") from exc
    with _without_default_input_notice("log_prior_ratio"):
        sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    C = len(prior_ratio) if prior_ratio is not None else None
    worst = {"probs": 0.0, "heatmap": 0.0}
    cases: list[tuple[int, np.ndarray | None]] = [(1, None), (16, None)]
    if prior_ratio is not None:
        r = np.asarray(prior_ratio, np.float32).reshape(1, C)
        cases += [(1, r), (16, r), (16, np.tile(r, (16, 1)) * np.linspace(0, 1, 16, dtype=np.float32)[:, None])]
    for bs, r in cases:
        batch = x[:bs]
        fed = {"image": batch} if r is None else {"image": batch, "log_prior_ratio": r}
        r_ref = None if r is None else torch.from_numpy(r)
        with torch.no_grad():
            ref = dict(zip(names, (t.numpy() for t in graph(torch.from_numpy(batch), r_ref))))
        got = dict(zip(names, sess.run(list(names), fed)))
        what = f"batch {bs}" + ("" if r is None else f", log_prior_ratio of {len(r)} row(s)")
        for key in names:
            if got[key].shape != ref[key].shape:
                raise PackageError(f"export check failed: '{key}' has shape {got[key].shape} in ONNX Runtime, "
                                   f"{ref[key].shape} in PyTorch ({what})")
        for key in ("label", "expert_labels"):
            if key in names and not np.array_equal(got[key], ref[key]):
                raise PackageError(f"export check failed: '{key}' differs between ONNX Runtime and PyTorch ({what})")
        if "domain_distance" in names:  # relative: distances run from a few to thousands
            rel = float((np.abs(got["domain_distance"] - ref["domain_distance"]) /
                         np.maximum(np.abs(ref["domain_distance"]), 1.0)).max())
            worst["domain_distance"] = max(worst.get("domain_distance", 0.0), rel)
            if not rel <= DIST_TOL:
                raise PackageError(f"export check failed: 'domain_distance' differs by {rel:.2e} (relative) > "
                                   f"{DIST_TOL:g} ({what})")
        if MASK in names:  # a class may flip only where its score sits on its threshold
            t = graph.sets.thresholds.numpy()
            flip = got[MASK] != ref[MASK]
            if (flip & (np.abs(ref[SCORES] - t) > PROB_TOL)).any():
                raise PackageError(f"export check failed: '{MASK}' differs between ONNX Runtime and PyTorch ({what})")
        for key, tol in (("probs", PROB_TOL), (SCORES, PROB_TOL), ("expert_probs", PROB_TOL), ("calibrated_probs", PROB_TOL),
                         ("heatmap", HEAT_TOL)):
            if key in names:
                diff = float(np.abs(got[key] - ref[key]).max())
                kind = "heatmap" if key == "heatmap" else "probs"
                worst[kind] = max(worst[kind], diff)
                if not diff <= tol:
                    raise PackageError(f"export check failed: '{key}' differs by {diff:.2e} > {tol:g} ({what})")
    return {"batch_sizes": [1, 16], "log_prior_ratio_cases": ["default (zeros)"] +
            (["one row for the batch", "one row per image"] if prior_ratio is not None else []),
            "max_abs_prob_diff": worst["probs"], "max_abs_heatmap_diff": worst["heatmap"],
            **({"max_rel_domain_distance_diff": worst["domain_distance"], "domain_distance_tolerance": DIST_TOL}
               if "domain_distance" in worst else {}),
            "prob_tolerance": PROB_TOL, "heatmap_tolerance": HEAT_TOL, "onnx": onnx.__version__,
            "onnxruntime": ort.__version__, "opset": OPSET, "checker": "onnx.checker.check_model(full_check=True)"}


@contextlib.contextmanager
def _without_default_input_notice(name: str):
    """ONNX Runtime warns, on stderr, when it loads a graph whose input `name` has an initializer of the same
    name ("Initializer log_prior_ratio appears in graph inputs and will not be treated as constant ..."). That
    initializer is the input's default, the mechanism of the optional prior (docs/decisions.md), so every export
    printed a warning about nothing. This drops exactly that line of what ORT prints while the block runs;
    any other warning it gives passes through to stderr."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no stderr descriptor to redirect: leave ORT's output alone
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            notice = f"Initializer {name} appears in graph inputs"
            kept = [line for line in tmp.read().decode("utf-8", "replace").splitlines(keepends=True)
                    if notice not in line]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def _default_prior_input(onnx_path: Path, num_classes: int) -> None:
    """Give the graph input `log_prior_ratio` a default (an initializer of the same name, zeros (1, C)), so a
    caller that feeds only `image` sees the model's plain outputs."""
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(onnx_path))
    if not any(i.name == "log_prior_ratio" for i in m.graph.input):
        raise PackageError("the exported graph lost its 'log_prior_ratio' input")
    m.graph.initializer.append(numpy_helper.from_array(np.zeros((1, num_classes), np.float32), "log_prior_ratio"))
    onnx.save(m, str(onnx_path))


def _output_spec(names: tuple[str, ...], n_experts: int, num_classes: int, size: int) -> tuple[OutputSpec, ...]:
    desc = {
        "label": (["batch"], "int64", "the predicted class index (the vote's winner for an ensemble)"),
        "probs": (["batch", num_classes], "float32", "class probabilities (for an ensemble, the mean of the experts')"),
        "logits": (["batch", num_classes], "float32", "the head's logits"),
        "expert_labels": (["batch", n_experts], "int64", "each expert's argmax, in the order of metadata 'experts'"),
        "expert_probs": (["batch", n_experts, num_classes], "float32", "each expert's softmax"),
        "votes": (["batch", num_classes], "float32", "weighted vote totals per class (before the tie bonus)"),
        "heatmap": (["batch", size, size], "float32", "where the model looked, in [0, 1], at the input's resolution"),
        "calibrated_probs": (["batch", num_classes], "float32",
                             "calibrated posteriors under the prior of the optional input log_prior_ratio (zeros: "
                             "the source prior, metadata 'prior')"),
        "domain_distance": (["batch"], "float32",
                            "the in-domain detector's score: squared Mahalanobis distance of the image's features to "
                            "the nearest class mean (or, where larger, the head's energy score on that scale: "
                            "metadata domain.detector.kind); above domain.detector.threshold the image lies outside "
                            "what the model was trained on"),
        SCORES: (["batch", num_classes], "float32", "each class's conformal score 1 − p under the calibrated "
                 "source-prior posterior (whatever the request's prior): a class is in the set at level L where its "
                 "score is within metadata sets.levels[L]"),
        MASK: (["batch", num_classes], "bool", "the prediction set at the export's coverage (metadata "
               "sets.coverage): true for every class in it"),
    }
    return tuple(OutputSpec(n, tuple(desc[n][0]), desc[n][1], desc[n][2]) for n in names)


def _detector_spec(ck: dict[str, Any], ck_path: Path) -> dict[str, Any] | None:
    """The in-domain detector as training recorded it (tafl.training.detector), with the test split's refused share
    where the run's report measured it; None for a checkpoint from before the detector."""
    rec = (ck["state"].get("meta") or {}).get("domain_detector")
    if rec is None:
        return None
    out = {k: v for k, v in rec.items() if k not in ("classes", "clients")}
    rep = ck_path.parent / "report.json"
    measured = (json.loads(rep.read_text()).get("domain_detector") or {}) if rep.is_file() else {}
    test = measured.get("test")
    if rec.get("fitted") and test:
        out["test"] = {k: test[k] for k in ("images", "refused", "balanced_accuracy_all", "balanced_accuracy_accepted")
                       if k in test}
    if rec.get("fitted") and measured.get("detection"):  # the package's own score (a report before the energy: the
        # Mahalanobis distance, then the whole score)
        out["detection"] = {name: m.get("score", m.get("mahalanobis")) for name, m in measured["detection"].items()
                            if m.get("score", m.get("mahalanobis"))}
    return out


def _without_detector(ck: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint as export sees it with `--domain detector=off`: no detector in the graph, the metadata says
    why (the checkpoint on disk keeps its own)."""
    state = dict(ck["state"])
    state["extras"] = {k: v for k, v in (state.get("extras") or {}).items() if not k.startswith("domain.")}
    state["meta"] = dict(state.get("meta") or {}, domain_detector={
        "fitted": False, "why": "turned off at export (--domain detector=off)"})
    return dict(ck, state=state)


def _estimator_spec(ck: dict[str, Any]) -> dict[str, Any]:
    """How `prior=adaptive` estimates the case mix (tafl.prior.PriorEstimator): the run's choice, or, for a
    checkpoint from before it was recorded, the maximum-likelihood EM those runs were evaluated with."""
    from tafl.prior import PriorEstimator

    return PriorEstimator.from_dict((ck["state"].get("meta") or {}).get("prior_estimator")).to_dict()


def _adaptive_check(ck_path: Path) -> dict[str, Any] | None:
    """tafl.prior.adaptive_check of the run's validation split (report.json), or None without one."""
    from tafl.prior import adaptive_check, validation_average

    rep = ck_path.parent / "report.json"
    if not rep.is_file():
        return None
    return adaptive_check(validation_average(json.loads(rep.read_text())))


def _metrics_from(ck_path: Path) -> dict[str, Any] | None:
    rep = ck_path.parent / "report.json"
    if not rep.is_file():
        return None
    r = json.loads(rep.read_text())
    dists = r.get("test_distributions", {})
    return {"source": f"report.json of the training run ({r.get('dataset')} test split; prior-weighted accuracy, "
                      "docs/design.md §3)",
            "average_accuracy": r.get("average_accuracy"),
            "accuracy": {k: d.get("accuracy") for k, d in dists.items()},
            "sampled_accuracy": {k: d.get("sampled_accuracy") for k, d in dists.items()},
            "head_middle_tail": {k: {g: dists[k].get(g) for g in ("head", "middle", "tail")}
                                 for k in ("forward50", "uniform", "backward50") if k in dists},
            "uniform_metrics": {k: v for k, v in (r.get("uniform_metrics") or {}).items() if k != "per_class"},
            "per_class_accuracy": r.get("per_class_accuracy"),
            # the intervals' sizes (tafl.intervals): the test split's images, per class
            "test_class_counts": r.get("test_class_counts"),
            "validation": r.get("validation"),
            **({"sites": {name: {k: d.get(k) for k in ("n_test", "own", "adapted", "oracle")}
                          for name, d in r["sites"].items()},
                "site_mean": r.get("site_mean"), "pooled_balanced_accuracy": r.get("pooled_balanced_accuracy")}
               if r.get("sites") else {})}


def _limitations(ck: dict[str, Any], metrics: dict[str, Any] | None, is_vit: bool,
                 adaptive: dict[str, Any] | None = None) -> list[str]:
    cfg, names = ck["run_config"], ck["class_names"]
    out = [
        "Decision support for research and evaluation only; not a certified medical device and not for diagnosis "
        "without a clinician.",
        f"Trained on {ck.get('data_provenance', {}).get('n_train', '?')} images of '{cfg['dataset']}' resized "
        f"to {ck['preprocess']['size']}×{ck['preprocess']['size']} (aspect ratio not kept); images from other "
        "devices, sites or modalities may fall outside what it learned.",
        "Training was a federated simulation on one machine "
        f"({cfg['clients']} clients, Dirichlet α={cfg['alpha']}, {cfg['rounds']} rounds); real sites differ.",
        f"The heatmap is a {'attention rollout' if is_vit else 'class activation map'}: a hint of where the model "
        "looked, not a segmentation.",
    ]
    if metrics and metrics.get("per_class_accuracy"):
        weak = [f"{names[i]} ({100 * a:.0f}%)" for i, a in enumerate(metrics["per_class_accuracy"])
                if a is not None and a < 0.5]
        if weak:
            out.append("Classes recognised less than half the time on the test split: " + ", ".join(weak) + ".")
    if metrics is None:
        out.append("No evaluation report was found beside the checkpoint; metrics are not recorded.")
    dec = (ck["state"].get("meta") or {}).get("decision")
    if dec and dec.get("tau") and dec.get("kind") == "expert_shift":
        out.append(f"Every expert's scores were moved by the same −τ·log(training mix), τ {dec['tau']:.1f} chosen on "
                   "validation for the vote's balanced F1: the experts keep their forward/uniform/backward order, "
                   "and their probabilities carry the move.")
    elif dec and dec.get("tau"):
        out.append(f"The label is decided at an operating point chosen on validation (logit adjustment, τ "
                   f"{dec['tau']:.1f}): rarer classes are called more often than the argmax of the probabilities "
                   "would, trading their precision for recall. The probabilities are the model's own.")
    if adaptive and not adaptive.get("recommended", True):
        out.append("prior=adaptive is off for this model (it keeps the training prior): " + adaptive["why"] + ".")
    return out


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, name: str | None = None,
                      parent: str | Path | None = None, images: str | None = None, data_root: str | None = None,
                      force: bool = False, to_bentoml: str | None = None,
                      sign_key: str | Path | None = None, class_codes: str | Path | None = None,
                      domain: list[str] | tuple[str, ...] = (), coverage: float = DEFAULT_COVERAGE) -> ModelPackage:
    """`sign_key`: an Ed25519 private key (PEM path, `tafl keys new`) that signs SHA256SUMS; None reads
    TAFL_SIGNING_KEY (unset: the package is unsigned). `class_codes`: a JSON file mapping class names to codes
    ({"melanoma": {"value": "372244006", "scheme": "SCT", "meaning": "Malignant melanoma"}}), recorded as
    metadata `class_codes` for DICOM SRs (tafl.imaging.dicom_sr); a class without one uses the local scheme.
    `domain`: `KEY=VALUE` declarations of the input domain (tafl.packaging.domain), beside what the training data
    say; a DICOM whose header contradicts the domain is refused before the model runs. `coverage`: the level of the
    prediction set every answer carries (tafl.packaging.sets), from the run's conformal calibration."""
    from tafl.packaging.signing import TRUSTED_ENV, load_private_key
    from tafl.settings import signing_key_setting, trusted_keys_setting
    from tafl.training.checkpoint import load_checkpoint

    sign_key = sign_key or signing_key_setting()
    signer = load_private_key(sign_key) if sign_key else None  # a bad key fails before the minutes of export
    coverage = check_coverage(coverage)
    ck_path = Path(checkpoint)
    ck = load_checkpoint(ck_path)
    out = Path(out)
    _check_out(out, force)
    keep_detector, domain = split_detector(domain)
    if not keep_detector:
        ck = _without_detector(ck)
    sets = sets_spec(ck, ck_path, coverage)
    graph, experts, vote = build_graph(ck, sets)
    names = graph.outputs
    mcfg = ModelConfig.from_dict(ck["model_config"])
    pre = Preprocess.from_dict(ck["preprocess"])
    lineage = _lineage(ck, parent)
    input_domain = resolve_domain(ck.get("data_provenance") or {}, domain, lineage.get("domain"))
    pkg_name = name or lineage["name"] or f"{ck['method']}-{ck['run_config']['dataset']}"
    x = pre.normalize(_sample_images(ck, images, data_root))
    with tempfile.TemporaryDirectory(prefix=".tafl-export-", dir=out.parent if out.parent.exists() else None) as tmp:
        tmpd = Path(tmp)
        onnx_path = tmpd / "model.onnx"
        _to_onnx(graph, x, names, mcfg.num_classes, onnx_path)
        check = _verify_with_prior(graph, onnx_path, x, names)
        metrics = _metrics_from(ck_path)
        meta = _metadata(ck, mcfg, pre, graph, names, experts, vote, pkg_name, lineage, metrics, check,
                         _adaptive_check(ck_path))
        if class_codes is not None:
            meta = meta.with_class_codes(_class_codes(class_codes, list(meta.class_names)))
        meta = replace(meta, domain=replace(input_domain, detector=Detector(_detector_spec(ck, ck_path))),
                       sets=Sets(sets))
        _write_package(tmpd, meta, ck_path, out, signer)
    # a signed package is checked against its own key; an unsigned one without keys (it is the consumer's trust
    # list that refuses it), with a warning where this environment has one
    if signer is None and trusted_keys_setting():
        log.warning("%s is unsigned, and %s is set here: services with trusted keys will refuse it; export with "
                    "--sign-key (or TAFL_SIGNING_KEY)", out, TRUSTED_ENV)
    pkg = load_package(out, trusted_keys=[signer.public_key()] if signer is not None else ())
    log.info("exported %s %s to %s (max |Δp| %.1e, max |Δheatmap| %.1e)%s", pkg.name, pkg.version, out,
             check["max_abs_prob_diff"], check["max_abs_heatmap_diff"],
             f", signed by key {pkg.signed_by}" if pkg.signed_by else ", unsigned")
    if to_bentoml:
        from tafl.packaging.store import to_bentoml as store

        store(pkg, to_bentoml)
    return pkg


def _check_out(out: Path, force: bool) -> None:
    """`out` may be replaced: empty, absent, or an earlier package with --force."""
    if out.exists() and any(out.iterdir()):
        if not force:
            raise PackageError(f"{out} already holds files; pass --force to replace it")
        if not (out / "metadata.json").is_file():
            raise PackageError(f"{out} is not empty and holds no model package; refusing to replace it")


def _lineage(ck: dict[str, Any], parent: str | Path | None) -> dict[str, Any]:
    """The new package's version and its parent: --parent, else the package `tafl retrain` started from (loaded
    when its folder is still there, else as recorded in the checkpoint), else none (1.0.0)."""
    parent_pkg = load_package(parent) if parent else None
    parent_info = ck.get("parent_package")  # written by `tafl retrain`
    if parent_pkg is None and parent_info and Path(parent_info.get("path", "")).is_dir():
        try:
            parent_pkg = load_package(parent_info["path"])
        except PackageError:
            parent_pkg = None
    if parent_pkg is not None:
        return {"version": bump_minor(parent_pkg.version), "parent_version": parent_pkg.version,
                "name": parent_pkg.name, "parent": {"name": parent_pkg.name, "version": parent_pkg.version,
                                                    "model_sha256": parent_pkg.files["model.onnx"]},
                "domain": parent_pkg.meta.domain}
    if parent_info:
        return {"version": bump_minor(parent_info["version"]), "parent_version": parent_info["version"],
                "name": parent_info["name"], "parent": parent_info}
    return {"version": "1.0.0", "parent_version": None, "name": None, "parent": None}


def _to_onnx(graph: nn.Module, x: np.ndarray, names: tuple[str, ...], num_classes: int, onnx_path: Path) -> None:
    """Export the graph with a dynamic batch and the optional `log_prior_ratio` input (default zeros)."""
    dyn = {"image": {0: "batch"}, "log_prior_ratio": {0: "prior_rows"}, **{n: {0: "batch"} for n in names}}
    with torch.no_grad():
        torch.onnx.export(graph, (torch.from_numpy(x[:2]), torch.zeros(1, num_classes)), str(onnx_path),
                          input_names=["image", "log_prior_ratio"], output_names=list(names), dynamic_axes=dyn,
                          opset_version=OPSET, dynamo=False)
    _default_prior_input(onnx_path, num_classes)


def _verify_with_prior(graph: nn.Module, onnx_path: Path, x: np.ndarray, names: tuple[str, ...]) -> dict[str, Any]:
    """`verify`, with the check's prior the source prior's reverse: a shift as large as a deployment meets."""
    from tafl.prior import log_prior_ratio

    source = graph.prior_spec["source_prior"]
    return verify(graph, onnx_path, x, names, log_prior_ratio(np.asarray(source)[::-1], source))


def _metadata(ck: dict[str, Any], mcfg: ModelConfig, pre: Preprocess, graph: nn.Module, names: tuple[str, ...],
              experts: tuple[Expert, ...], vote: Vote | None, pkg_name: str, lineage: dict[str, Any],
              metrics: dict[str, Any] | None, check: dict[str, Any],
              adaptive: dict[str, Any] | None = None) -> PackageMetadata:
    """metadata.json: identity and lineage, input and output spec, vote, prior rule, provenance, metrics, checks."""
    C = mcfg.num_classes
    calibration = graph.prior_spec
    prior = PriorSpec(
        input="log_prior_ratio", shape=["1 or batch", C], dtype="float32", default="zeros",
        rule="label = argmax softmax(scale·class_scale·z + bias + log q − log source_prior) when the input is "
             "non-zero, else the model's own rule (class_scale: null = 1)",
        posteriors=calibration["posteriors"], calibration=calibration["kind"],
        temperature=calibration["temperature"], scale=calibration["scale"], bias=calibration["bias"],
        class_scale=calibration.get("class_scale"), source_prior=tuple(calibration["source_prior"]),
        fit=calibration.get("fit", {}), estimator=Estimator(_estimator_spec(ck)),
        adaptive_check=AdaptiveCheck(adaptive))
    return PackageMetadata(
        schema=SCHEMA, name=pkg_name, version=lineage["version"], parent_version=lineage["parent_version"],
        parent=Parent(lineage["parent"]),
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        tafl_version=tafl.__version__, method=ck["method"], backbone=mcfg.backbone,
        model_config=mcfg.to_dict(), task="single-label image classification",
        class_names=tuple(ck["class_names"]),
        input=InputSpec(name="image", shape=("batch", pre.channels, pre.size, pre.size), dtype="float32",
                        preprocessing="outside the graph: decode, convert to the channel count, resize to size×size "
                                      "(Pillow, bilinear), scale to [0, 1], subtract mean, divide by std",
                        preprocess=PreprocessSpec(pre.size, pre.channels, tuple(pre.mean), tuple(pre.std),
                                                   pre.resample, pre.resize)),
        outputs=_output_spec(names, len(experts), mcfg.num_classes, pre.size),
        experts=experts, vote=vote, decision=Decision(_decision_spec(ck)), prior=prior,
        heatmap="attention rollout of the shared extractor" if mcfg.is_vit else
                "class activation map of the predicted class",
        training=Training({"run_config": ck["run_config"], "round": ck["round"],
                           "train_class_counts": ck.get("train_class_counts"), "class_ranks": ck.get("class_ranks")}),
        data_provenance=Provenance(ck.get("data_provenance", {})),
        privacy=Privacy(_privacy_spec(ck)),
        metrics=Metrics(metrics),
        intended_use=(f"Classify {ck['run_config']['dataset']}-like images into {len(ck['class_names'])} classes "
                      "when the class mix at the site is unknown or shifts (test-agnostic long-tailed "
                      "setting), as decision support beside a clinician."),
        limitations=tuple(_limitations(ck, metrics, mcfg.is_vit, adaptive)),
        verification=Verification(check),
    )


def _privacy_spec(ck: dict[str, Any]) -> dict[str, Any]:
    """What the training promised each site's images (tafl.training.privacy): the mechanism, unit, the accountant's
    ε and δ, noise and clipping, and whether secure aggregation hid single sites' numbers."""
    from types import SimpleNamespace

    from tafl.training.privacy import privacy_section

    rc = ck.get("run_config") or {}
    return privacy_section(SimpleNamespace(**rc), (ck.get("book") or {}).get("privacy"),
                           bool(rc.get("secure_aggregation")))


def _decision_spec(ck: dict[str, Any]) -> dict[str, Any]:
    """How the plain label is decided: the argmax, or the validation-chosen operating point (tafl.training.decision)."""
    rec = (ck["state"].get("meta") or {}).get("decision")
    if not rec:
        return {"rule": "argmax of the logits"}
    if rec.get("kind") == "expert_shift":  # GTAFL/CReFF: the move is inside the experts' biases, not in the graph
        return {"rule": "the experts' vote; every expert's bias was moved by offset = −τ·log(training mix), centred, "
                        "before export (the experts' probabilities carry it)",
                "tau": rec["tau"], "offset": rec["offset"], "criterion": rec["criterion"],
                "validation_images": rec.get("validation_images"), "validation_scores": rec.get("scores")}
    return {"rule": "argmax(logits + offset), offset = −τ·log π, centred, π the class mix the posteriors describe "
                    "(the training mix; DAFL: the loss-weighted mix); the probabilities "
                    "carry no offset, and a non-zero log_prior_ratio decides by the Bayes rule instead",
            "tau": rec["tau"], "offset": rec["offset"], "criterion": rec["criterion"],
            "validation_images": rec.get("validation_images"), "validation_scores": rec.get("scores")}


def _class_codes(path: str | Path, names: list[str]) -> dict[str, dict[str, str]]:
    try:
        given = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--class-codes {path}: not a readable JSON file ({exc})") from None
    if not isinstance(given, dict):
        raise ConfigError(f"--class-codes {path}: expected an object mapping class names to codes")
    out = {}
    for name, c in given.items():
        if name not in names:
            raise ConfigError(f"--class-codes {path}: {name!r} is not a class of this model ({', '.join(names)})")
        if not isinstance(c, dict) or not all(isinstance(c.get(k), str) and c.get(k) for k in ("value", "scheme")):
            raise ConfigError(f"--class-codes {path}: {name!r} needs a \"value\" and a \"scheme\" "
                              "(e.g. {\"value\": \"372244006\", \"scheme\": \"SCT\", \"meaning\": \"...\"})")
        out[name] = {"value": c["value"], "scheme": c["scheme"], "meaning": str(c.get("meaning") or name)}
    return out


def _write_package(tmpd: Path, meta: PackageMetadata, ck_path: Path, out: Path, signer: Any = None) -> None:
    """metadata.json, the model card, the checkpoint and SHA256SUMS (and its signature, with a `signer`) beside
    model.onnx in `tmpd`; then `tmpd` replaces `out`."""
    (tmpd / "metadata.json").write_text(json.dumps(meta.to_json(), indent=2))
    (tmpd / "README.md").write_text(render_card(meta))
    shutil.copyfile(ck_path, tmpd / "checkpoint.pt")
    write_checksums(tmpd, ["model.onnx", "metadata.json", "README.md", "checkpoint.pt"])
    if signer is not None:
        from tafl.packaging.signing import sign_package

        sign_package(tmpd, signer)
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(tmpd, out)
