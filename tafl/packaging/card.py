"""The model card (README.md of a package), generated from metadata.json alone.

It opens with the plain-language summary a clinician reads first (tafl.packaging.summary, the same one the
service's page shows above each model); the method's detail follows."""

from __future__ import annotations

from typing import Any

from tafl.packaging.domain import describe
from tafl.intervals import with_interval
from tafl.packaging.metadata import Detector, PackageMetadata, PriorSpec, Sets
from tafl.packaging.summary import DISTRIBUTIONS_NOTE, SITES_NOTE, site_rows, summary_markdown
from tafl.privacy_text import privacy_lines

ORDER = ("forward50", "forward25", "forward10", "forward5", "forward2", "uniform", "backward2", "backward5",
         "backward10", "backward25", "backward50")


def _pct(v: Any) -> str:
    return "—" if v is None else f"{100 * v:.1f}%"


def _codes_line(m: PackageMetadata) -> str:
    """How DICOM structured reports code each class (tafl.imaging.dicom_sr.class_codes)."""
    from tafl.imaging.dicom_sr import LOCAL_SCHEME, class_codes

    codes = class_codes(m.class_names, m.class_codes)
    given = [f"{n}: {c['scheme']} {c['value']} ({c['meaning']})" for n, c in zip(m.class_names, codes)
             if c["scheme"] != LOCAL_SCHEME]
    local = [n for n, c in zip(m.class_names, codes) if c["scheme"] == LOCAL_SCHEME]
    text = "DICOM SR codes (format=sr, `tafl dicom-listen`): "
    if given:
        text += "; ".join(given) + (". " if local else ".")
    if local:
        text += (f"{'the other classes' if given else 'every class'} in the local coding scheme **{LOCAL_SCHEME}** "
                 "(tafl local codes; value `class-<index>`, meaning the class name), not a standard terminology: "
                 "map them to SNOMED CT with `class_codes` in metadata.json before results are filed in a PACS.")
    return text


def _prior_line(pr: PriorSpec) -> str:
    """How the package decides for another class mix: its calibration, and how `prior=adaptive` estimates the mix."""
    from tafl.prior import PriorEstimator

    est = pr.estimator
    how = PriorEstimator.from_dict(est.to_json() or {}).describe()
    if est.chosen == "validation":
        images = est.validation_images
        how += f" (the smoothing chosen on {'?' if images is None else images} validation images)"
    text = (f"Posteriors: {pr.posteriors}, calibration **{pr.calibration}**")
    check = (pr.fit or {}).get("check") or {}
    if check.get("checked") and check.get("shipped"):
        text += (f" (it lowered the NLL of {check.get('images', '?')} validation images it was not fitted on, "
                 f"{check.get('nll_uncalibrated', float('nan')):.3f} to {check.get('nll_calibrated', float('nan')):.3f})")
    elif check.get("checked"):
        raised = check.get("nll_calibrated", float("nan")) >= check.get("nll_uncalibrated", float("nan"))
        what = "raised the NLL of" if raised else "did not lower beyond their noise the NLL of"
        text += (f" (a {check.get('kind', '?')} calibration was fitted and not shipped: it {what} "
                 f"{check.get('images', '?')} validation images, {check.get('nll_uncalibrated', float('nan')):.3f} "
                 f"to {check.get('nll_calibrated', float('nan')):.3f})")
    text += f". An explicit prior decides by the Bayes rule; `prior=adaptive` estimates the served mix by {how}."
    if pr.adaptive_check and not pr.adaptive_check.recommended:
        text += (" On this model's validation split adapting lost to its own decision, so `prior=adaptive` keeps the "
                 "source prior.")
    return text


def render_card(m: PackageMetadata) -> str:
    lines = [f"# {m.name} {m.version}", ""] + summary_markdown(m) + ["", "## About this model", "",
             f"{m.task.capitalize()} by **{m.method}** on a **{m.backbone}** backbone, exported "
             f"{m.created} by tafl {m.tafl_version or '?'}.", ""]
    if m.parent_version:
        lines += [f"Retrained from {m.parent.name if m.parent else m.name} {m.parent_version}.", ""]
    lines += ["## Intended use", "", m.intended_use, "", "## Classes", "",
              "| index | class | training images |", "|---|---|---|"]
    counts = m.training.train_class_counts or [None] * len(m.class_names)
    for i, (c, n) in enumerate(zip(m.class_names, counts)):
        lines.append(f"| {i} | {c} | {n if n is not None else '—'} |")
    lines += ["", _codes_line(m)]
    inp = m.input
    pre = inp.preprocess
    lines += ["", "## Input", "", f"`{inp.name}`: float32 {list(inp.shape)}; "
              f"{inp.preprocessing} (size {pre.size}, {pre.channels} channel(s), mean "
              f"{[round(v, 4) for v in pre.mean]}, std {[round(v, 4) for v in pre.std]}).", "",
              f"Input domain: {describe(m.domain)}." + (" A DICOM whose Modality, SOP class or colour contradicts it "
                                                         "is refused before the model runs." if m.domain else ""), "",
              detector_line(m.domain.detector), "", sets_line(m.sets), "",
              "## Outputs", "", "| name | shape | type | meaning |", "|---|---|---|---|"]
    for o in m.outputs:
        lines.append(f"| `{o.name}` | {list(o.shape)} | {o.dtype} | {o.description} |")
    if m.experts:
        lines += ["", "## Experts and vote", "",
                  "Experts, in output order: " + ", ".join(f"{e.name} (weight {e.weight:g})" for e in m.experts)
                  + f". Rule: {m.vote.rule}; {m.vote.tie_break}."]
    lines += ["", f"Heatmap: {m.heatmap}."]
    if m.prior:
        lines += ["", "## Case mix (`prior=`)", "", _prior_line(m.prior)]
    return "\n".join(lines + _metrics_lines(m) + _provenance_lines(m)) + "\n"


def _metrics_lines(m: PackageMetadata) -> list[str]:
    """The card's metrics: the eleven distributions, under a uniform prior, and per site."""
    lines = ["", "## Metrics", ""]
    met = m.metrics
    if met:
        n = met.test_images
        lines += [f"{met.source}. Mean over the eleven test distributions: "
                  f"**{with_interval(met.average_accuracy, n, 1)}**"
                  + (f" (95% Wilson interval for {n} test images)" if n else "") + ".", "",
                  "| " + " | ".join(ORDER) + " |", "|" + "---|" * len(ORDER),
                  "| " + " | ".join(_pct(met.accuracy.get(k)) for k in ORDER) + " |", "", DISTRIBUTIONS_NOTE]
        um = met.uniform_metrics
        if um:
            lines += ["", f"Under a uniform class prior: macro F1 {_pct(um.macro_f1)}, precision "
                          f"{_pct(um.precision)}, recall {_pct(um.recall)}, specificity "
                          f"{_pct(um.specificity)}, AUC {_pct(um.auc)}."]
    else:
        lines.append("Not recorded (no evaluation report beside the checkpoint at export).")
    rows = site_rows(m)
    if rows:
        lines += ["", "### Per site", "", SITES_NOTE, "",
                  "| site | test images | accuracy | balanced accuracy | site's own mix | adapted | true mix given |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['site']} | {r['n_test'] if r['n_test'] is not None else ''} | "
                  f"{with_interval(r['own'], r['n_test'], 1) if r['own'] is not None else _pct(None)} | "
                  f"{_pct(r['own_balanced'])} | {_pct(r['site_mix'])} | {_pct(r['adapted'])} | {_pct(r['oracle'])} |"
                  for r in rows]
    return lines


def _provenance_lines(m: PackageMetadata) -> list[str]:
    """The card's privacy, limitations, training and provenance, and the export's verification."""
    cfg, prov = m.training.run, m.data_provenance
    lines = ["", "## Privacy", ""] + privacy_lines(m.privacy.to_json())
    lines += ["", "## Limitations", ""] + [f"- {x}" for x in m.limitations]
    lines += ["", "## Training and provenance", "",
              f"- method {m.method}, {cfg.clients} clients, {cfg.frac:.0%} per round, {cfg.rounds} rounds, "
              f"{cfg.local_epochs} local epochs, seed {cfg.seed}, model from round {m.training.round}",
              f"- data: {prov.source if prov.source is not None else cfg.dataset}; training index sha256 "
              f"`{prov.training_index_sha256 if prov.training_index_sha256 is not None else '?'}`"]
    v = m.verification
    if v:
        lines += [f"- verified: {v.checker}; ONNX Runtime {v.onnxruntime} vs PyTorch at batch sizes "
                  f"{v.batch_sizes}: max |Δprob| {v.max_abs_prob_diff:.1e}, max |Δheatmap| "
                  f"{v.max_abs_heatmap_diff:.1e}"]
    lines += ["", "Files and their sha256 are listed in `SHA256SUMS`; `tafl.packaging.load_package` refuses a "
                  "package whose files do not match."]
    return lines


def detector_line(det: Detector) -> str:
    """The learned in-domain detector in one paragraph: its threshold and what it refuses of the test split."""
    if not det:
        return "In-domain score: none (a package from before it)."
    if det.threshold is None:
        return f"In-domain score: none; {det.why}."
    energy = " (or, where larger, the energy of its logits on that scale)" if det.kind == "mahalanobis+energy" else ""
    line = (f"In-domain score: `domain_distance`, the squared Mahalanobis distance of the image's features to the "
            f"nearest class mean{energy}; above {det.threshold:.1f} (the score that keeps {100 * det.keep:.0f}% of "
            "the validation images) an image lies outside the training domain.")
    if det.test_refused is not None:
        line += f" It refuses {100 * det.test_refused:.1f}% of the in-domain test split."
    if det.detection:
        line += " Measured at training against images it must not answer (AUROC; share the threshold lets through): "
        line += "; ".join(f"{FAR_SET_NAMES.get(k, k)} {v.get('auroc', float('nan')):.3f} "
                          f"({100 * v.get('accepted', float('nan')):.1f}%)" for k, v in det.detection.items()) + "."
    return line


def sets_line(sets: Sets) -> str:
    """The conformal prediction sets in one paragraph: the coverage a user can rely on and the sets' sizes."""
    if not sets:
        return "Prediction sets: none (a package from before them)."
    if not sets.fitted:
        return f"Prediction sets: none; {sets.why}."
    level = f"{100 * sets.coverage:g}%"
    line = (f"Prediction sets: every answer lists the classes the model cannot rule out (`prediction_set`). For an "
            f"image of any class like the {sets.calibration_images or '?'} calibration images"
            f"{f' ({sets.source})' if sets.source else ''}, the true class is in "
            f"the set with probability at least {level}, whatever the case mix (class-conditional conformal "
            f"prediction; {', '.join(f'{v:g}' for v in sorted(sets.thresholds))} on request).")
    if sets.confidence is not None:
        line += (f" That holds for this package's own thresholds with {100 * sets.confidence:g}% confidence over "
                 "which images calibrated them, not only on average over packages.")
    else:
        line += " That holds on average over the calibration images' draw; one package's coverage may fall short."
    if sets.always_in_set:
        line += (f" Too few calibration images to bound {', '.join(sets.always_in_set)}: always in the set.")
    t = sets.test
    if t.get("coverage") is not None:
        line += (f" On the test split: coverage {100 * t['coverage']:.1f}% (lowest of the eleven case mixes "
                 f"{100 * t.get('lowest_mix_coverage', float('nan')):.1f}%), mean set size {t.get('size', 0):.2f} "
                 f"classes, {100 * t.get('empty', 0):.1f}% empty.")
    if sets.sites:
        line += (f" Each training site has thresholds of its own ({', '.join(sorted(sets.sites))}; `tafl serve "
                 "--site NAME`): they cover that site's images where the federation's need not")
        own = t.get("site_aware") or {}
        line += (" (each site's test images: " + ", ".join(
            f"{n} {100 * v:.1f}% with its own, {100 * (t.get('sites') or {}).get(n, float('nan')):.1f}% with the "
            "federation's" for n, v in own.items()) + ")." if own else ".")
    return line


FAR_SET_NAMES = {"dicom": "DICOM images of other modalities", "photos": "photographs", "digits": "handwritten digits",
                 "other_dataset": "another dataset's images", "noise": "noise", "constant": "blank frames",
                 "unseen_class": "a class left out of training"}
