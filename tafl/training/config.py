"""Run configuration: the shared settings in one typed dataclass, every field commented, loaded from YAML and flags.

A method's own settings live in its typed config (`tafl.training.contract.MethodConfig`, registered with the
method: `tafl.training.methods.gtafl_config.GTAFLConfig`, ...), which validates itself and says what the method
needs of the shared settings. The keys stay flat everywhere a user or a file sees them: `configs/*.yaml`, the flags
(`--gff-m`), run.json, a checkpoint's and a report's config (`RunConfig.to_dict`), and attribute access
(`cfg.gff_m` reads the GTAFL config's field); `cfg.settings()` is the running method's config, typed.

`configs/*.yaml` hold named configurations; command-line flags override the file; unknown keys
and values of the wrong type or range are `ConfigError`s naming the key. The resolved config is
saved in every checkpoint and report, so a run can be repeated and resumed from it alone.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tafl.errors import ConfigError
from tafl.prior import CALIBRATIONS  # numpy only: the one list of calibration kinds
from tafl.training.decision import CRITERIA as DECISION_CRITERIA  # numpy only
from tafl.training.decision import KINDS as DECISIONS
from tafl.training.longtail import HOLDOUT_MODES  # numpy only
from tafl.training.contract import MethodConfig, config_class, config_classes, config_fields, setting_owner
from tafl.training.methods import method_names  # the one registry; importing it loads no method (nor torch)

PARTITIONS = ("equal", "dirichlet")

# The one list of allowed values for every shared string option with a fixed set: `validate` checks them and the
# command line offers them as `choices`, so `tafl train --help` and a bad config name the same values. The
# methods and their settings' choices are read from their registry at each call (`choices()`), so a registered
# method is a valid value.
FIXED_CHOICES: dict[str, tuple[str, ...]] = {
    "folder_frames": ("each", "refuse"),
    "partition": PARTITIONS,
    "optimizer": ("sgd", "adam"),
    "augment_policy": ("none", "trivial", "randaugment"),
    "lr_schedule": ("constant", "cosine"),
    "simclr_pool": ("val", "test", "train"),
    "train_scope": ("all", "head"),
    "calibration": CALIBRATIONS,
    "calib_holdout_mode": HOLDOUT_MODES,
    "conformal_rows": ("pooled", "held_out"),
    "decision": DECISIONS,
    "decision_criterion": DECISION_CRITERIA,
    "tokenizer": ("patch", "conv"),
    "engine": ("simulator", "flower"),
    "select": ("last", "val"),
    "device": ("cpu", "cuda", "auto"),
}


SECAGG_MIN_CLIENTS = 3  # SecAgg+: a sum over two sites, one of them the server's own, would be the other's numbers


def choices() -> dict[str, tuple[str, ...]]:
    """Every string option's allowed values: the methods of the registry, FIXED_CHOICES and each registered
    method config's CHOICES."""
    own = {k: v for cls in config_classes() for k, v in cls.CHOICES.items()}
    return {"method": method_names(), **FIXED_CHOICES, **own}


def method_keys() -> dict[str, type[MethodConfig]]:
    """Every registered method setting (a flat key) and the config class that holds it."""
    keys = {k: cls for cls in config_classes() for k in config_fields(cls)}
    clash = sorted(set(keys) & set(shared_keys()))
    if clash:
        raise ConfigError(f"method setting(s) {', '.join(clash)} of {keys[clash[0]].__name__} clash with the shared "
                          "run settings of the same name")
    return keys


def shared_keys() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(RunConfig))


def flat_keys() -> tuple[str, ...]:
    """Every key a run configuration takes: the shared ones (RunConfig's fields), then each method's settings."""
    return (*shared_keys(), *method_keys())


@dataclass(eq=False)  # equality compares every setting, the methods' too (__eq__)
class RunConfig:
    # --- what to train ---
    # fedavg | fedprox | creff | gtafl | dafl | lda (tafl.training.methods: the registry). lda: the sites train nothing;
    # each sends its class sums of the fixed extractor's whitened features once, and the server fits a linear
    # discriminant head (train_scope head; under DP two Gaussian releases in all: docs/decisions.md, "Method lda")
    method: str = "fedavg"
    # --- data ---
    dataset: str = "digits"  # digits (embedded) | a MedMNIST flag (dermamnist, ...) | folder
    data_root: str | None = None  # MedMNIST: folder holding <flag>.npz; folder: the image folder's root
    labels: str | None = None  # folder: the labels CSV (relative to data_root or absolute)
    image_column: str = "image_id"  # folder: CSV column naming the image file (extension optional)
    label_column: str = "label"  # folder: CSV column holding the class name
    group_column: str | None = None  # folder: CSV column whose groups never straddle two splits (lesion_id)
    image_dir: str | None = None  # folder: where the images lie (default: data_root/images if present, else data_root)
    # folder: a multi-frame DICOM gives one sample per frame (each; the frames of one file stay in one split) or is
    # refused with a message naming it (refuse)
    folder_frames: str = "each"
    # folder: one federated client per value of this CSV column (real sites, e.g. center_name); no Dirichlet split
    # and no synthetic long tail (each site keeps its own), so clients, alpha, partition and imbalance_factor do not
    # apply
    client_column: str | None = None
    # folder: the split of each row from this CSV column (train, test, and val if present); without val rows,
    # val_fraction of each site's training rows (by group_column) is held out for validation, never test rows
    split_column: str | None = None
    # train one model on every client's training rows together, no federation: the pooled (centralised) ceiling a
    # federated run is measured against; with client_column each site is still evaluated on its own test rows
    centralised: bool = False
    # folder with client_column: decode only this site's rows (what one Flower SuperNode holds); the class list and
    # the site names still come from the whole CSV, so the site's labels index the federation's classes
    site: str | None = None
    # train without this class (its name): its test images become an unseen class the in-domain detector's report
    # measures it on (how well images of a finding the model never learned are flagged); None: every class
    open_set_class: str | None = None
    # a folder of DICOM files added to the far-out-of-domain DICOM set the in-domain detector's report measures
    # (pydicom's own test files are always in it)
    ood_dicom_dir: str | None = None
    download: bool = False  # MedMNIST: download the npz when it is missing (needs a network)
    val_fraction: float = 0.15  # digits/folder: share of the data held out for validation
    test_fraction: float = 0.2  # digits/folder: share of the data held out for testing
    img_size: int | None = None  # square input side in pixels; None keeps the dataset's own (28 for MedMNIST)
    channels: int | None = None  # 1 or 3; None keeps the dataset's own
    cache_dir: str | None = None  # decoded image-folder cache (default ~/.cache/tafl); "" turns it off
    # --- long tail and clients ---
    imbalance_factor: float | None = 50.0  # IF of the exponential long tail; None keeps the natural distribution
    clients: int = 20  # K, number of simulated clients
    alpha: float = 0.5  # Dirichlet concentration over classes (smaller = more heterogeneous)
    partition: str = "equal"  # equal: CReFF's equal-size Dirichlet split; dirichlet: the free split
    frac: float = 0.4  # share of clients taking part in each round
    # --- local training ---
    rounds: int = 20  # communication rounds
    local_epochs: int = 5  # epochs over the local data per round
    batch_size: int = 32  # local mini-batch size
    lr: float = 0.1  # local SGD learning rate
    momentum: float = 0.0  # local SGD momentum
    weight_decay: float = 0.0  # local SGD weight decay
    optimizer: str = "sgd"  # local optimizer: sgd | adam (DAFL's paper uses Adam, lr 1e-4)
    augment: bool = True  # random crop (pad 1/8 of the side) and horizontal flip during local training
    # extra augmentation on top of crop and flip: none | trivial (timm's TrivialAugment-style wide policy,
    # one random op per image) | randaugment (timm's RandAugment, 2 ops at magnitude 9)
    augment_policy: str = "none"
    lr_schedule: str = "constant"  # constant | cosine: the local lr follows a cosine over the rounds
    warmup_rounds: int = 0  # rounds of linear lr warm-up before the schedule (from lr/warmup_rounds)
    # --- the server's unlabeled pool: SimCLR pre-training (pretrain_steps), GTAFL's SimCLR, the head basis ---
    simclr_pool: str = "val"  # unlabeled server images: val | test (transductive, as the paper) | train
    simclr_batch: int = 64  # images per SimCLR step (two views each)
    simclr_tau: float = 0.5  # NT-Xent temperature
    simclr_proj_dim: int = 128  # projection head output size
    # --- calibration and prior-aware inference (tafl.prior) ---
    # calibration fitted federatedly after training, on the clients' held-out rows (only NLL sums, gradients and
    # Hessians of at most 2C numbers leave a client): none | temperature | bcts (temperature and per-class biases) |
    # vector (per-class scales and biases; docs/decisions.md, "EM's error is calibration bias")
    calibration: str = "none"
    calib_holdout: float = 0.0  # share of every client's rows held out of training for the calibration; 0: none
    # which rows: rows (at random, the client's mix) | classes (the same number shared evenly among the client's
    # classes, each giving at most 30 % of its rows: more rare-class images for the fit; docs/decisions.md, "Class-balanced hold-out")
    calib_holdout_mode: str = "rows"
    calib_rounds: int = 25  # calibration Newton rounds at most
    # ship the fitted calibration only where it lowers the NLL of the validation split, which it was not fitted on,
    # by more than that split's noise (a one-sided 95 % bound; tafl.training.calibrate.check_calibration); otherwise
    # the uncalibrated posteriors ship and the report says so
    calibration_check: bool = True
    calib_l2: float = 1.0  # L2 penalty on the biases and on the spread of vector scaling's per-class scales
    # the plain decision's operating point: argmax | validation (label = argmax(z − τ·log π), τ chosen on the
    # validation split: post-hoc logit adjustment, tafl.training.decision; the probabilities are unchanged).
    # GTAFL and CReFF: every expert's bias moves by the same −τ·log π, τ from −1 to 1 chosen by the vote's
    # validation criterion (the experts' probabilities carry the move; docs/decisions.md, "Shifted experts")
    decision: str = "argmax"
    # what τ maximises on validation: macro_f1 (the macro F1 under a uniform class prior) | mixes (the mean over the
    # eleven case mixes of the prior-weighted accuracy, what the report measures; it chose the same τ in most runs
    # and a worse one where they differed: docs/decisions.md, "The operating point for the whole range of mixes")
    decision_criterion: str = "macro_f1"
    adapt_sizes: str = "100,500"  # unlabeled images per prior estimate in the evaluation, comma-separated
    adapt_draws: int = 5  # draws of unlabeled images per distribution and size in the evaluation
    # the case-mix estimator's Dirichlet smoothing toward the uniform mix, in pseudo-images (tafl.prior.PriorEstimator):
    # auto (chosen on the validation split among tafl.prior.SMOOTHING_GRID, docs/decisions.md, "The smoothed estimator") or a number >= 0
    # (0: the maximum-likelihood EM)
    prior_smoothing: str | float = "auto"
    # --- privacy (tafl.training.privacy, docs/design.md, "What leaves a site") ---
    # record-level differential privacy: the run's ε per training image at every site, over the whole run (every
    # round, every release); null (or inf): no DP. DP-SGD (Opacus) trains each client, its class counts and its
    # class statistics and expert gradients are released with Gaussian noise, one RDP accountant bounds them all
    dp_epsilon: float | None = None
    dp_delta: float = 1e-5  # the run's δ; must be below 1 / (the smallest site's record count)
    dp_clip: float = 1.0  # DP-SGD's per-image gradient norm bound
    # the per-image feature norm bound of released class statistics and expert gradients, per √(feature dimension):
    # F = dp_feature_clip·√D (the GroupNorm ResNet-8's per-image feature norm is about 0.74·√D at its median;
    # docs/results.md, "What leaves a site")
    dp_feature_clip: float = 0.8
    # the statistics releases' noise multiplier over DP-SGD's (they are not subsampled: each costs far more budget
    # than a DP-SGD step at the same multiplier)
    dp_stats_ratio: float = 3.0
    # Flower engine: every quantity the server only needs summed travels through Flower's SecAgg+ (docs/flower.md)
    secure_aggregation: bool = False
    # fit the in-domain detector after training (tafl.training.detector): one more round of per-class feature sums
    # and second moments; with dp_epsilon one more Gaussian release, which the accountant counts from the start
    domain_detector: bool = True
    # fit class-conditional conformal prediction sets after training (tafl.training.sets; tafl.conformal): one more
    # round in which each site sends a histogram per class of its held-out rows' scores (without held-out rows: the
    # server's validation split; under dp_epsilon the validation split alone, no site's rows)
    conformal: bool = True
    # the sets' calibration rows where the clients hold rows out: pooled (their held-out rows and the server's
    # validation split, whose rows no calibration was fitted on: more rows of the rare classes, whose thresholds
    # are loosest) | held_out (the clients' rows alone, for a server whose validation images come from elsewhere)
    conformal_rows: str = "pooled"
    # the sets' guarantee: each class's coverage reaches its level with this probability over the calibration rows'
    # draw (training-conditional: one package's coverage, not the average over packages; a class with too few rows
    # for it is always in the set); none: on average over the draw (split conformal's guarantee, smaller sets)
    set_confidence: float | None = 0.9
    # what the sites train: all (the whole network) | head (the classifier head only, on the fixed extractor's
    # features of their images as they are, in a whitened basis of head_basis_dim directions the server computes from
    # its unlabeled pool; the extractor stays as the server made it: its seeded initialisation, --pretrain-steps,
    # GTAFL's SimCLR). null: head with --dp-epsilon (DP-SGD's noise grows with the square root of the parameters it
    # trains: docs/decisions.md, "The head under DP"), all without
    train_scope: str | None = None
    head_basis_dim: int = 64  # train_scope head: the server pool's principal directions the sites' head step spans
    # server-side SimCLR steps on the unlabeled server pool (simclr_pool) before round 1, which spend no site's privacy
    # budget; 0: none
    pretrain_steps: int = 0
    pretrain_lr: float = 0.1  # the pre-training's SGD learning rate (momentum 0.9; simclr_batch images a step)
    # --- model ---
    backbone: str = "resnet8"  # resnet8, vit_tafl_tiny, or any timm ViT name
    width: float = 1.0  # resnet8 width multiplier: 1.0 = the paper's 64-128-256 channels
    patch_size: int | None = None  # ViT patch side; None: the backbone's choice for img_size
    embed_dim: int | None = None  # ViT width override
    depth: int | None = None  # ViT depth override
    num_heads: int | None = None  # ViT heads override
    # ViT tokens: patch (timm's linear patch embedding) | conv (a conv stem, trains from scratch)
    tokenizer: str = "patch"
    pretrained: str | None = None  # path to local weights, or "hub" to download (needs a network)
    # --- run ---
    engine: str = "simulator"  # simulator (in-process) | flower (Flower's simulation engine; see docs/flower.md)
    flower_timeout: float = 600.0  # Flower: seconds the server waits for the round's replies
    flower_wait_s: float = 60.0  # Flower: seconds to wait for the SuperNodes to connect
    seed: int = 7  # seeds data split, long tail, partition, client selection and training
    eval_every: int = 1  # validate every N rounds (the last round is always validated)
    select: str = "last"  # last: keep the last round; val: keep the round with the best validation balanced accuracy
    test_seed: int = 0  # seed of the sampled test subsets
    eval_batch_size: int = 256  # batch size for validation and test inference
    threads: int | None = None  # torch intra-op threads; None: torch's default
    device: str = "cpu"  # cpu | cuda | auto
    keep_checkpoints: int = 2  # per-round checkpoints kept in OUT/checkpoints

    # ------------------------------------------------------------------ the methods' own settings
    def __post_init__(self) -> None:
        object.__setattr__(self, "_settings", {})  # config class -> its instance, made when first used

    def settings_of(self, cls: type[MethodConfig]) -> MethodConfig:
        """This run's instance of a method config class (its defaults until a key of it is set)."""
        have: dict[type[MethodConfig], MethodConfig] = self.__dict__["_settings"]
        if cls not in have:
            have[cls] = cls()
        return have[cls]

    def settings(self) -> MethodConfig:
        """The running method's own settings (`cfg.settings().gff_m` for GTAFL), typed."""
        return self.settings_of(config_class(self.method))

    def __getattr__(self, name: str) -> Any:  # only for names that are not shared fields: a method's setting
        cls = setting_owner(name) if not name.startswith("_") else None
        if cls is None:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        return getattr(self.settings_of(cls), name)

    def __setattr__(self, name: str, value: Any) -> None:
        cls = setting_owner(name) if name not in _SHARED else None
        if cls is None:
            object.__setattr__(self, name, value)
        else:
            setattr(self.settings_of(cls), name, value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunConfig) and self.to_dict() == other.to_dict()

    def __copy__(self) -> RunConfig:  # a copy owns its method settings too: changing one leaves the other alone
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        object.__setattr__(new, "_settings", {cls: copy.copy(part) for cls, part in self.__dict__["_settings"].items()})
        return new

    # ------------------------------------------------------------------
    def adapt_size_list(self) -> list[int]:
        return [int(v) for v in str(self.adapt_sizes).split(",") if v.strip()]

    def prior_smoothing_value(self) -> float | None:
        """None for auto (chosen on validation), else the fixed pseudo-count; ValueError for anything else."""
        raw = str(self.prior_smoothing).strip().lower()
        if raw == "auto":
            return None
        try:
            v = float(raw)
        except ValueError:
            raise ValueError(f"must be auto or a number of pseudo-images >= 0, got {self.prior_smoothing!r}") from None
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"must be auto or a finite number >= 0, got {self.prior_smoothing!r}")
        return v

    def to_dict(self) -> dict[str, Any]:
        """The flat dict of every setting (the shared ones, then each method's): run.json, a checkpoint's
        run_config and a report's config."""
        out = dataclasses.asdict(self)
        for cls in config_classes():
            out.update(dataclasses.asdict(self.settings_of(cls)))
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> RunConfig:
        cfg = cls()
        cfg.update(data, source)
        return cfg

    def update(self, data: dict[str, Any], source: str = "config") -> RunConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a mapping of keys to values, got {type(data).__name__}")
        owners = method_keys()
        names = set(_SHARED) | set(owners)
        hints = typing.get_type_hints(type(self))
        for key, value in data.items():
            norm = str(key).replace("-", "_")
            if norm not in names:
                close = difflib.get_close_matches(norm, sorted(names), n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise ConfigError(f"{source}: unknown config key '{key}'{hint}")
            hint_of = hints[norm] if norm in hints else typing.get_type_hints(owners[norm])[norm]
            setattr(self, norm, _coerce(norm, value, hint_of, source))
        return self

    def bad(self, key: str, why: str) -> ConfigError:
        """The error for setting `key` (its value named): what a validation rule raises."""
        return ConfigError(f"config '{key}' = {getattr(self, key)!r}: {why}")

    def validate(self) -> RunConfig:
        """Every setting in range and the combination runnable; fills train_scope when unset. The running method's
        config adds its own rules (`MethodConfig.check_run`, `check_private`); every method config checks its
        values whichever method runs."""
        bad = self.bad
        own = self.settings() if self.method in method_names() else MethodConfig()  # unknown: refused below
        if self.train_scope is None:  # DP-SGD trains the head only unless told otherwise (docs/decisions.md, "The head under DP")
            private = self.dp_epsilon is not None and not (math.isinf(self.dp_epsilon) and self.dp_epsilon > 0)
            self.train_scope = own.default_train_scope(private)
        for key, allowed in choices().items():
            if getattr(self, key) not in allowed:
                raise bad(key, ("unknown method; " if key == "method" else "") + f"choose one of {', '.join(allowed)}")
        self._validate_ranges()
        for cls in config_classes():
            part = self.settings_of(cls)
            part.check(self)
            if part is not own:
                part.check_unused(self)
        self._validate_data()
        self._validate_privacy(own)
        if self.client_column and self.imbalance_factor is not None:
            raise bad("imbalance_factor", "with client_column every site keeps its own long tail; set it to null "
                                          "(--imbalance-factor none)")
        return self

    def _validate_ranges(self) -> None:
        """The shared numbers in range."""
        bad = self.bad
        if self.imbalance_factor is not None and not self.imbalance_factor >= 1:
            raise bad("imbalance_factor", "the imbalance factor must be >= 1 (or null for the natural distribution)")
        if not self.alpha > 0:
            raise bad("alpha", "the Dirichlet concentration must be > 0")
        if self.clients < 1:
            raise bad("clients", "need at least one client")
        if not 0 < self.frac <= 1:
            raise bad("frac", "the participation fraction must be in (0, 1]")
        for key in ("rounds", "local_epochs", "batch_size", "eval_every", "eval_batch_size", "keep_checkpoints"):
            if getattr(self, key) < 1:
                raise bad(key, "must be >= 1")
        for key in ("lr",):
            if not getattr(self, key) > 0:
                raise bad(key, "must be > 0")
        for key in ("momentum", "weight_decay"):
            if not getattr(self, key) >= 0:
                raise bad(key, "must be >= 0")
        for key in ("val_fraction", "test_fraction"):
            if not 0 < getattr(self, key) < 0.5:
                raise bad(key, "must be in (0, 0.5)")
        if self.img_size is not None and not 4 <= self.img_size <= 1024:
            raise bad("img_size", "must be between 4 and 1024 pixels")
        if self.channels not in (None, 1, 3):
            raise bad("channels", "must be 1 or 3")
        if not self.width > 0:
            raise bad("width", "must be > 0")
        for key in ("simclr_proj_dim", "head_basis_dim"):
            if getattr(self, key) < 1:
                raise bad(key, "must be >= 1")
        if self.simclr_batch < 2:
            raise bad("simclr_batch", "must be >= 2 (NT-Xent needs negatives)")
        for key in ("pretrain_steps",):
            if getattr(self, key) < 0:
                raise bad(key, "must be >= 0")
        for key in ("simclr_tau", "pretrain_lr"):
            if not getattr(self, key) > 0:
                raise bad(key, "must be > 0")
        if not self.flower_timeout > 0 or self.flower_wait_s < 0:
            raise bad("flower_timeout", "flower_timeout must be > 0 and flower_wait_s >= 0")
        if not 0 <= self.warmup_rounds < max(self.rounds, 1):
            raise bad("warmup_rounds", f"must be in [0, rounds={self.rounds})")
        self._validate_prior()

    def _validate_prior(self) -> None:
        """Calibration and the prior-aware evaluation's settings."""
        bad = self.bad
        if not (math.isfinite(self.calib_l2) and self.calib_l2 >= 0):
            raise bad("calib_l2", "must be a finite number >= 0")
        if not 0 <= self.calib_holdout < 0.5:
            raise bad("calib_holdout", "must be in [0, 0.5)")
        if self.calibration != "none" and self.calib_holdout <= 0:
            raise bad("calib_holdout", f"calibration '{self.calibration}' needs held-out client rows (e.g. 0.1)")
        if self.set_confidence is not None and not 0.5 <= self.set_confidence < 1:
            raise bad("set_confidence", "must be in [0.5, 1) (such as 0.9), or null for coverage on average")
        if self.calib_rounds < 1 or self.adapt_draws < 1:
            raise bad("calib_rounds", "calib_rounds and adapt_draws must be >= 1")
        try:
            sizes = self.adapt_size_list()
        except ValueError:
            sizes = []
        if not sizes or min(sizes) < 1:
            raise bad("adapt_sizes", "must be comma-separated image counts >= 1, e.g. 100,500")
        try:
            self.prior_smoothing_value()
        except ValueError as exc:
            raise bad("prior_smoothing", str(exc)) from None

    def _validate_data(self) -> None:
        """The data source's keys agree with each other."""
        bad = self.bad
        if self.dataset == "folder" and (not self.data_root or not self.labels):
            raise ConfigError("dataset 'folder' needs --data-root DIR and --labels FILE.csv")
        if self.site and not self.client_column:
            raise bad("site", "names one value of client_column; set --client-column too")
        for key in ("client_column", "split_column"):
            if getattr(self, key) and self.dataset != "folder":
                raise bad(key, "reads a column of the labels CSV: only for dataset 'folder'")
        if self.centralised and self.engine != "simulator":
            raise bad("centralised", "trains one model on pooled data: it runs in the simulator (--engine simulator)")

    def _validate_privacy(self, own: MethodConfig) -> None:
        """DP and secure aggregation: what each needs, refused before any data is read (δ against the sites'
        record counts is checked once the data are loaded: tafl.training.simulator). `own`: the running method's
        config, whose rules come first (train scope, secure aggregation) and in the DP checks."""
        bad = self.bad
        if self.dp_epsilon is not None and math.isinf(self.dp_epsilon) and self.dp_epsilon > 0:
            self.dp_epsilon = None  # ε = ∞: no DP
        own.check_run(self)
        if self.train_scope == "head" and self.simclr_pool == "train":
            raise bad("simclr_pool", "the head basis is computed on the server's own images: 'train' would give it the "
                                     "sites' training images; use val")
        if self.secure_aggregation and self.engine != "flower":
            raise bad("secure_aggregation", "runs on Flower's SecAgg+ workflow: use --engine flower (the in-process "
                                            "simulator has no separate parties to hide a client's numbers from)")
        if self.secure_aggregation:
            per_round = max(1, int(round(self.frac * self.clients)))
            if min(per_round, self.clients) < SECAGG_MIN_CLIENTS:
                raise bad("secure_aggregation", f"SecAgg+ hides one site's numbers in a sum over at least "
                                                f"{SECAGG_MIN_CLIENTS} sites, and this run has {per_round} a round "
                                                f"({self.clients} clients, frac {self.frac}): raise --clients/--frac")
        if self.dp_epsilon is None:
            return
        if not (math.isfinite(self.dp_epsilon) and self.dp_epsilon > 0):
            raise bad("dp_epsilon", "must be a number > 0 (or null / inf for no differential privacy)")
        if not 0 < self.dp_delta < 1:
            raise bad("dp_delta", "must be in (0, 1), and below 1 / the smallest site's number of images")
        for key in ("dp_clip", "dp_feature_clip", "dp_stats_ratio"):
            v = getattr(self, key)
            if not (math.isfinite(v) and v > 0):
                raise bad(key, "must be a finite number > 0")
        own.check_private(self)
        if self.backbone != "resnet8":
            raise bad("dp_epsilon", f"differential privacy trains the ResNet-8 (GroupNorm in place of BatchNorm, as "
                                    f"DP-SGD needs); backbone '{self.backbone}' is not supported")
        if self.calibration != "none":
            raise bad("calibration", "federated calibration's NLL sums have no per-image bound yet, so a DP run "
                                     "cannot release them: use --calibration none with --dp-epsilon")
        if self.simclr_pool == "train" and (own.uses_server_pool(self) or self.pretrain_steps):
            raise bad("simclr_pool", "'train' gives the server the sites' training images: use val with DP")
        if self.centralised:
            raise bad("centralised", "pools every site's images on one machine: there is nothing for DP to protect "
                                     "between sites; train federated with --dp-epsilon")


_SHARED = frozenset(f.name for f in dataclasses.fields(RunConfig))


def field_docs() -> dict[str, str]:
    """Each setting's documentation: the comment lines right above its field and the comment after it, read from
    the source of RunConfig and of each method config, the one place each is documented (`tafl train --help`
    shows them)."""
    import inspect

    source = Path(__file__).read_text(encoding="utf-8")
    docs = _comment_docs(source[source.index("class RunConfig:"):source.index("    def __post_init__")])
    for cls in config_classes():
        body = inspect.getsource(cls)
        docs.update(_comment_docs(body.split("\n    def ", 1)[0]))  # the fields, not the methods after them
    names = set(flat_keys())
    return {k: v for k, v in docs.items() if k in names}


def _comment_docs(body: str) -> dict[str, str]:
    """field name -> its comments, from the source of a class body whose fields sit at column 4."""
    import io
    import tokenize

    docs: dict[str, str] = {}
    above: list[str] = []
    line_of_field: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(body).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if tok.start[0] in line_of_field:  # a trailing comment: the field on that line
                name = line_of_field[tok.start[0]]
                docs[name] = " ".join(filter(None, [docs.get(name, ""), text]))
            elif text.startswith("---"):  # a section header belongs to no field
                above = []
            else:
                above.append(text)
        elif tok.type == tokenize.NAME and tok.start[1] == 4 and tok.line[4:].split(":")[0].strip().isidentifier() \
                and ":" in tok.line and tok.string not in ("def", "class"):
            line_of_field[tok.start[0]] = tok.string
            docs[tok.string] = " ".join(above)
            above = []
        elif tok.type == tokenize.NL and not tok.line.strip():
            above = []
    return docs


def _coerce(key: str, value: Any, hint: Any, source: str) -> Any:
    """Check `value` against the field's annotation; ints are accepted where floats are."""
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None:
        if type(None) in allowed:
            return None
        raise ConfigError(f"{source}: '{key}' must not be null")
    for typ in allowed:
        if typ is type(None):
            continue
        if typ is bool:
            if isinstance(value, bool):
                return value
            continue
        if typ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if typ is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if typ is str and isinstance(value, str):
            return value
        if typing.get_origin(typ) is list and isinstance(value, (list, tuple)):
            return list(value)
    names = " or ".join("null" if t is type(None) else getattr(t, "__name__", str(t)) for t in allowed)
    raise ConfigError(f"{source}: '{key}' must be {names}, got {value!r}")


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """The defaults, then the YAML file, then the overrides (flags); validated."""
    cfg = RunConfig()
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not valid YAML ({exc})") from exc
        cfg.update(data, str(p))
    in_file = {str(k).replace("-", "_") for k in data} if isinstance(data, dict) else set()
    given: set[str] = set()
    if overrides:
        cfg.update({k: v for k, v in overrides.items() if v is not None}, "command line")
        given = {str(k).replace("-", "_") for k, v in overrides.items() if v is not None}
    if cfg.client_column:
        # a flag that contradicts it is an error, and so is a file that sets both; a base file's simulated-client
        # keys (configs/smoke.yaml) are simply replaced
        clash = sorted((given | (in_file if "client_column" in in_file else set())) & set(SITE_CLIENTS_REPLACE))
        if clash:
            raise ConfigError(f"client_column '{cfg.client_column}' makes one client per site, so "
                              f"{', '.join(clash)} {'does' if len(clash) == 1 else 'do'} not apply; drop "
                              f"{'it' if len(clash) == 1 else 'them'}")
        cfg.imbalance_factor = None  # real sites keep their own long tail
    return cfg.validate()


# what --client-column replaces: the simulated clients, their Dirichlet split and the synthetic long tail
SITE_CLIENTS_REPLACE = ("clients", "alpha", "partition", "imbalance_factor")

