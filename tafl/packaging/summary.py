"""A package in plain words, for a clinician: what it sorts, how often it is right, which findings it misses, and
what it must not be used for; and each class's share of the training images.

Everything comes from metadata.json alone (no torch, no per-dataset text), so the model card (tafl.packaging.card)
and the service's page (tafl.serving.ui) say the same thing from one implementation: `plain_summary` gives the
parts, `summary_markdown` the card's lines, the page's template renders the parts as HTML.

Words of the method (forward50, backward50, Dirichlet, total variation) stay out of the summary: the test
distributions are named by what they mean at a site. forward50 is the test split resampled to the training
set's long tail (common findings common, rare findings rarer still), uniform every class equally common, and
backward50 the tail reversed (the usually rare findings the most common).
"""

from __future__ import annotations

import math
from typing import Any

from tafl.intervals import with_interval
from tafl.packaging.metadata import PackageMetadata, SiteScores

# a class whose test images the model labels correctly at least this often is "recognised well"; below MISSED
# it is "often missed" (the export's limitations name the classes under one half too, tafl.packaging.export)
WELL, MISSED = 0.8, 0.5
# a drop this large from the training-like mix to the reversed one is worth a warning of its own
REVERSED_DROP = 0.10

# (distribution, plain words), in the order the summary gives them
RIGHT = "labelled correctly "
MIXES = (("forward50", RIGHT + "when the case mix is like training (common findings common, rare ones rare)"),
         ("uniform", RIGHT + "when every class is equally common"),
         ("backward50", RIGHT + "when rare findings become common (the usual mix reversed)"))

# the detail's short explanation of the eleven distributions' names (docs/design.md, "Data and the evaluation protocol")
DISTRIBUTIONS_NOTE = ("forwardN: the classes as common as in training's long tail, the most common N times the "
                      "rarest; uniform: every class equally common; backwardN: the same tail reversed, the "
                      "training's rarest class the most common. Each accuracy weighs the per-class accuracy on the "
                      "test split by that mix.")


def finite(v: Any) -> float | None:
    """`v` as a finite float, or None (metadata numbers may be missing, null, text or NaN)."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def whole_pct(v: float) -> str:
    """A share as a whole percentage: the summary's numbers are for reading, the detail keeps one decimal."""
    return f"{100 * v:.0f}%"


def training_shares(meta: PackageMetadata) -> list[float] | None:
    """Each class's share of the training images: metadata `training.train_class_counts` divided by their sum.

    The same rule as the "training share" `tafl score` prints (tafl/clients/score.py: count / sum of counts).
    None where the package records no usable counts (missing, one per class not given, negative or all zero),
    where `tafl score` would print 0 % for every class. Not the package's `prior.source_prior`: that is the
    class mix the model's probabilities assume, which for an ensemble trained toward balance is uniform and
    says nothing about how many images of each class it saw."""
    counts = meta.training.train_class_counts
    names = meta.class_names
    if not isinstance(counts, list) or len(counts) != len(names):
        return None
    vals = [finite(c) for c in counts]
    if any(v is None or v < 0 for v in vals):
        return None
    total = sum(vals)  # type: ignore[arg-type]
    return [v / total for v in vals] if total > 0 else None  # type: ignore[operator]


def _dataset(meta: PackageMetadata) -> str:
    return str(meta.training.run.dataset or meta.data_provenance.source or "?")


def _image_kind(meta: PackageMetadata) -> tuple[str, str]:
    """('greyscale images', ', shrunk to 64×64 pixels') from the package's preprocessing: what the model saw."""
    ch, size = meta.input.preprocess.channels, meta.input.preprocess.size
    kind = {1: "greyscale", 3: "colour"}.get(ch, f"{ch}-channel" if ch else "")
    return (f"{kind} images" if kind else "images"), (f", shrunk to {size}×{size} pixels" if size else "")


def plain_summary(meta: PackageMetadata) -> dict[str, Any]:
    """The summary's parts:

    - `what`: one sentence, what the model sorts and into which classes;
    - `accuracy`: [(plain words, whole %, value)] for the training-like, balanced and reversed case mixes that
      the package measured (empty without metrics);
    - `groups`: [(heading, [(class, whole %)], note)] recognised well / sometimes missed / often missed / not
      measured, empty groups left out, from the per-class accuracy on the test split (each class's recall);
    - `status`: one sentence, first where a person looks: what it is for (research and evaluation) and not (a
      certified medical device);
    - `not_for`: [sentence] what it must not be used for;
    - `measured`: where the numbers come from, in one plain line (None without metrics)."""
    names = [str(c) for c in meta.class_names]
    met = meta.metrics
    acc = met.accuracy
    dataset = _dataset(meta)
    n_train = meta.data_provenance.n_train
    what = f"Sorts {dataset} images into one of {len(names)} classes: {', '.join(names)}."

    n_test = met.test_images  # a 95% interval from the test split's size (tafl.intervals)
    accuracy = [(words, with_interval(v, n_test), v) for k, words in MIXES if (v := finite(acc.get(k))) is not None]
    counts = met.test_class_counts

    per_class = met.per_class_accuracy or []
    well, between, missed, untested = [], [], [], []
    for i, c in enumerate(names):
        v = finite(per_class[i]) if i < len(per_class) else None
        if v is None:
            untested.append((c, "—"))
        else:
            shown = with_interval(v, counts[i] if i < len(counts) else None, inside=True)  # "c (93%; 90–95%)"
            (well if v >= WELL else missed if v < MISSED else between).append((c, shown, v))
    groups = []
    for heading, items, note in (
            (f"Recognises well (finds at least {WELL:.0%} of its test cases)", well, ""),
            (f"Sometimes misses (finds {MISSED:.0%} to {WELL:.0%})", between, ""),
            (f"Often misses (finds fewer than {MISSED:.0%})", missed,
             "a negative answer for these findings means little")):
        if items:  # the most reliable first within each group
            groups.append((heading, [(c, p) for c, p, _ in sorted(items, key=lambda t: -t[2])], note))
    if untested and per_class:
        groups.append(("Not measured (no test images of the class)", untested, ""))

    seen = f"{n_train} " if isinstance(n_train, int) else ""
    kind, shrunk = _image_kind(meta)
    not_for = [
        "A diagnosis on its own: it is decision support, to be read by a clinician beside the image and the "
        "patient's record.",
        f"Findings outside its {len(names)} classes: it has no \"none of these\" answer, so an image of anything "
        "else still gets one of its labels.",
        f"Other kinds of images: it learned only from {seen}{kind} of the {dataset} collection{shrunk}; images "
        "from another modality, body site, device or hospital may be misread without any warning.",
    ]
    by_mix = {k: finite(acc.get(k)) for k, _ in MIXES}
    fwd, bwd = by_mix["forward50"], by_mix["backward50"]
    if fwd is not None and bwd is not None and fwd - bwd >= REVERSED_DROP:
        not_for.append(f"A site where the usually rare findings are common, unless checked there first: its "
                       f"accuracy falls from {whole_pct(fwd)} to {whole_pct(bwd)} when rare findings become common.")
    if not acc:
        not_for.append("Any use before it has been evaluated: this package records no measured accuracy.")
    measured = None
    if acc or per_class:
        measured = (f"Measured on the {dataset} test images held out from training: a class's share found is the "
                    "part of its test images labelled correctly, and the accuracy for a case mix weighs those shares "
                    "by how common each class is in that mix.")
    return {"what": what, "status": STATUS, "accuracy": [(w, p) for w, p, _ in accuracy], "groups": groups,
            "not_for": not_for, "measured": measured}


# what every package is, said first on the page and in the card (the card's limitations say it again)
STATUS = ("For research and evaluation only: not a certified medical device, and not for diagnosis without a "
          "clinician.")


def summary_markdown(meta: PackageMetadata) -> list[str]:
    """The summary as Markdown lines (the model card's first section)."""
    s = plain_summary(meta)
    lines = ["## In short", "", s["what"], "", f"**{s['status']}**", ""]
    if s["accuracy"]:
        lines += ["**How often it is right**", ""] + [f"- {p} {w}" for w, p in s["accuracy"]] + [""]
    if s["groups"]:
        lines += ["**Which findings it recognises**", ""]
        lines += [f"- {h}: " + ", ".join(f"{c} ({p})" for c, p in items) + (f"; {n}." if n else ".")
                  for h, items, n in s["groups"]] + [""]
    lines += ["**Do not use it for**", ""] + [f"- {x}" for x in s["not_for"]]
    if s["measured"]:
        lines += ["", f"_{s['measured']}_"]
    return lines


# the per-site table's note: what each column means (the model card and the page)
SITES_NOTE = ("Each site (hospital) is scored on its own test images, at its own real case mix: with the model's own "
              "decision; at the site's own training mix (prior=site with the site's class counts, no image to wait "
              "for); adapted to the case mix the service estimates from that site's unlabeled images "
              "(prior=adaptive); and with the site's true case mix given (the best adapting could do). Balanced "
              "accuracy is the mean of the per-class recalls, the number Fed-ISIC2019 reports.")


def site_rows(meta: PackageMetadata) -> list[dict[str, Any]]:
    """The per-site rows of a package trained with a client column (metrics.sites), then the mean over sites and the
    pooled balanced accuracy; [] for other packages. Values are fractions or None (what the metadata lacks)."""
    met = meta.metrics
    sites = met.sites
    if not sites:
        return []

    def row(site: str, d: SiteScores, n_test: Any) -> dict[str, Any]:
        return {"site": site, "n_test": n_test, "own": finite(d.rule("own").accuracy),
                "own_balanced": finite(d.rule("own").balanced_accuracy), "site_mix": finite(d.rule("site").accuracy),
                "adapted": finite(d.rule("adapted").accuracy), "oracle": finite(d.rule("oracle").accuracy)}

    rows = [row(name, d, d.n_test) for name, d in sites.items()]
    rows.append(row("mean over sites", met.site_mean, None))
    pooled = finite(met.pooled_balanced_accuracy)
    if pooled is not None:
        rows.append({"site": "all sites pooled", "n_test": sum(r["n_test"] or 0 for r in rows), "own": None,
                     "own_balanced": pooled, "site_mix": None, "adapted": None, "oracle": None})
    return rows
