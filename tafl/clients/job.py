"""What a scoring job does alike for a folder (tafl.clients.score) and for a PACS (tafl.clients.dicomweb): its
prior settings, read once at the start and passed down (`JobPrior`: `--prior`, parsed by the same
tafl.prior.parse_prior_option as the service's `prior` option, `--site-mix`, TAFL_PRIOR_ADAPTIVE); the scorer it
opens, checked against the model; the results file it appends to; the tally of what it wrote; the summary that
compares the predicted class mix with the training mix, and with --prior adaptive re-decides every row for the
class mix estimated from all of them (`redecide_adaptive`); and the summary's printout.
"""

from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from tafl.clients.results import ADAPTIVE_COLUMNS, ResultsFile, Row, csv_cell
from tafl.clients.scorers import LocalScorer, RemoteScorer
from tafl.errors import ConfigError
from tafl.packaging.metadata import PackageMetadata
from tafl.prior import PriorOption, parse_prior_option

MIN_ADAPTIVE_IMAGES = 30


# ------------------------------------------------------------------ the job's prior and scorer
@dataclass(frozen=True)
class JobPrior:
    """A scoring job's prior settings: `option` (--prior: train, site, adaptive or explicit class probabilities),
    `site_mix` (--site-mix: this site's class counts) and `adaptive_mode` (TAFL_PRIOR_ADAPTIVE, for --prior
    adaptive: checked follows the package's validation check, always adapts anyway)."""

    option: PriorOption
    site_mix: str | None = None
    adaptive_mode: str = "checked"

    @classmethod
    def read(cls, prior: str | None, site_mix: str | None = None, adaptive_mode: str | None = None) -> JobPrior:
        """The job's settings; TAFL_PRIOR_ADAPTIVE is read (tafl.settings) for --prior adaptive where
        `adaptive_mode` is not given, so a bad value fails here, before anything is scored or fetched."""
        from tafl.settings import prior_adaptive_mode

        option = parse_prior_option(prior)
        if adaptive_mode is None:
            adaptive_mode = prior_adaptive_mode() if option.mode == "adaptive" else "checked"
        return cls(option, site_mix, adaptive_mode)

    @property
    def mode(self) -> str:
        return self.option.mode

    @property
    def adaptive(self) -> bool:
        return self.option.mode == "adaptive"

    @property
    def explicit(self) -> str | None:
        """The explicit prior's text (for the graph, or the service's `prior` option); None for the words."""
        return self.option.text if self.option.mode == "explicit" else None


def make_scorer(url: str | None, package: str | None, token: str | None, model: str | None, concurrency: int,
                batch_size: int, job: JobPrior) -> Any:
    """The in-process (--package) or remote (--url) scorer, with an explicit prior's ratio set and the prior
    mode checked against the model."""
    if url:
        scorer: Any = RemoteScorer(url, token, model, concurrency, min(batch_size, 64), prior=job.explicit,
                                   posteriors=job.adaptive)
        check_prior_support(scorer.meta, job)
        return scorer
    return with_graph_prior(LocalScorer(package, batch_size), job)


def with_graph_prior(scorer: Any, job: JobPrior) -> Any:
    """An in-process scorer (LocalScorer, the Ray engine's) with the explicit prior's ratio for its graph, checked."""
    if job.explicit is not None:
        scorer.ratio = explicit_ratio(scorer.meta, job.explicit)
    check_prior_support(scorer.meta, job)
    return scorer


def check_prior_support(meta: PackageMetadata, job: JobPrior) -> None:
    """--prior adaptive and an explicit prior need a graph that takes a prior (--prior site: `use_site_prior`)."""
    if job.mode in ("adaptive", "explicit") and meta.prior is None:
        _predates_prior(meta, job.option.text)


def _predates_prior(meta: PackageMetadata, prior: str) -> NoReturn:
    raise ConfigError(f"--prior {prior}: the model {meta.name} {meta.version} was exported before prior-aware "
                      "inference; re-export it with this tafl")


def check_site_mix(meta: PackageMetadata, job: JobPrior) -> None:
    """--site-mix goes with --prior adaptive (the estimate's centre) or --prior site (the fixed prior) and names only
    the model's classes; --prior site needs it. Checked before anything is scored."""
    if job.mode == "site" and not job.site_mix:
        raise ConfigError("--prior site decides every image for this site's own class mix: give it with --site-mix "
                          "CLASS=COUNT,... (or a JSON file), or set TAFL_SITE_MIX")
    if not job.site_mix:
        return
    if job.mode not in ("adaptive", "site"):
        raise ConfigError("--site-mix is this site's class mix: it goes with --prior site (decide for that mix) or "
                          "--prior adaptive (centre the case-mix estimate on it)")
    from tafl.prior import parse_site_mix

    parse_site_mix(job.site_mix, list(meta.class_names), "--site-mix")


def use_site_prior(scorer: Any, job: JobPrior) -> str:
    """--prior site: the scorer decides every image for this site's own mix (tafl.prior.site_prior, from
    --site-mix), through the graph's prior input in-process or the service's explicit prior over HTTP. Returns
    that prior as the explicit prior's text."""
    from tafl.prior import parse_site_mix, site_prior

    if scorer.meta.prior is None:
        _predates_prior(scorer.meta, "site")
    q = site_prior(parse_site_mix(job.site_mix or "", list(scorer.meta.class_names), "--site-mix"))
    text = ",".join(f"{v:.12g}" for v in q)
    if isinstance(scorer, RemoteScorer):
        scorer.prior = text
    else:
        scorer.ratio = explicit_ratio(scorer.meta, text)
    return text


def decided_prior(scorer: Any, job: JobPrior) -> str | None:
    """The prior the job's rows are decided for, as the explicit prior's text (None: the model's own rule or, with
    --prior adaptive, re-decided at the end): --site-mix checked, --prior site set on the scorer."""
    check_site_mix(scorer.meta, job)
    return use_site_prior(scorer, job) if job.mode == "site" else job.explicit


def explicit_ratio(meta: PackageMetadata, prior: str) -> np.ndarray:
    """log q − log source prior for the explicit prior in `prior` (the text --prior gave)."""
    from tafl.prior import check_prior, log_prior_ratio

    if meta.prior is None:
        raise ConfigError(f"--prior: the model {meta.name} was exported before prior-aware inference")
    try:
        values = PriorOption("explicit", prior.strip()).values()
    except ValueError:
        raise ConfigError(f"--prior must be train, adaptive or comma-separated class probabilities, got {prior!r}") \
            from None
    q = check_prior(values, len(meta.class_names), "--prior")
    return log_prior_ratio(q, np.asarray(meta.prior.source_prior, np.float64))


def open_results(out: Path, scorer: Any, job: JobPrior, *, resume: bool, force: bool) -> ResultsFile:
    """The results file, with a column per expert and, for --prior adaptive, one per class's posterior."""
    return ResultsFile(out, scorer.meta.expert_names, resume=resume, force=force,
                       num_posteriors=len(scorer.meta.class_names) if job.adaptive else 0,
                       domain=scorer.meta.domain.detector.threshold is not None, sets=scorer.meta.sets.fitted)


# ------------------------------------------------------------------ what the job wrote, and its summary
@dataclass
class Tally:
    """What a job has written: the class mix of the whole results file (earlier runs' rows too), the rows that
    failed, and how many images were predicted now."""

    counts: dict[str, int]
    failed: list[tuple[str, str]] = field(default_factory=list)
    predicted: int = 0
    abstained: int = 0  # rows outside the model's domain: no label, not in the class mix

    def add(self, row: Row, predicted: bool) -> None:
        """`row` as written; `predicted`: it has a label that counts in the class mix."""
        if row.error:
            self.failed.append((row.path, row.error))
        if row.abstained:
            self.abstained += 1
        elif predicted:
            self.counts[row.class_name] = self.counts.get(row.class_name, 0) + 1
            self.predicted += 1


def summarise(meta: PackageMetadata, tally: Tally, out: Path, *, images: int, todo: int, skipped: list[str],
              explicit: str | None, job: JobPrior) -> dict[str, Any]:
    """The job's summary: counts, failures, skipped inputs and the predicted class mix beside the training mix
    (re-decided for the estimated mix with --prior adaptive)."""
    from tafl.packaging.summary import training_shares  # the page's and the model card's rule too

    names, counts = meta.class_names, tally.counts
    train = training_shares(meta)
    scored = sum(counts.values())
    mix = [{"class_name": n, "predicted": counts.get(n, 0),
            "predicted_share": counts.get(n, 0) / scored if scored else 0.0,
            "training_share": train[c] if train else None} for c, n in enumerate(names)]
    summary = {"images": images, "scored_now": todo, "already_done": images - todo,
               "predicted": tally.predicted, "predicted_in_file": scored, "failed": tally.failed, "skipped": skipped,
               "abstained": tally.abstained,
               "class_mix": mix, "out": str(out), "prior": {"used": "explicit" if explicit is not None else "train"}}
    if job.mode == "site" and explicit is not None:  # --prior site: the site's own mix, as the graph was given it
        summary["prior"] = {"used": "site", "prior": dict(zip(names, (float(v) for v in explicit.split(","))))}
    if job.adaptive:
        summary["prior"] = redecide_adaptive(out, meta, job.site_mix, job.adaptive_mode)
        for m in mix:
            m["adaptive_predicted"] = summary["prior"]["adaptive_counts"].get(m["class_name"], 0)
    return summary


def redecide_adaptive(out: Path, meta: PackageMetadata, site_mix: str | None = None,
                      adaptive_mode: str = "checked") -> dict[str, Any]:
    """Estimate the folder's class mix from every scored row's calibrated posteriors (the package's estimator:
    EM, smoothed as metadata prior.estimator says, centred on `site_mix` where it is centred on the site's mix)
    and rewrite the results file, atomically, with each row's decision for that mix beside its plain one.
    `adaptive_mode`: TAFL_PRIOR_ADAPTIVE (checked: the package's validation check may keep the source prior)."""
    from tafl.prior import PriorEstimator, adapt, adaptive_blocked, parse_site_mix

    names = list(meta.class_names)
    C = len(names)
    src = np.asarray(meta.prior.source_prior, np.float64)
    jsonl = out.suffix.lower() == ".jsonl"
    with open(out, encoding="utf-8", newline="") as fh:  # no newline translation: a \r inside a value stays
        text = fh.read()
    if jsonl:
        recs = [json.loads(line) for line in text.splitlines() if line.strip()]
        fields = list(recs[0]) if recs else []
    else:
        reader = csv.DictReader(io.StringIO(text))
        recs, fields = list(reader), list(reader.fieldnames or [])
    cols = [f"p{c}" for c in range(C)]
    scored = [r for r in recs if not r.get("error") and all(r.get(c) not in (None, "") for c in cols)]
    P = np.array([[float(r[c]) for c in cols] for r in scored]).reshape(-1, C)
    info: dict[str, Any] = {"requested": "adaptive", "images": len(scored), "source_prior": dict(zip(names, src))}
    blocked = adaptive_blocked(meta.prior.adaptive_check, adaptive_mode)
    if blocked:
        q = src
        info.update(used="train", fallback=blocked)
    elif len(scored) < MIN_ADAPTIVE_IMAGES:
        q = src
        info.update(used="train", fallback=f"{len(scored)} scored images are too few for an estimate (needs "
                                          f"{MIN_ADAPTIVE_IMAGES}); the adaptive columns repeat the source prior's "
                                          "decision")
    else:
        estimator = PriorEstimator.from_dict(meta.prior.estimator.to_json())
        if site_mix:
            estimator = estimator.for_site(parse_site_mix(site_mix, names, "--site-mix"))
        est = estimator.estimate(P, src)
        q = est.prior
        info.update(used="adaptive", estimate=dict(zip(names, map(float, q))), shift_from_source=est.shift,
                    iterations=est.iterations, converged=est.converged, estimator=estimator.to_dict())
    decided = adapt(P, src, q).argmax(1) if len(P) else np.zeros(0, np.int64)
    by_path = {r["path"]: int(d) for r, d in zip(scored, decided)}
    counts: dict[str, int] = {}
    changed = 0
    for r in recs:
        d = by_path.get(r["path"])
        r["adaptive_label"] = "" if d is None else d
        r["adaptive_class_name"] = "" if d is None else names[d] if jsonl else csv_cell(names[d])  # the rest: as read
        if d is not None:
            counts[names[d]] = counts.get(names[d], 0) + 1
            changed += str(d) != str(r.get("label"))
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w", encoding="utf-8", newline="") as fh:
        if jsonl:
            for r in recs:
                fh.write(json.dumps(r) + "\n")
        else:
            header = [f for f in fields if f not in ADAPTIVE_COLUMNS] + ADAPTIVE_COLUMNS
            fh.write(ResultsFile._csv_line(header))
            for r in recs:  # the cells as read (escaped once already), the same quoting as ResultsFile
                fh.write(ResultsFile._csv_line([r.get(c, "") for c in header]))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, out)
    info.update(adaptive_counts=counts, changed=changed)
    return info



# ------------------------------------------------------------------ the printout
def print_summary(s: dict[str, Any]) -> None:
    print(f"\n{s['images']} image(s): {s['scored_now']} scored now, {s['already_done']} already in {s['out']}; "
          f"{len(s['failed'])} failed, {len(s['skipped'])} other file(s) skipped")
    if s.get("abstained"):
        print(f"{s['abstained']} image(s) outside the model's domain: no label (in_domain false in the results; "
              "not in the class mix below)")
    if not s.get("predicted_in_file", s["predicted"]):
        print("no image has a prediction yet, so there is no class mix to show")
    else:
        _print_class_mix(s)
    _print_problems(s)
    _print_adaptive(s)


def _print_class_mix(s: dict[str, Any]) -> None:
    if s["already_done"]:
        print(f"class mix over all {s['predicted_in_file']} predictions in the file, earlier runs' too:")
    print(f"{'class':40} {'predicted':>9} {'share':>7} {'training share':>15}")
    for m in s["class_mix"]:
        print(f"{m['class_name'][:40]:40} {m['predicted']:9d} {100 * m['predicted_share']:6.1f}% "
              + (f"{100 * m['training_share']:14.1f}%" if m["training_share"] is not None else f"{'unknown':>15}"))


def _print_problems(s: dict[str, Any]) -> None:
    for path, why in s["failed"][:20]:
        print(f"  failed: {path}: {why}")
    if len(s["failed"]) > 20:
        print(f"  ... and {len(s['failed']) - 20} more (see the error column)")
    if "dicom_written" in s:
        print(f"DICOM SR written for {s['dicom_written']} input(s); {len(s['dicom_failed'])} without one")
        for path, why in s["dicom_failed"][:10]:
            print(f"  no SR: {path}: {why}")
    why = s.get("skipped_why") or {}  # DICOMweb: what each instance is (a folder's skipped files are not images)
    for path in s["skipped"][:10]:
        print(f"  skipped: {why[path]}: {path}" if path in why else f"  skipped (not DICOM, PNG or JPEG): {path}")
    if (s.get("undated_studies") or {}).get("count"):
        print(undated_line(s["undated_studies"]))


def _print_adaptive(s: dict[str, Any]) -> None:
    pr = s.get("prior") or {}
    if pr.get("used") == "site":  # --prior site: say which mix decided, largest shares first
        top = sorted(pr["prior"].items(), key=lambda kv: -kv[1])[:5]
        print("decided for this site's own class mix (--prior site): "
              + ", ".join(f"{k[:20]} {100 * v:.1f}%" for k, v in top) + (" ..." if len(pr["prior"]) > 5 else ""))
    if pr.get("requested") == "adaptive":
        if pr.get("used") == "adaptive":
            print(f"\nadaptive prior from {pr['images']} images (total variation {pr['shift_from_source']:.3f} from "
                  f"the training prior; {pr['changed']} decisions changed):")
            for m in s["class_mix"]:
                print(f"  {m['class_name'][:40]:40} estimate {100 * pr['estimate'][m['class_name']]:6.1f}%  "
                      f"adaptive predictions {m.get('adaptive_predicted', 0)}")
        else:
            print(f"\nadaptive prior not used: {pr.get('fallback')}")


def undated_line(undated: dict[str, Any]) -> str:
    """What --since could not see: how many studies have no StudyDate, and how to score them."""
    n, uids = undated["count"], undated["uids"]
    it = "it" if n == 1 and undated["complete"] else "them"
    how_many = (f"{n} stud{'y has' if n == 1 else 'ies have'}" if undated["complete"] else
                f"at least {n} of the first {undated['looked_at']:,} studies listed have")
    shown = " ".join(uids[:5]) + (f" ... ({n - 5} more)" if n > 5 else "")
    return (f"{how_many} no StudyDate, so --since did not score {it} (a date range matches no study without a "
            f"date); score {it} with --study UID: {shown}")
