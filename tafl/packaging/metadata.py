"""metadata.json as a typed, versioned contract: what a model package says about itself (docs/design.md, "The model package").

Export builds a `PackageMetadata` and writes its `to_json()`; `load_package` reads `PackageMetadata.from_json`, and
serving, the clients, scoring, the page, the model card, the Open Inference Protocol, the DICOM results and the
BentoML store read its attributes (`pkg.meta.prior.source_prior`), never the JSON by key
(tests/serving/test_structure.py holds that rule).

    PackageMetadata
      schema "tafl-model-package/N", name, version, parent_version, parent (Parent), created, tafl_version
      method, backbone, model_config, task, class_names, class_codes
      input (InputSpec: name, shape, dtype, preprocessing, preprocess (PreprocessSpec)), outputs (OutputSpec, ...)
      experts (Expert, ...), vote (Vote), decision (Decision), prior (PriorSpec: the graph's optional input and the
        source prior; fit, estimator (Estimator), adaptive_check (AdaptiveCheck)), heatmap
      training (Training: run (RunConfig), round, train_class_counts, class_ranks), data_provenance (Provenance),
      privacy (Privacy), metrics (Metrics: ..., sites (SiteScores, Scores)), intended_use, limitations,
      verification (Verification), domain (InputDomain: the modalities, SOP classes and colour trained on),
      sets (Sets: the conformal prediction sets' coverage and class thresholds)

The parts are of two kinds:

- The model's contract, checked at load: identity and lineage (semantic versions), the class names, the input
  tensor and its preprocessing, the outputs, the experts and their vote, and the prior block (the graph's optional
  `log_prior_ratio` input and the source prior it is relative to). Every problem found is named by its field's
  path (`input.preprocess.size`), all of them in one PackageError, one per clause.
- Records that other parts of tafl write and people read (the training run, provenance, privacy, metrics, the
  export's verification, the operating point, the parent, the adaptive check, the estimator): a `Record` carries
  one whole, as written (`fields`), so nothing is lost or reordered when it is written again, and its properties
  are what tafl reads of it. Their numbers may be missing, null or text in a package someone edited; their readers
  (tafl.packaging.summary) cope with that, so such a package is not refused.

Versions. `schema` is "tafl-model-package/N"; this tafl writes N = SCHEMA_VERSION. Metadata of an older N is
migrated before it is read: MIGRATIONS[n] turns version n into n + 1 (none yet: 1 is the first version), and the
keys that tafl releases added to version 1 after its first read as what their absence meant (ADDED_IN_1: no
prior input, the plain argmax, no privacy record, ...). Metadata of a newer N is refused with both versions named.

Standard library and tafl.errors only: no torch, numpy or ONNX Runtime, so anything can read a package's metadata.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from tafl import __version__
from tafl.errors import PackageError
from tafl.packaging.records import NUMBER, STR_OR_NULL, VERSION_RE, Record, Reader
from tafl.packaging.learned import Detector, Sets

SCHEMA_NAME = "tafl-model-package"
SCHEMA_VERSION = 1
SCHEMA = f"{SCHEMA_NAME}/{SCHEMA_VERSION}"
_SCHEMA_RE = re.compile(rf"^{SCHEMA_NAME}/(\d+)$")

# MIGRATIONS[n]: metadata of schema version n, as a dict, becomes version n + 1 (a renamed key, a new required key's
# value for old packages). Version 1 is the first, so there is none yet; the next version adds its step here.
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}

# keys later tafl releases added to version 1, with what a package from before them means by their absence
ADDED_IN_1: dict[str, Any] = {
    "parent": None,  # lineage beyond parent_version
    "tafl_version": None,
    "model_config": None,
    "task": None,
    "decision": None,  # the plain argmax (no operating point)
    "prior": None,  # a graph without the log_prior_ratio input: no prior-aware inference
    "privacy": None,  # no privacy record
    "verification": None,
    "class_codes": None,  # every class in the local coding scheme (tafl.imaging.dicom_sr)
    "domain": None,  # no recorded input domain: a DICOM header decides nothing
    "sets": None,  # no prediction sets
}

OUTPUTS = ("label", "probs", "heatmap")  # every graph
EXPERT_OUTPUTS = ("expert_labels", "expert_probs", "votes")  # an ensemble's graph too


def parse_version(v: str) -> tuple[int, int, int]:
    """(MAJOR, MINOR, PATCH) of a semantic version; PackageError otherwise."""
    m = VERSION_RE.match(v or "") if isinstance(v, str) else None
    if not m:
        raise PackageError(f"version {v!r} is not semantic (MAJOR.MINOR.PATCH)")
    return int(m[1]), int(m[2]), int(m[3])




class Parent(Record):
    """The package this one was retrained from: name, version, and the sha256 of its model.onnx (or its path, as
    `tafl retrain` recorded it where the package itself was not loaded at export)."""

    @property
    def name(self) -> str | None:
        return self._get("name")

    @property
    def version(self) -> str | None:
        return self._get("version")

    @property
    def model_sha256(self) -> str | None:
        return self._get("model_sha256")


class Decision(Record):
    """How the plain label is decided (tafl.training.decision): `rule`, and for a validation-chosen operating point
    `tau`, `offset`, `criterion`, `validation_images`, `validation_scores`."""

    @property
    def rule(self) -> str | None:
        return self._get("rule")

    @property
    def tau(self) -> float | None:
        return self._get("tau")


class AdaptiveCheck(Record):
    """Whether `prior=adaptive` helps this model (tafl.prior.adaptive_check of its validation split): recommended,
    images, plain, against, adaptive, oracle, and `why` where it is not recommended."""

    @property
    def recommended(self) -> bool:
        return self._get("recommended", True)  # a check that does not say: nothing is blocked

    @property
    def why(self) -> str | None:
        return self._get("why")


class Estimator(Record):
    """How `prior=adaptive` estimates the case mix: the record of tafl.prior.PriorEstimator (kind, pseudo_count,
    center, ..., `chosen` and the validation scores where it was chosen on validation). `PriorEstimator.from_dict(
    estimator.fields)` reads and checks it."""

    @property
    def chosen(self) -> str | None:
        return self._get("chosen")

    @property
    def validation_images(self) -> int | None:
        return self._get("validation_images")


class RunConfig(Record):
    """The training run's configuration (tafl.training.config.RunConfig, as saved): what the card and the page say
    of it."""

    @property
    def dataset(self) -> str | None:
        return self._get("dataset")

    @property
    def clients(self) -> int | None:
        return self._get("clients")

    @property
    def frac(self) -> float | None:
        return self._get("frac")

    @property
    def rounds(self) -> int | None:
        return self._get("rounds")

    @property
    def local_epochs(self) -> int | None:
        return self._get("local_epochs")

    @property
    def seed(self) -> int | None:
        return self._get("seed")


class Training(Record):
    """The training behind the model: `run_config`, the `round` the model is from, `train_class_counts` (the
    training images per class) and `class_ranks`."""

    @property
    def run(self) -> RunConfig:
        return RunConfig.of(self._get("run_config"))

    @property
    def round(self) -> int | None:
        return self._get("round")

    @property
    def train_class_counts(self) -> list | None:
        return self._get("train_class_counts")


class Provenance(Record):
    """Where the training data came from (tafl.training.data): source, counts per split, the training index's
    sha256, and for folders the labels file and the sites."""

    @property
    def source(self) -> str | None:
        return self._get("source")

    @property
    def n_train(self) -> int | None:
        return self._get("n_train")

    @property
    def training_index_sha256(self) -> str | None:
        return self._get("training_index_sha256")


class Privacy(Record):
    """What the training promised each site's images (tafl.training.privacy.privacy_section); tafl.privacy_text
    formats `fields` for the report, the card and the page alike."""


class Scores(Record):
    """One rule's scores on a site's test rows: accuracy and balanced_accuracy (fractions, or whatever was written)."""

    @property
    def accuracy(self) -> Any:
        return self._get("accuracy")

    @property
    def balanced_accuracy(self) -> Any:
        return self._get("balanced_accuracy")


class SiteScores(Record):
    """A site's scores (metrics.sites[name], or the mean over sites): n_test, and per rule (own, site, adapted,
    oracle) its Scores."""

    @property
    def n_test(self) -> Any:
        return self._get("n_test")

    def rule(self, name: str) -> Scores:
        return Scores.of(self._get(name))


class UniformMetrics(Record):
    """Macro F1, precision, recall, specificity and AUC under a uniform class prior."""

    @property
    def macro_f1(self) -> Any:
        return self._get("macro_f1")

    @property
    def precision(self) -> Any:
        return self._get("precision")

    @property
    def recall(self) -> Any:
        return self._get("recall")

    @property
    def specificity(self) -> Any:
        return self._get("specificity")

    @property
    def auc(self) -> Any:
        return self._get("auc")


class Metrics(Record):
    """The training report's test numbers (export's `_metrics_from`): the prior-weighted accuracy on the eleven
    distributions, per class, under a uniform prior, and per site where the run had sites."""

    @property
    def source(self) -> str | None:
        return self._get("source")

    @property
    def average_accuracy(self) -> Any:
        return self._get("average_accuracy")

    @property
    def accuracy(self) -> Mapping[str, Any]:
        """Distribution name (forward50 ... backward50) -> accuracy."""
        acc = self._get("accuracy")
        return acc if isinstance(acc, dict) else {}

    @property
    def per_class_accuracy(self) -> list | None:
        return self._get("per_class_accuracy")

    @property
    def test_class_counts(self) -> list[int]:
        """The test split's images per class ([] where the report did not record them)."""
        c = self._get("test_class_counts")
        return [int(x) for x in c] if isinstance(c, list) and all(isinstance(x, NUMBER) for x in c) else []

    @property
    def test_images(self) -> int | None:
        return sum(self.test_class_counts) or None

    @property
    def uniform_metrics(self) -> UniformMetrics:
        return UniformMetrics.of(self._get("uniform_metrics"))

    @property
    def sites(self) -> dict[str, SiteScores]:
        """Site name -> its scores, in the order written; {} for a run without sites."""
        sites = self._get("sites")
        return {str(k): SiteScores.of(v) for k, v in sites.items()} if isinstance(sites, dict) else {}

    @property
    def site_mean(self) -> SiteScores:
        return SiteScores.of(self._get("site_mean"))

    @property
    def pooled_balanced_accuracy(self) -> Any:
        return self._get("pooled_balanced_accuracy")


class Verification(Record):
    """The export's check of the graph (tafl.packaging.export.verify): ONNX Runtime against PyTorch."""

    @property
    def checker(self) -> str | None:
        return self._get("checker")

    @property
    def onnxruntime(self) -> str | None:
        return self._get("onnxruntime")

    @property
    def batch_sizes(self) -> list | None:
        return self._get("batch_sizes")

    @property
    def max_abs_prob_diff(self) -> float:
        return self._get("max_abs_prob_diff", 0)

    @property
    def max_abs_heatmap_diff(self) -> float:
        return self._get("max_abs_heatmap_diff", 0)


# ------------------------------------------------------------------ the model's contract
@dataclass(frozen=True)
class PreprocessSpec:
    """tafl.imaging.Preprocess as recorded: a decoded image becomes the graph's input by these numbers."""

    size: int  # square side the graph takes, pixels
    channels: int  # 1 (grey) or 3 (RGB)
    mean: tuple[float, ...]  # per channel, on the [0, 1] scale
    std: tuple[float, ...]
    resample: str = "bilinear"  # Pillow's filter
    resize: str = "squash"  # the whole image to size x size

    @classmethod
    def read(cls, r: Reader) -> PreprocessSpec:
        return cls(r("size", (int,)), r("channels", (int,)), r.numbers("mean"), r.numbers("std"),
                   r("resample", (str,), optional=True, default="bilinear"),
                   r("resize", (str,), optional=True, default="squash"))

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "channels": self.channels, "mean": list(self.mean), "std": list(self.std),
                "resample": self.resample, "resize": self.resize}


@dataclass(frozen=True)
class InputSpec:
    """The graph's image input: its name, shape (batch, C, H, W), dtype, and the preprocessing that makes it."""

    name: str
    shape: tuple  # ("batch", C, H, W)
    dtype: str
    preprocess: PreprocessSpec
    preprocessing: str | None = None  # the same in words

    @classmethod
    def read(cls, r: Reader) -> InputSpec:
        name, shape, dtype = r("name", (str,)), r("shape", (list,)), r("dtype", (str,))
        text = r("preprocessing", STR_OR_NULL, optional=True)
        pre = r.object("preprocess")
        return cls(name, tuple(shape or ()), dtype, PreprocessSpec.read(pre) if pre else None, text)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype,
                "preprocessing": self.preprocessing, "preprocess": self.preprocess.to_json()}


COLOURS = ("colour", "greyscale")
_CODE_RE = re.compile(r"^[A-Z0-9_]{1,16}$")  # a DICOM code string such as a Modality


@dataclass(frozen=True)
class InputDomain:
    """The images the model was trained on (docs/design.md, "The input domain"): Modality codes, SOP class names and
    colour or greyscale, each field's `source`, and the learned `detector`. Its rules: tafl.packaging.domain."""

    modalities: tuple[str, ...] = ()
    sop_classes: tuple[str, ...] = ()
    colour: str | None = None  # "colour" | "greyscale" | None (mixed, or unknown)
    source: Mapping[str, str] = field(default_factory=dict)  # field -> "training data" | "declared at export"
    detector: Detector = field(default_factory=lambda: Detector())

    def __bool__(self) -> bool:  # whether there are header rules (the learned detector is apart)
        return bool(self.modalities or self.sop_classes or self.colour)

    @classmethod
    def read(cls, r: Reader | None) -> InputDomain:
        if r is None:
            return cls()
        mods = r("modalities", (list,), optional=True, default=[])
        if not all(isinstance(m, str) and _CODE_RE.match(m) for m in mods):
            r.problem("modalities", "must be a list of DICOM Modality codes (e.g. 'XC')")
            mods = []
        sops = r("sop_classes", (list,), optional=True, default=[])
        if not all(isinstance(c, str) and c for c in sops):
            r.problem("sop_classes", "must be a list of SOP class names")
            sops = []
        colour = r("colour", STR_OR_NULL, optional=True)
        if colour is not None and colour not in COLOURS:
            r.problem("colour", f"is {colour!r}, expected one of {', '.join(COLOURS)} or null")
            colour = None
        source = r("source", (dict,), optional=True, default={})
        detector = Detector.read(r, "detector")
        if detector.fitted and detector.threshold is None:
            r.problem("detector", "is fitted without a numeric threshold")
        return cls(tuple(mods), tuple(sops), colour, {str(k): str(v) for k, v in source.items()}, detector)

    def to_json(self) -> dict[str, Any]:
        out = {"modalities": list(self.modalities), "sop_classes": list(self.sop_classes), "colour": self.colour,
               "source": dict(self.source)}
        if self.detector.fields is not None:
            out["detector"] = self.detector.to_json()
        return out


@dataclass(frozen=True)
class OutputSpec:
    """One graph output: name, shape (symbolic "batch" first), dtype (int64 or float32), what it means."""

    name: str
    shape: tuple
    dtype: str
    description: str | None = None

    @classmethod
    def read(cls, r: Reader) -> OutputSpec:
        return cls(r("name", (str,)), tuple(r("shape", (list,)) or ()), r("dtype", (str,)),
                   r("description", STR_OR_NULL, optional=True))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "description": self.description}


@dataclass(frozen=True)
class Expert:
    """One expert of an ensemble, in the order of the graph's expert outputs, and its weight in the vote."""

    name: str
    weight: float

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "weight": self.weight}


@dataclass(frozen=True)
class Vote:
    """How the experts' votes decide the label: the rule (hard, soft, learned), the weights and the tie rule."""

    rule: str | None = None
    weights: tuple = ()
    tie_break: str | None = None

    @classmethod
    def read(cls, r: Reader) -> Vote:
        return cls(r("rule", STR_OR_NULL, optional=True), tuple(r("weights", (list,), optional=True) or ()),
                   r("tie_break", STR_OR_NULL, optional=True))

    def to_json(self) -> dict[str, Any]:
        return {"rule": self.rule, "weights": list(self.weights), "tie_break": self.tie_break}


@dataclass(frozen=True)
class PriorSpec:
    """Prior-aware inference (tafl.prior): the graph's optional input (`log_prior_ratio`, log q − log source_prior,
    one row or one per image, zeros by default), the calibration inside the graph, the source prior the ratio is
    relative to, and how `prior=adaptive` estimates the served mix. Only `source_prior` is read by tafl; the rest
    describes the graph for people and other clients."""

    source_prior: tuple[float, ...]  # (C,): the class mix the calibrated posteriors describe
    input: str = "log_prior_ratio"
    shape: Any = None
    dtype: str | None = None
    default: str | None = None
    rule: str | None = None
    posteriors: str | None = None  # which log-probabilities the calibration applies to
    calibration: str | None = None  # none, temperature, bcts, vector
    temperature: Any = None
    scale: Any = None
    bias: Any = None
    class_scale: Any = None
    fit: Mapping[str, Any] | None = None
    estimator: Estimator = field(default_factory=Estimator)
    adaptive_check: AdaptiveCheck = field(default_factory=AdaptiveCheck)

    @classmethod
    def read(cls, r: Reader, num_classes: int) -> PriorSpec:
        opt = {"optional": True}
        return cls(r.numbers("source_prior", length=num_classes or None),
                   r("input", (str,), optional=True, default="log_prior_ratio"),
                   r("shape", (list,), **opt), r("dtype", STR_OR_NULL, **opt), r("default", STR_OR_NULL, **opt),
                   r("rule", STR_OR_NULL, **opt), r("posteriors", STR_OR_NULL, **opt),
                   r("calibration", STR_OR_NULL, **opt),
                   r("temperature", NUMBER + (type(None),), **opt), r("scale", NUMBER + (type(None),), **opt),
                   r("bias", (list, type(None)), **opt), r("class_scale", (list, type(None)), **opt),
                   r("fit", (dict, type(None)), **opt), Estimator.read(r, "estimator"),
                   AdaptiveCheck.read(r, "adaptive_check"))

    def to_json(self) -> dict[str, Any]:
        return {"input": self.input, "shape": self.shape, "dtype": self.dtype, "default": self.default,
                "rule": self.rule, "posteriors": self.posteriors, "calibration": self.calibration,
                "temperature": self.temperature, "scale": self.scale, "bias": self.bias,
                "class_scale": self.class_scale, "source_prior": list(self.source_prior), "fit": self.fit,
                "estimator": self.estimator.to_json(), "adaptive_check": self.adaptive_check.to_json()}


@dataclass(frozen=True)
class PackageMetadata:
    """A package's metadata.json (see the module's text for its parts). Build it at export and write `to_json()`;
    read it with `from_json`, which checks, migrates and refuses."""

    name: str
    version: str  # semantic, MAJOR.MINOR.PATCH
    created: str  # ISO 8601, UTC
    method: str  # fedavg, fedprox, creff, gtafl, dafl, lda (tafl.training.methods)
    backbone: str
    class_names: tuple[str, ...]
    input: InputSpec
    outputs: tuple[OutputSpec, ...]
    heatmap: str  # how the heatmap output is made, in words
    training: Training
    data_provenance: Provenance
    metrics: Metrics  # false without an evaluation report at export
    intended_use: str
    limitations: tuple[str, ...]
    schema: str = SCHEMA
    parent_version: str | None = None
    parent: Parent = field(default_factory=Parent)
    tafl_version: str | None = None
    model_config: Mapping[str, Any] | None = None  # tafl.training.models.ModelConfig, as saved
    task: str | None = None
    experts: tuple[Expert, ...] = ()  # empty for a single-head model
    vote: Vote | None = None  # None for a single-head model
    decision: Decision = field(default_factory=Decision)
    prior: PriorSpec | None = None  # None: the graph predates prior-aware inference
    privacy: Privacy = field(default_factory=Privacy)
    verification: Verification = field(default_factory=Verification)
    class_codes: Any = None  # per class {"value", "scheme", "meaning"} for DICOM SRs (tafl.imaging.dicom_sr)
    domain: InputDomain = field(default_factory=InputDomain)  # empty: no header rule (a package from before them)
    sets: Sets = field(default_factory=Sets)  # conformal prediction sets; empty: a package from before them
    extra: Mapping[str, Any] = field(default_factory=dict)  # keys this tafl does not know, kept as they were

    @property
    def schema_version(self) -> int:
        return schema_version(self.schema)

    @property
    def expert_names(self) -> list[str]:
        return [e.name for e in self.experts]

    def with_class_codes(self, codes: Mapping[str, Any]) -> PackageMetadata:
        return replace(self, class_codes=codes)

    @classmethod
    def from_json(cls, raw: Any, where: str = "metadata.json") -> PackageMetadata:
        """The metadata in `raw` (metadata.json's object), checked; metadata of an older schema is migrated first.
        PackageError naming `where` and every problem's field; one from a newer tafl names both versions."""
        if not isinstance(raw, dict):
            raise PackageError(f"{where}: expected a JSON object")
        if "schema" not in raw:
            raise PackageError(f"{where}: missing 'schema'")
        raw = migrate(raw, schema_version(raw["schema"], where))
        problems: list[str] = []
        meta = cls._read(Reader(raw, "", problems))
        if problems:
            raise PackageError(f"{where}: " + "; ".join(problems))
        return meta

    @classmethod
    def _read(cls, r: Reader) -> PackageMetadata:
        """Every field in the order export writes them, so the problems are listed in the file's order."""
        head = dict(schema=r("schema", (str,)), name=r("name", (str,)), version=r.semver("version"),
                    parent_version=r.semver("parent_version", nullable=True), parent=Parent.read(r, "parent"),
                    created=r("created", (str,)), tafl_version=r("tafl_version", STR_OR_NULL, optional=True),
                    method=r("method", (str,)), backbone=r("backbone", (str,)),
                    model_config=r("model_config", (dict, type(None)), optional=True),
                    task=r("task", STR_OR_NULL, optional=True))
        names = r("class_names", (list,))
        if names is not None and (not names or not all(isinstance(c, str) for c in names)):
            r.problems.append("'class_names' must be a non-empty list of strings")
        names = tuple(names or ())
        inp = r.object("input")
        outputs = tuple(OutputSpec.read(o) for o in r.objects("outputs"))
        experts = tuple(Expert(e("name", (str,)), e("weight", NUMBER)) for e in r.objects("experts"))
        _check_outputs(outputs, bool(experts), r)
        vote = r("vote", (dict, type(None)))
        decision = Decision.read(r, "decision")
        prior = r.object("prior", optional=True)
        domain = InputDomain.read(r.object("domain", optional=True))
        if domain.detector.threshold is not None and "domain_distance" not in {o.name for o in outputs}:
            r.problems.append("'domain.detector' is fitted, but 'outputs' lack 'domain_distance'")
        sets = Sets.read(r, "sets")
        sets.check(len(names), {o.name for o in outputs}, r)
        return cls(**head, class_names=names, input=InputSpec.read(inp) if inp else None, outputs=outputs,
                   experts=experts, vote=None if vote is None else Vote.read(Reader(vote, "vote", r.problems)),
                   decision=decision, prior=PriorSpec.read(prior, len(names)) if prior else None,
                   heatmap=r("heatmap", (str,)), training=Training.read(r, "training", nullable=False),
                   data_provenance=Provenance.read(r, "data_provenance", nullable=False),
                   privacy=Privacy.read(r, "privacy"), metrics=Metrics.read(r, "metrics", optional=False),
                   intended_use=r("intended_use", (str,)), limitations=tuple(r("limitations", (list,)) or ()),
                   verification=Verification.read(r, "verification"),
                   class_codes=r("class_codes", (object,), optional=True),
                   domain=domain, sets=sets,
                   extra={k: v for k, v in r.obj.items() if k not in _KNOWN})

    def to_json(self) -> dict[str, Any]:
        """metadata.json's object, keys in the order export has always written them."""
        out = {"schema": self.schema, "name": self.name, "version": self.version,
               "parent_version": self.parent_version, "parent": self.parent.to_json(), "created": self.created,
               "tafl_version": self.tafl_version, "method": self.method, "backbone": self.backbone,
               "model_config": None if self.model_config is None else dict(self.model_config), "task": self.task,
               "class_names": list(self.class_names), "input": self.input.to_json(),
               "outputs": [o.to_json() for o in self.outputs], "experts": [e.to_json() for e in self.experts],
               "vote": None if self.vote is None else self.vote.to_json(), "decision": self.decision.to_json(),
               "prior": None if self.prior is None else self.prior.to_json(), "heatmap": self.heatmap,
               "training": self.training.to_json(), "data_provenance": self.data_provenance.to_json(),
               "privacy": self.privacy.to_json(), "metrics": self.metrics.to_json(),
               "intended_use": self.intended_use, "limitations": list(self.limitations),
               "verification": self.verification.to_json()}
        if self.class_codes is not None:  # only where export was given codes
            out["class_codes"] = self.class_codes
        out["domain"] = self.domain.to_json()
        if self.sets.fields is not None:
            out["sets"] = self.sets.to_json()
        return {**out, **self.extra}


_KNOWN = frozenset(("schema", "name", "version", "parent_version", "parent", "created", "tafl_version", "method",
                    "backbone", "model_config", "task", "class_names", "input", "outputs", "experts", "vote",
                    "decision", "prior", "heatmap", "training", "data_provenance", "privacy", "metrics",
                    "intended_use", "limitations", "verification", "class_codes", "domain", "sets"))


def _check_outputs(outputs: tuple[OutputSpec, ...], ensemble: bool, r: Reader) -> None:
    """Every graph answers label, probs and heatmap; an ensemble's also each expert's label and probabilities and
    the vote totals."""
    have = {o.name for o in outputs}
    lacking = [n for n in OUTPUTS + (EXPERT_OUTPUTS if ensemble else ()) if n not in have]
    if lacking and "outputs" in r.obj:
        r.problems.append(f"'outputs' lack {sorted(lacking)}")


def schema_version(schema: Any, where: str = "metadata.json") -> int:
    """N of "tafl-model-package/N"; PackageError for another format, and for a version newer than this tafl's."""
    m = _SCHEMA_RE.match(schema) if isinstance(schema, str) else None
    if m is None:
        raise PackageError(f"{where}: schema {schema!r} is not a tafl model package's; this tafl reads {SCHEMA!r}")
    n = int(m[1])
    if n > SCHEMA_VERSION:
        raise PackageError(f"{where}: written by a newer tafl (schema {schema!r}); this tafl ({__version__}) reads "
                           f"{SCHEMA!r} and older: upgrade tafl to load it")
    if n < 1:
        raise PackageError(f"{where}: schema {schema!r} does not exist; this tafl reads {SCHEMA!r}")
    return n


def migrate(raw: dict[str, Any], version: int) -> dict[str, Any]:
    """Metadata of schema `version` as this tafl's version: each step of MIGRATIONS in turn, then the keys later
    releases added to version 1 filled in as their absence meant (ADDED_IN_1). `raw` itself is not changed."""
    for n in range(version, SCHEMA_VERSION):
        raw = MIGRATIONS[n](dict(raw))
    missing = {k: v for k, v in ADDED_IN_1.items() if k not in raw}
    return {**raw, **missing} if missing else raw


def listing(raw: Any) -> dict[str, Any]:
    """What `tafl list` shows of a metadata.json, also of one that is refused: name, version, parent_version,
    method, created, and the average, backward50 and forward50 accuracy; None for what it lacks."""
    raw = raw if isinstance(raw, dict) else {}
    m = Metrics.of(raw.get("metrics"))
    return {"name": raw.get("name"), "version": raw.get("version"), "parent_version": raw.get("parent_version"),
            "method": raw.get("method"), "created": raw.get("created"), "average_accuracy": m.average_accuracy,
            "backward50": m.accuracy.get("backward50"), "forward50": m.accuracy.get("forward50")}
