"""`tafl validate PKG DATA --labels CSV`: a site validates a package on its own labelled images before go-live
(issue 55; docs/design.md, "Validating a package at a site").

The images go the service's way (the decoder, the package's header rules, its preprocessing, ONNX Runtime) and are
decided as the service would: the package's default rule, the site's own mix (`prior=site`, from its labels), and
adapted (the package's case-mix estimator on these images). Measured on the images the model answers (an image it
puts outside its domain gets no label, as in the service; the refused share is reported on its own):

- per class, sensitivity and specificity with Wilson 95 % intervals, the support, and the card's claim beside the
  sensitivity (the test split's per-class accuracy), flagged where the site's whole interval lies below it;
- accuracy (Wilson) and balanced accuracy (stratified percentile bootstrap, BOOTSTRAP resamples, seeded) per rule;
- calibration: the expected calibration error of the answer's probability over BINS equal-width bins, and its
  reliability diagram (computed here: netcal, the well-kept reference, needs torch, which the core install lacks;
  tests check it against scikit-learn's calibration_curve);
- ROC curves per class (one against the rest, on the calibrated posteriors) and the confusion matrix;
- the refused share, and the prediction sets' coverage and mean size, where the package has them;
- the package's identity and the data's description, so the report can be filed.

Acceptance criteria (`--require 'sensitivity(mel)>=0.8'`, or a YAML file of them) are judged on the interval: a
lower bound (≥, >) on the interval's lower end, an upper bound (≤, <) on its upper end. The verdict and the exit
status follow them: 0 pass, 1 fail, 2 could not run.

Standard library and numpy only (the core install: no torch, no scikit-learn).
"""

from __future__ import annotations

import csv
import datetime as _dt
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tafl.errors import ConfigError, DataError, OutsideDomain, TaflError
from tafl.intervals import wilson

BOOTSTRAP = 2000
BINS = 10
IMAGE_SUFFIXES = ("", ".png", ".jpg", ".jpeg", ".dcm", ".PNG", ".JPG", ".JPEG", ".DCM")
RULES = ("default", "site", "adapted")


# ------------------------------------------------------------------ the labels
@dataclass
class Labelled:
    ids: list[str]  # as the CSV names them
    paths: list[Path]
    labels: np.ndarray  # (N,) class index


def read_labels(csv_path: str | Path, root: str | Path, class_names: list[str], path_column: str = "path",
                label_column: str = "label") -> Labelled:
    """The labelled images: ConfigError with one line per problem (a missing file, a class the model lacks, an id
    given twice, a row without a class) and no Labelled, so no report is made from a list that is wrong."""
    csv_path, root = Path(csv_path), Path(root)
    try:
        with open(csv_path, newline="", encoding="utf-8-sig") as fh:
            reader = csv.DictReader(fh)
            rows = list(reader)
            columns = reader.fieldnames or []
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise ConfigError(f"--labels {csv_path}: cannot be read ({exc})") from None
    missing_cols = [c for c in (path_column, label_column) if c not in columns]
    if missing_cols:
        raise ConfigError(f"--labels {csv_path}: no column {', '.join(map(repr, missing_cols))} (columns: "
                          f"{', '.join(columns) or 'none'}; choose with --path-column and --label-column)")
    if not rows:
        raise ConfigError(f"--labels {csv_path}: no rows")
    index = {n: i for i, n in enumerate(class_names)}
    problems, ids, paths, labels, first = [], [], [], [], {}
    for line, row in enumerate(rows, start=2):  # line 1 is the header
        rid, cls = (row.get(path_column) or "").strip(), (row.get(label_column) or "").strip()
        where = f"{csv_path.name} line {line}"
        if not rid:
            problems.append(f"{where}: no {path_column}")
            continue
        if rid in first:
            problems.append(f"{where}: {rid} is listed again (first on line {first[rid]})")
            continue
        first[rid] = line
        if not cls:
            problems.append(f"{where}: {rid} has no class")
        elif cls not in index:
            problems.append(f"{where}: class {cls!r} of {rid} is not one of the model's ({', '.join(class_names)})")
        path = next((root / (rid + s) for s in IMAGE_SUFFIXES if (root / (rid + s)).is_file()), None)
        if path is None:
            problems.append(f"{where}: {rid}: no such file under {root}")
        if cls in index and path is not None:
            ids.append(rid)
            paths.append(path)
            labels.append(index[cls])
    if problems:
        shown = problems[:50] + ([f"... and {len(problems) - 50} more"] if len(problems) > 50 else [])
        raise ConfigError(f"--labels {csv_path}: {len(problems)} problem(s), no report made:\n  " + "\n  ".join(shown))
    return Labelled(ids, paths, np.asarray(labels, np.int64))


def fetch_dicomweb(url: str, studies: list[str], dest: Path) -> Path:
    """Every image instance of `studies` on a DICOMweb server (QIDO-RS, then WADO-RS as stored, no transcoding),
    written as DEST/<SOP Instance UID>.dcm: the labels CSV names instances by their SOP Instance UID. tafl's own
    SRs and captures and non-image instances are not fetched."""
    from tafl.clients.dicomweb import Pacs
    from tafl.settings import upload_limit

    if not studies:
        raise ConfigError("--dicomweb validates the studies given with --study UID (one or more)")
    pacs = Pacs(url)
    images, _ = pacs.find(list(studies), None, None)
    dest.mkdir(parents=True, exist_ok=True)
    limit = upload_limit()
    for ref in images:
        if not ref.ours:
            (dest / f"{ref.sop}.dcm").write_bytes(pacs.fetch(ref, dest / ".wado", limit))
    return dest


# ------------------------------------------------------------------ scoring, the service's way
def score(pkg: Any, data: Labelled, batch_size: int = 64, threads: int | None = None) -> dict[str, Any]:
    """The graph's outputs for every labelled image that decodes (rows in `data`'s order: `rows`), and why each
    other one did not (`failed`: index -> message; a header outside the trained domain is `refused`)."""
    from tafl.imaging import decode_image

    session = pkg.session(["CPUExecutionProvider"], threads)
    pre = pkg.preprocess
    outs: list[dict[str, np.ndarray]] = []
    rows, failed, refused = [], {}, {}
    arrays, pending = [], []

    def flush() -> None:
        if arrays:
            outs.append(pkg.run(session, pre.normalize(np.stack(arrays))))
            rows.extend(pending)
            arrays.clear()
            pending.clear()

    from tafl.settings import upload_limit

    limit = upload_limit()  # as the service: a file over its upload limit is not read at all
    for i, path in enumerate(data.paths):
        try:
            size = path.stat().st_size
            if size > limit:
                failed[i] = f"{size / 2**20:.0f} MiB: over the {limit / 2**20:g} MiB upload limit (TAFL_MAX_UPLOAD_MB)"
                continue
            decoded = decode_image(path.read_bytes())
            pkg.check_domain(decoded)
            arrays.append(pre.to_uint8(decoded.frames[0]))
            pending.append(i)
        except OutsideDomain as exc:  # the header contradicts the trained domain: refused, as the service would
            refused[i] = exc.message
        except TaflError as exc:
            failed[i] = exc.message
        except OSError as exc:
            failed[i] = f"unreadable: {exc.strerror or exc}"
        if len(arrays) >= batch_size:
            flush()
    flush()
    out = {k: np.concatenate([o[k] for o in outs]) for k in outs[0]} if outs else {}
    return {"rows": np.asarray(rows, np.int64), "out": out, "failed": failed, "refused": refused}


# ------------------------------------------------------------------ intervals and metrics
def balanced_accuracy(y: np.ndarray, pred: np.ndarray, classes: np.ndarray) -> float:
    """The mean recall over `classes` (those with support)."""
    return float(np.mean([(pred[y == c] == c).mean() for c in classes]))


def bootstrap_balanced(y: np.ndarray, pred: np.ndarray, seed: int = 0,
                       n: int = BOOTSTRAP) -> tuple[float, float, float]:
    """(balanced accuracy, low, high): the 2.5 and 97.5 percentiles of a stratified bootstrap, each class's images
    resampled within the class (so every resample measures every class the site has, as the estimate does); a
    class's resampled count of right answers is Binomial(n_c, recall_c), which is drawn directly."""
    if len(y) == 0:
        return (math.nan, math.nan, math.nan)
    classes = np.unique(y)
    est = balanced_accuracy(y, pred, classes)
    rng = np.random.default_rng(seed)
    draws = np.stack([rng.binomial(int((y == c).sum()), float((pred[y == c] == c).mean()), n) / (y == c).sum()
                      for c in classes])
    lo, hi = np.percentile(draws.mean(axis=0), [2.5, 97.5])
    return (est, float(lo), float(hi))


def per_class(y: np.ndarray, pred: np.ndarray, num_classes: int) -> list[dict[str, Any]]:
    out = []
    for c in range(num_classes):
        pos, neg = y == c, y != c
        tp, tn = int((pred[pos] == c).sum()), int((pred[neg] != c).sum())
        out.append({"support": int(pos.sum()), "sensitivity": wilson(tp, int(pos.sum())),
                    "specificity": wilson(tn, int(neg.sum()))})
    return out


def calibration(conf: np.ndarray, correct: np.ndarray, bins: int = BINS) -> dict[str, Any]:
    """Expected calibration error of the answer's probability `conf` against `correct`, over equal-width bins
    (right-closed, the first also closed at 0), and the reliability diagram's points (bin mean confidence, bin
    accuracy, count) for the non-empty bins."""
    conf, correct = np.asarray(conf, np.float64), np.asarray(correct, np.float64)
    edges = np.linspace(0.0, 1.0, bins + 1)
    which = np.clip(np.searchsorted(edges[1:-1], conf, side="left"), 0, bins - 1)
    points, ece = [], 0.0
    for b in range(bins):
        m = which == b
        if m.any():
            acc, mean_conf = float(correct[m].mean()), float(conf[m].mean())
            ece += m.sum() / len(conf) * abs(acc - mean_conf)
            points.append({"confidence": mean_conf, "accuracy": acc, "count": int(m.sum())})
    return {"ece": float(ece) if len(conf) else math.nan, "bins": bins, "points": points}


def roc(scores: np.ndarray, positive: np.ndarray) -> dict[str, Any]:
    """One class against the rest: the ROC curve's points (false and true positive rates, at every distinct
    threshold) and its area (trapezoids; ties count half)."""
    s, pos = np.asarray(scores, np.float64), np.asarray(positive, bool)
    P, N = int(pos.sum()), int((~pos).sum())
    if P == 0 or N == 0:
        return {"auc": math.nan, "fpr": [], "tpr": []}
    order = np.argsort(-s, kind="mergesort")
    s, pos = s[order], pos[order]
    last = np.r_[np.flatnonzero(np.diff(s)), len(s) - 1]  # the last index of each run of equal scores
    tps, fps = np.cumsum(pos)[last], np.cumsum(~pos)[last]
    tpr, fpr = np.r_[0.0, tps / P], np.r_[0.0, fps / N]
    auc = float(np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2))  # the trapezoid rule
    return {"auc": auc, "fpr": fpr.tolist(), "tpr": tpr.tolist()}


# ------------------------------------------------------------------ the three rules
def decisions(pkg: Any, out: dict[str, np.ndarray], y: np.ndarray) -> dict[str, Any]:
    """Each rule's labels on the answered images and what it decided with: the default rule (the graph's label),
    the site's own mix from its labels (prior=site), and the package's case-mix estimate from these images."""
    from tafl.prior import PriorEstimator, adapt, site_prior

    meta = pkg.meta
    C = len(meta.class_names)
    rules: dict[str, Any] = {"default": {"labels": out["label"], "prior": "the package's own rule"}}
    if meta.prior is None or "calibrated_probs" not in out:
        return rules
    src = np.asarray(meta.prior.source_prior, np.float64)
    p = np.asarray(out["calibrated_probs"], np.float64)
    q_site = site_prior(np.bincount(y, minlength=C).astype(np.float64))
    rules["site"] = {"labels": adapt(p, src, q_site).argmax(1), "prior": dict(zip(meta.class_names, q_site.tolist()))}
    est = PriorEstimator.from_dict(meta.prior.estimator.to_json()).estimate(p, src)
    rules["adapted"] = {"labels": adapt(p, src, est.prior).argmax(1),
                        "prior": dict(zip(meta.class_names, est.prior.tolist())), "converged": bool(est.converged)}
    return rules


# ------------------------------------------------------------------ acceptance criteria
CRITERION = re.compile(r"^\s*(sensitivity|specificity|balanced_accuracy|accuracy|refused|coverage)\s*"
                       r"(?:\(\s*([^()]*?)\s*\))?\s*(>=|<=|>|<)\s*([0-9]*\.?[0-9]+)\s*(%?)\s*$")


@dataclass(frozen=True)
class Criterion:
    text: str
    metric: str
    arg: str | None  # a class (sensitivity, specificity) or a rule (accuracy, balanced_accuracy)
    op: str
    value: float


def parse_criteria(items: list[str], class_names: list[str]) -> list[Criterion]:
    """ConfigError with one line per criterion that cannot be read."""
    out, problems = [], []
    for text in items:
        m = CRITERION.match(text)
        if m is None:
            problems.append(f"--require {text!r}: expected METRIC(ARG)OP VALUE, such as 'sensitivity(mel)>=0.8' "
                            "or 'balanced_accuracy>=0.6' (metrics: sensitivity(CLASS), specificity(CLASS), "
                            "accuracy[(RULE)], balanced_accuracy[(RULE)], refused, coverage)")
            continue
        metric, arg, op, value, percent = m.groups()
        v = float(value) / (100 if percent else 1)
        if metric in ("sensitivity", "specificity") and arg not in class_names:
            problems.append(f"--require {text!r}: {metric} needs one of the model's classes "
                            f"({', '.join(class_names)})")
        elif metric in ("accuracy", "balanced_accuracy") and arg not in (None, "", *RULES):
            problems.append(f"--require {text!r}: the rule is one of {', '.join(RULES)}")
        elif metric in ("refused", "coverage") and arg:
            problems.append(f"--require {text!r}: {metric} takes no argument")
        elif not 0 <= v <= 1:
            problems.append(f"--require {text!r}: {value}{percent} is not a share between 0 and 1")
        else:
            out.append(Criterion(text.strip(), metric, arg or None, op, v))
    if problems:
        raise ConfigError("\n".join(problems))
    return out


def read_criteria_file(path: str | Path) -> list[str]:
    """A YAML file: a list of criteria, or {require: [...]}."""
    import yaml

    try:
        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"--criteria {path}: cannot be read ({exc})") from None
    items = doc.get("require") if isinstance(doc, dict) else doc
    if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
        raise ConfigError(f"--criteria {path}: expected a list of criteria (or 'require:' and a list), such as "
                          "- sensitivity(mel) >= 0.8")
    return items


def judge(c: Criterion, report: dict[str, Any]) -> dict[str, Any]:
    """The criterion against the report's interval: ≥ and > on its lower end, ≤ and < on its upper end."""
    if c.metric in ("sensitivity", "specificity"):
        est, lo, hi = report["per_class"][c.arg][c.metric]
    elif c.metric in ("accuracy", "balanced_accuracy"):
        rule = report["rules"].get(c.arg or "default")
        est, lo, hi = rule[c.metric] if rule else (math.nan,) * 3
    elif c.metric == "refused":
        est, lo, hi = report["refused"]["share"]
    else:
        sets = report.get("sets") or {}
        est, lo, hi = sets.get("coverage", (math.nan,) * 3)
    bound = lo if c.op in (">=", ">") else hi
    ok = {">=": bound >= c.value, ">": bound > c.value, "<=": bound <= c.value, "<": bound < c.value}[c.op]
    return {"criterion": c.text, "estimate": est, "interval": [lo, hi], "judged_on": bound,
            "passed": bool(ok) if not math.isnan(bound) else False}


# ------------------------------------------------------------------ the whole validation
def validate(package: str | Path, data_root: str | Path, labels_csv: str | Path, *, criteria: list[str] = (),
             path_column: str = "path", label_column: str = "label", batch_size: int = 64,
             threads: int | None = None, seed: int = 0) -> dict[str, Any]:
    """The report's content (JSON-able); ConfigError / PackageError / DataError when it cannot be made."""
    import tafl
    from tafl.packaging import load_package

    pkg = load_package(package)
    names = list(pkg.class_names)
    crit = parse_criteria(list(criteria), names)
    data = read_labels(labels_csv, data_root, names, path_column, label_column)
    scored = score(pkg, data, batch_size, threads)
    rows, out = scored["rows"], scored["out"]
    if not len(rows):
        raise DataError(f"none of the {len(data.paths)} labelled images could be scored (first: "
                        f"{next(iter({**scored['failed'], **scored['refused']}.values()), '?')})")
    y_all = data.labels[rows]
    keep = np.ones(len(rows), bool)
    if pkg.meta.domain.detector.threshold is not None and "domain_distance" in out:
        keep = out["domain_distance"] <= pkg.meta.domain.detector.threshold
    answered = {k: v[keep] for k, v in out.items()}
    y = y_all[keep]
    report = _measure(pkg, answered, y, names, seed)
    refused_n = int((~keep).sum()) + len(scored["refused"])
    offered = len(rows) + len(scored["refused"])
    report["refused"] = {"images": refused_n, "of": offered, "share": wilson(refused_n, offered),
                         "by_header": len(scored["refused"]), "by_detector": int((~keep).sum())}
    report["not_scored"] = [{"id": data.ids[i], "why": why} for i, why in scored["failed"].items()]
    report["criteria"] = [judge(c, report) for c in crit]
    failed = [j for j in report["criteria"] if not j["passed"]]
    report["verdict"] = _verdict(report, failed, bool(crit))
    report["passed"] = not failed
    card_claims = pkg.meta.metrics.per_class_accuracy
    report["package"] = {"name": pkg.name, "version": pkg.version, "model_sha256": pkg.files.get("model.onnx"),
                         "signed_by": pkg.signed_by, "method": pkg.meta.method, "created": pkg.meta.created,
                         "claims_from": pkg.meta.metrics.source, "has_claims": bool(card_claims)}
    report["data"] = {"root": str(Path(data_root).resolve()), "labels": str(Path(labels_csv).resolve()),
                      "images": len(data.paths), "scored": len(rows), "answered": int(keep.sum()),
                      "per_class": {n: int((data.labels == c).sum()) for c, n in enumerate(names)}}
    report["tafl_version"] = tafl.__version__
    report["created"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    report["method_notes"] = {"proportions": "Wilson score interval, 95 %",
                              "balanced_accuracy": f"stratified percentile bootstrap (each class resampled within "
                                                   f"itself), {BOOTSTRAP} resamples, 95 %",
                              "calibration": f"expected calibration error, {BINS} equal-width bins of the answer's "
                                             "probability",
                              "images": "the images the model answered (in its domain); the refused share apart"}
    return report


def _measure(pkg: Any, out: dict[str, np.ndarray], y: np.ndarray, names: list[str], seed: int) -> dict[str, Any]:
    C = len(names)
    rules = decisions(pkg, out, y)
    claims = pkg.meta.metrics.per_class_accuracy or [None] * C
    report: dict[str, Any] = {"classes": names, "rules": {}, "per_class": {}}
    for name, r in rules.items():
        pred = np.asarray(r["labels"], np.int64)
        report["rules"][name] = {"accuracy": wilson(int((pred == y).sum()), len(y)),
                                 "balanced_accuracy": bootstrap_balanced(y, pred, seed),
                                 "prior": r["prior"]}
    pred = np.asarray(rules["default"]["labels"], np.int64)
    for c, m in enumerate(per_class(y, pred, C)):
        claim = claims[c] if c < len(claims) and isinstance(claims[c], (int, float)) else None
        sens = m["sensitivity"]
        report["per_class"][names[c]] = {**m, "claim": claim,
                                         "below_claim": bool(claim is not None and sens[2] < claim - 1e-9)}
    conf = np.asarray(out["probs"], np.float64)[np.arange(len(pred)), pred]
    report["calibration"] = calibration(conf, pred == y)
    post = np.asarray(out.get("calibrated_probs", out["probs"]), np.float64)
    report["roc"] = {names[c]: roc(post[:, c], y == c) for c in range(C)}
    report["confusion"] = np.bincount(y * C + pred, minlength=C * C).reshape(C, C).tolist()
    if pkg.meta.sets.fitted and "prediction_set" in out:
        sets = np.asarray(out["prediction_set"], bool)
        hit = sets[np.arange(len(y)), y]
        report["sets"] = {"level": pkg.meta.sets.coverage, "coverage": wilson(int(hit.sum()), len(y)),
                          "size": float(sets.sum(axis=1).mean()) if len(y) else math.nan,
                          "per_class": {names[c]: wilson(int(hit[y == c].sum()), int((y == c).sum()))
                                        for c in range(C)}}
    return report


def _verdict(report: dict[str, Any], failed: list[dict[str, Any]], any_criteria: bool) -> str:
    below = [n for n, v in report["per_class"].items() if v["below_claim"]]
    claims = (f" {len(below)} class(es) below the card's claim: {', '.join(below)}." if below else
              " No class's sensitivity lies wholly below the card's claim.")
    if not any_criteria:
        return "No acceptance criteria were given (--require)." + claims
    if failed:
        return (f"FAIL: {len(failed)} of {len(report['criteria'])} acceptance criteria not met "
                f"({'; '.join(f['criterion'] for f in failed)})." + claims)
    return f"PASS: all {len(report['criteria'])} acceptance criteria met, each on its interval." + claims
