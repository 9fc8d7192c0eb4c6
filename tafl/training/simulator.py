"""The in-process federated simulator: the embedded default transport of docs/design.md, "Federated learning".

It builds the long-tailed training set and the client partition once, keeps one copy of the
data (clients hold index tensors into it) and one working model inside the method, then drives
the method's transport-free steps round by round. After every round it writes an atomic
checkpoint; `resume=True` continues a killed run from the newest one and, because every random
draw is a function of (seed, round, client), ends with exactly the weights of an uninterrupted
run. The kept model (last round, or best validation balanced accuracy with `select: val`) goes
to `OUT/final.pt` and is evaluated on the eleven test distributions.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import tafl
from tafl.errors import CheckpointError, ConfigError, DataError, RunDirError
from tafl.training.checkpoint import latest_round_checkpoint, load_checkpoint, save_checkpoint
from tafl.training.config import RunConfig
from tafl.training.data import Dataset, Split, index_hash, load_dataset
from tafl.training.ensemble import vote_rule_accuracies
from tafl.training.evaluate import balanced_accuracy, evaluate_outputs, predict
from tafl.training.longtail import (class_ranks, client_class_counts, dirichlet_partition, holdout_split, make_longtail,
                                    ranks_from_counts, select_clients)
from tafl.training.methods import GlobalState, Method, method_class
from tafl.training.methods.base import ClientData, tensor_bytes
from tafl.training.models import ModelConfig
from tafl.training.report import write_json, write_report
from tafl.training.transport import InProcessTransport, Transport

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    """Everything a run derives from its data and config, before any training."""

    dataset: Dataset
    train: Split  # the long-tailed training set
    parts: list[np.ndarray]  # client -> row indices into `train` it trains on
    holdouts: list[np.ndarray]  # client -> rows it holds out of training for the calibration round
    ranks: np.ndarray  # training-frequency rank per class
    train_counts: np.ndarray  # (C,)
    client_counts: np.ndarray  # (K, C)
    model_cfg: ModelConfig
    index_sha256: str


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' asked for, but no CUDA device is visible; use --device cpu or auto")
    return torch.device(name)


def prepare(cfg: RunConfig) -> Prepared:
    ds = load_dataset(cfg)
    keep = make_longtail(ds.train.labels, ds.num_classes, cfg.imbalance_factor, cfg.seed)
    train = ds.train.subset(keep)
    counts = np.bincount(train.labels, minlength=ds.num_classes)
    ranks = class_ranks(train.labels, ds.num_classes)
    if ds.site_names is not None:
        parts = site_parts(train, ds.site_names)
        cfg.clients = len(parts)  # one client per site; the checkpoint's config records it
    else:
        parts = dirichlet_partition(train.labels, cfg.clients, cfg.alpha, cfg.seed, equal=cfg.partition == "equal",
                                    num_classes=ds.num_classes)
    if cfg.centralised:  # the pooled ceiling: one client holds every training row
        parts = [np.sort(np.concatenate(parts))]
        cfg.clients, cfg.frac = 1, 1.0
    parts, holdouts = holdout_split(parts, cfg.calib_holdout, cfg.seed, train.labels, cfg.calib_holdout_mode)
    cc = client_class_counts(train.labels, parts, ds.num_classes)
    model_cfg = ModelConfig(backbone=cfg.backbone, num_classes=ds.num_classes, in_chans=ds.preprocess.channels,
                            img_size=ds.preprocess.size, width=cfg.width, patch_size=cfg.patch_size,
                            embed_dim=cfg.embed_dim, depth=cfg.depth, num_heads=cfg.num_heads,
                            tokenizer=cfg.tokenizer,
                            # a fixed extractor (train_scope head) keeps no batch statistics to trust, DP-SGD none at all
                            norm="group" if cfg.dp_epsilon or cfg.train_scope == "head" else "batch")
    return Prepared(ds, train, parts, holdouts, ranks, counts, cc, model_cfg, index_hash(cfg.dataset, train.ids, train.labels))


def site_parts(train: Split, site_names: list[str]) -> list[np.ndarray]:
    """Client k trains on the training rows of site k (--client-column): the real split, no Dirichlet draw. A site
    may lack a class (vidir_molemax has no akiec); a site with no training rows at all is an error."""
    parts = [np.flatnonzero(train.sites == k) for k in range(len(site_names))]
    empty = [site_names[k] for k, p in enumerate(parts) if len(p) == 0]
    if empty:
        raise DataError(f"site(s) {', '.join(empty)} have no training rows; a client needs data to train on "
                        "(drop those rows, or mark some as train)")
    return parts


def check_privacy_data(cfg: RunConfig, prep: Prepared) -> None:
    """δ must be below 1/n for every site's n records (a larger δ allows releasing a record outright)."""
    if cfg.dp_epsilon is None:
        return
    n_min = min(len(p) for p in prep.parts)
    if cfg.dp_delta >= 1.0 / n_min:
        raise ConfigError(f"config 'dp_delta' = {cfg.dp_delta!r}: must be below 1/n = {1.0 / n_min:.2g} for the "
                          f"smallest site's n = {n_min} training images (e.g. --dp-delta 1e-5)")


def make_method(cfg: RunConfig, model_cfg: ModelConfig, preprocess, device: torch.device | str = "cpu") -> Method:
    return method_class(cfg.method)(cfg, model_cfg, preprocess, device)


# ------------------------------------------------------------------ run folder
def _prepare_out(out: Path, cfg: RunConfig, resume: bool, force: bool) -> RunConfig:
    run_json = out / "run.json"
    if resume:
        if not run_json.is_file():
            raise RunDirError(f"--resume: {out} holds no tafl run (no run.json)")
        saved = RunConfig.from_dict(json.loads(run_json.read_text())["config"], str(run_json)).validate()
        diff = [k for k, v in cfg.to_dict().items() if k != "rounds" and saved.to_dict()[k] != v]
        if diff:
            k = diff[0]
            raise ConfigError(f"--resume: the config differs from the run in {out}: '{k}' was "
                              f"{saved.to_dict()[k]!r}, now {cfg.to_dict()[k]!r} (only 'rounds' may change)")
        saved.rounds = cfg.rounds
        return saved
    if out.exists() and any(out.iterdir()):
        if not force:
            raise RunDirError(f"{out} already holds files; pass --force to replace that run, or --resume to continue it")
        if not run_json.is_file():
            raise RunDirError(f"{out} is not empty and holds no tafl run; refusing to delete it even with --force")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(run_json, {"config": cfg.to_dict(), "created": _now(), "tafl_version": tafl.__version__})
    return cfg


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# ------------------------------------------------------------------ training
def train(cfg: RunConfig, out: str | Path, *, resume: bool = False, force: bool = False,
          progress: bool | None = None, init_from: dict[str, Any] | None = None,
          parent_package: dict[str, Any] | None = None, transport_factory=None) -> dict[str, Any]:
    """Train, checkpoint every round, evaluate; returns the report (also written to OUT).

    `init_from` (a checkpoint) starts from its global state instead of a fresh model: the
    retraining path. `parent_package` (name, version, path) is recorded in every checkpoint so
    that `tafl export` versions the result as the parent's successor. `transport_factory(method,
    prepared)` gives the engine that reaches the clients (default: the in-process simulator).
    """
    out = Path(out)
    fresh = not resume and not (out.exists() and any(out.iterdir()))
    cfg = _prepare_out(out, cfg.validate(), resume, force)
    try:
        return _train_logged(cfg, out, resume, progress, init_from, parent_package, transport_factory)
    except BaseException:
        if not resume:
            discard_unstarted_run(out, fresh)
        raise


def discard_unstarted_run(out: Path, fresh: bool) -> None:
    """A run that failed before its first checkpoint (a missing dataset, a bad folder CSV) leaves no folder behind,
    or, where the folder held other things before (--force), no run.json: the retry with the same --out is not
    refused as "already holds files"."""
    ckpts = out / "checkpoints"
    if (ckpts.is_dir() and any(ckpts.iterdir())) or (out / "final.pt").exists():
        return
    if fresh:
        shutil.rmtree(out, ignore_errors=True)
    else:
        for name in ("run.json", "train.log"):
            (out / name).unlink(missing_ok=True)


def _train_logged(cfg: RunConfig, out: Path, resume: bool, progress: bool | None, init_from, parent_package,
                  transport_factory) -> dict[str, Any]:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = resolve_device(cfg.device)
    file_log = logging.FileHandler(out / "train.log")
    file_log.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    file_log.setLevel(logging.INFO)
    tafl_log = logging.getLogger("tafl")
    old_level = tafl_log.level
    if tafl_log.getEffectiveLevel() > logging.INFO:
        tafl_log.setLevel(logging.INFO)  # train.log always gets the INFO lines
        for h in logging.getLogger().handlers:  # without lowering what the console shows
            if h.level == logging.NOTSET:
                h.setLevel(logging.getLogger().getEffectiveLevel())
    tafl_log.addHandler(file_log)
    try:
        return _train(cfg, out, resume, device, progress, init_from, parent_package, transport_factory)
    finally:
        tafl_log.removeHandler(file_log)
        tafl_log.setLevel(old_level)
        file_log.close()


def _train(cfg: RunConfig, out: Path, resume: bool, device: torch.device, progress: bool | None,
           init_from: dict[str, Any] | None = None, parent_package: dict[str, Any] | None = None,
           transport_factory=None) -> dict[str, Any]:
    prep, method, transport = _setup(cfg, device, init_from, transport_factory)
    if cfg.decision == "validation" and len(prep.dataset.val.labels) == 0:
        raise ConfigError("config 'decision' = 'validation' needs a validation split, and this dataset has none "
                          "(raise val_fraction, or use decision: argmax)")
    state = _initial_state(method, transport, prep, init_from)
    book, start = _new_book(), 0
    if resume:
        state, start, book = _resume(out / "checkpoints", prep, state, book)
    common = _common_fields(cfg, prep)
    if method.dp:  # what the federation knows of its mix is the sites' noisy census, not the exact counts
        noisy = state.extras["global_counts"].numpy()
        common.update(train_class_counts=[int(round(float(c))) for c in noisy], client_class_counts=None,
                      class_ranks=[int(r) for r in ranks_from_counts(noisy)])
    if parent_package:
        common["parent_package"] = parent_package
    state = _round_loop(method, state, transport, cfg, book, common, prep.dataset, out / "checkpoints", start,
                        progress)
    return _finalise(method, state, transport, cfg, book, common, prep.dataset, out)


def _setup(cfg: RunConfig, device: torch.device, init_from: dict[str, Any] | None,
           transport_factory) -> tuple[Prepared, Method, Transport]:
    """The data, the method and the transport that reaches its clients (default: in-process)."""
    prep = prepare(cfg)
    ds = prep.dataset
    if init_from is not None:
        from tafl.imaging import Preprocess

        _check_compatible(init_from, prep)
        ds.preprocess = Preprocess.from_dict(init_from["preprocess"])  # the model learned this normalisation
    log.info("%s: %d training images after the long tail (IF %s), class counts %s; %d clients",
             cfg.dataset, len(prep.train), cfg.imbalance_factor, prep.train_counts.tolist(), cfg.clients)
    for k, row in enumerate(prep.client_counts):
        log.info("client %d: %d samples, class counts %s", k, int(row.sum()), row.tolist())
    check_privacy_data(cfg, prep)
    method = make_method(cfg, prep.model_cfg, ds.preprocess, device)
    if transport_factory is None:
        images = torch.from_numpy(prep.train.images)  # the one copy of the training data
        labels = torch.from_numpy(prep.train.labels)
        clients = [ClientData(k, images, labels, torch.from_numpy(p), ds.num_classes, torch.from_numpy(h))
                   for k, (p, h) in enumerate(zip(prep.parts, prep.holdouts))]
        transport: Transport = InProcessTransport(method, clients)
    else:
        transport = transport_factory(method, prep)
    method.attach_server_pool(server_pool(cfg, ds))
    return prep, method, transport


def _initial_state(method: Method, transport: Transport, prep: Prepared,
                   init_from: dict[str, Any] | None) -> GlobalState:
    """A fresh global state (or `init_from`'s, for retraining), after round 0: the census, in which every client
    reports its class counts before training starts."""
    state = method.init_state(prep.train_counts)
    if init_from is not None:
        start_state = GlobalState.from_dict(init_from["state"])
        # the parent's calibration, operating point and case-mix estimator describe the parent's weights: the
        # retrained model fits its own (they are carried through every round's meta otherwise, and a stale one would
        # skip the new fit)
        meta = {k: v for k, v in start_state.meta.items() if k not in ("calibration", "decision", "prior_estimator")}
        state = GlobalState(start_state.weights, {**state.extras, **start_state.extras},
                            {**meta, "client_counts": {}, "round": 0})
    method.round_config(state, transport.census(), 0)
    return state


def _new_book() -> dict[str, Any]:
    """What a run accumulates besides the model: per-round history, time, bytes, the best round so far."""
    return {"history": [], "timing": {"client_s": 0.0, "server_s": 0.0, "eval_s": 0.0},
            "communication": {"uplink_bytes": 0, "downlink_bytes": 0}, "best": None}


def _resume(ckpt_dir: Path, prep: Prepared, state: GlobalState,
            book: dict[str, Any]) -> tuple[GlobalState, int, dict[str, Any]]:
    """The state, last round and book of the newest readable round checkpoint (round 0 and the given state and book
    when there is none)."""
    latest = latest_round_checkpoint(ckpt_dir)
    if latest is None:
        log.info("--resume: no readable round checkpoint in %s; starting from round 1", ckpt_dir)
        return state, 0, book
    ck = load_checkpoint(latest)
    if ck.get("index_sha256") != prep.index_sha256:
        raise CheckpointError(f"{latest} was trained on different data (training index hash differs)")
    log.info("resuming after round %d from %s", int(ck["round"]), latest)
    return GlobalState.from_dict(ck["state"]), int(ck["round"]), ck["book"]


def _round_loop(method: Method, state: GlobalState, transport: Transport, cfg: RunConfig, book: dict[str, Any],
                common: dict[str, Any], ds: Dataset, ckpt_dir: Path, start: int,
                progress: bool | None) -> GlobalState:
    """Rounds start+1 .. cfg.rounds: train, validate every eval_every rounds, checkpoint every round."""
    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm(), tqdm(total=cfg.rounds, initial=start, desc=f"{cfg.method} rounds", unit="round",
                                       disable=(not progress) if progress is not None else None,
                                       dynamic_ncols=True) as bar:
        for r in range(start + 1, cfg.rounds + 1):
            state = _one_round(method, state, transport, r, cfg, book)
            t0 = time.perf_counter()
            h = book["history"][-1]
            if r % cfg.eval_every == 0 or r == cfg.rounds:
                h["val_acc"], h["val_bacc"] = validate(method, state, ds.val, cfg.eval_batch_size)
                if cfg.select == "val" and (book["best"] is None or h["val_bacc"] > book["best"]["val_bacc"]):
                    book["best"] = {"round": r, "val_bacc": h["val_bacc"], "val_acc": h["val_acc"],
                                    "state": state.to_dict()}
            book["timing"]["eval_s"] += time.perf_counter() - t0
            save_checkpoint({**common, "state": state.to_dict(), "round": r, "book": book},
                            ckpt_dir / f"round_{r:04d}.pt")
            for old in sorted(ckpt_dir.glob("round_*.pt"))[:-cfg.keep_checkpoints]:
                old.unlink(missing_ok=True)
            bar.update(1)
            loss = ("none (the sites train nothing)" if not method.trains else "not released (DP)") \
                if h["loss"] is None else f"{h['loss']:.4f}"
            bar.set_postfix(loss=loss, val_acc=_pct(h.get("val_acc")), val_bacc=_pct(h.get("val_bacc")))
            log.info("round %d/%d: loss %s, val acc %s, val balanced acc %s, %.1f s", r, cfg.rounds, loss,
                     _pct(h.get("val_acc")), _pct(h.get("val_bacc")), h["seconds"])
    return state


def _finalise(method: Method, state: GlobalState, transport: Transport, cfg: RunConfig, book: dict[str, Any],
              common: dict[str, Any], ds: Dataset, out: Path) -> dict[str, Any]:
    """The kept model (last or best-validated round), its finishing and calibration rounds, `final.pt` and the
    evaluated report."""
    if cfg.select == "val" and book["best"] is not None:
        kept, kept_round = GlobalState.from_dict(book["best"]["state"]), book["best"]["round"]
    else:
        kept, kept_round = state, cfg.rounds
    finish_cfg = method.finish_config(kept)
    if finish_cfg is not None and not kept.meta.get("finished"):
        kept = _finish(method, kept, transport, finish_cfg, cfg, book)
    if cfg.decision == "validation" and "decision" not in kept.meta:  # before calibration: GTAFL's moves its experts
        kept = choose_operating_point(method, kept, ds, cfg)
    if cfg.calibration != "none" and "calibration" not in kept.meta:
        kept = _calibrate(method, kept, transport, cfg, book)
    if "calibration" not in kept.meta:  # uncalibrated: record the prior its posteriors describe, for the package
        from tafl.prior import Calibration

        identity = Calibration(source_prior=np.asarray(method.default_source_prior(kept), np.float64))
        kept = GlobalState(kept.weights, kept.extras, dict(kept.meta, calibration=identity.to_dict()))
    if "prior_estimator" not in kept.meta:
        kept = choose_prior_estimator(method, kept, ds, cfg, np.asarray(common["class_ranks"]))
    final = {**common, "state": kept.to_dict(), "round": kept_round, "book": {k: v for k, v in book.items()
                                                                              if k != "best"}}
    save_checkpoint(final, out / "final.pt")
    report, outputs = evaluate_checkpoint(final, ds, method=method)
    report.update(selected_round=kept_round, selection=cfg.select, rounds_run=cfg.rounds)
    write_report(out, report, outputs)
    log.info("mean prior-weighted accuracy over the eleven distributions: %s (backward50 %s, forward50 %s)",
             _pct(report["average_accuracy"]), _pct(report["test_distributions"]["backward50"]["accuracy"]),
             _pct(report["test_distributions"]["forward50"]["accuracy"]))
    return report


def choose_operating_point(method: Method, state: GlobalState, ds: Dataset, cfg: RunConfig) -> GlobalState:
    """The plain decision's τ (tafl.training.decision) on the validation split, recorded in the state's meta:
    the report, `tafl eval` and the package all decide with it."""
    state = method.choose_operating_point(state, ds.val.images, ds.val.labels, cfg.eval_batch_size)
    rec = state.meta["decision"]
    base = rec["scores"]["0.0"]
    log.info("operating point: tau %.1f on %d validation images (uniform-prior macro F1 %.1f%% against %.1f%% "
             "at the argmax)", rec["tau"], rec["validation_images"], 100 * rec["scores"][f"{rec['tau']:.1f}"],
             100 * base)
    return state


def choose_prior_estimator(method: Method, state: GlobalState, ds: Dataset, cfg: RunConfig,
                           ranks: np.ndarray) -> GlobalState:
    """The case-mix estimator's smoothing (tafl.prior.PriorEstimator), recorded in the state's meta: the report, the
    package, the service and `tafl score --prior adaptive` all estimate with it. `prior_smoothing: auto` chooses the
    pseudo-count on the validation split (`select_prior_smoothing`); a number fixes it; without a validation split,
    auto is the maximum-likelihood EM (0). `ranks`: the training classes' frequency ranks (the eleven distributions)."""
    from tafl.prior import Calibration, PriorEstimator

    fixed = cfg.prior_smoothing_value()
    C = len(ds.class_names)
    if fixed is not None or len(ds.val.labels) == 0:
        why = "config" if fixed is not None else "no validation split"
        est = PriorEstimator(fixed or 0.0, "uniform", {"chosen": why})
    else:
        calib = Calibration.from_dict(state.meta.get("calibration"), C)
        source = calib.source_prior if calib.source_prior is not None else method.default_source_prior(state)
        module = method.inference_model(state).to(method.device)
        out = predict(module, ds.val.images, method.normalize, cfg.eval_batch_size, keys=method.output_keys)
        probs = calib.probs(method.posterior_logits(out))
        if ds.site_names is not None and ds.val.sites is not None:  # real sites: their own validation mixes
            counts = state.extras["global_counts"].numpy().astype(np.float64)
            est = select_prior_smoothing_sites(probs, ds.val.labels, ds.val.sites, source,
                                               train_mix=counts / counts.sum() if counts.sum() > 0 else None,
                                               site_mixes=site_train_mixes(ds))
            key = f"{est.center}:{est.pseudo_count:g}"
        else:
            est = select_prior_smoothing(probs, ds.val.labels, ranks, source, cfg.adapt_size_list(), cfg.adapt_draws,
                                         cfg.test_seed)
            key = f"{est.pseudo_count:g}"
        scores = est.record["scores"]
        log.info("case-mix estimator: %s, chosen on %d validation images (mean adapted accuracy %.1f%% against %.1f%% "
                 "for the maximum-likelihood EM)", est.describe(), len(ds.val.labels),
                 100 * scores[key], 100 * scores.get("0", scores.get("uniform:0", float("nan"))))
    return GlobalState(state.weights, state.extras, dict(state.meta, prior_estimator=est.to_dict()))


def select_prior_smoothing(probs: np.ndarray, labels: np.ndarray, ranks: np.ndarray, source: np.ndarray,
                           sizes: list[int], draws: int, seed: int, grid: tuple[float, ...] | None = None):
    """The pseudo-count (tafl.prior.SMOOTHING_GRID) whose uniform-centred estimator scores best on labelled rows:
    the mean over `sizes` of the eleven distributions' mean prior-weighted accuracy of the rule adapted to its
    estimate (`adaptation_accuracies`, the report's protocol, on these rows). Ties: the smaller pseudo-count,
    nearer the maximum-likelihood EM. Returns the tafl.prior.PriorEstimator, its record holding every score."""
    from tafl.prior import SMOOTHING_GRID, PriorEstimator

    grid = SMOOTHING_GRID if grid is None else grid
    scores = {}
    for a in grid:
        est = PriorEstimator(float(a), "uniform")
        avg = adaptation_accuracies(probs, labels, ranks, source, sizes, draws, seed,
                                    estimate=lambda p, e=est: e.estimate(p, source).prior)["average"]
        scores[f"{a:g}"] = float(np.mean([avg[f"adaptive_{n}"] for n in sizes]))
    vals = np.round(np.array(list(scores.values())), 12)
    best = float(grid[int(np.argmax(vals))])  # first maximum: the smallest pseudo-count among ties
    return PriorEstimator(best, "uniform", {
        "chosen": "validation", "criterion": f"the mean over n = {', '.join(map(str, sizes))} of the eleven "
        "distributions' prior-weighted accuracy, adapted to the estimate from n images",
        "validation_images": int(len(labels)), "scores": scores})


def site_train_mixes(ds: Dataset) -> dict[int, np.ndarray] | None:
    """Each site's own training class counts (by site index): what a site knows of its case mix from its own
    labelled images, the `site` centre of the case-mix estimator there. None without sites."""
    if ds.site_names is None or ds.train.sites is None:
        return None
    C = len(ds.class_names)
    return {k: np.bincount(ds.train.labels[ds.train.sites == k], minlength=C).astype(np.float64)
            for k in range(len(ds.site_names)) if (ds.train.sites == k).any()}


def select_prior_smoothing_sites(probs: np.ndarray, labels: np.ndarray, sites: np.ndarray, source: np.ndarray,
                                 grid: tuple[float, ...] | None = None, min_rows: int = 20,
                                 train_mix: np.ndarray | None = None,
                                 site_mixes: dict[int, np.ndarray] | None = None):
    """With real sites (--client-column), the estimator is chosen for what it will meet: each site's validation
    rows at that site's own case mix. For each centre (the training images' mix `train_mix`, where it differs from
    the source prior; each site's own training mix, `site_mixes` by site index, where given for every site; the
    source prior; the uniform mix) and pseudo-count, the mean over sites of the accuracy on the site's validation
    rows, adapted to the mix estimated from those same rows (unlabeled). Sites with fewer than `min_rows`
    validation rows are left out (all, if none has that many). Ties: the first centre in that order, then the
    smaller pseudo-count. Returns the tafl.prior.PriorEstimator (a `site` centre keeps the federation's training
    mix, or the source prior, as its fallback where a deployment gives no site mix)."""
    from tafl.prior import SMOOTHING_GRID, PriorEstimator, adapt

    grid = SMOOTHING_GRID if grid is None else grid
    present = [k for k in np.unique(sites) if (sites == k).sum() >= min_rows] or list(np.unique(sites))
    src = np.asarray(source, np.float64) / np.sum(source)
    mix = None if train_mix is None else tuple(float(v) for v in np.asarray(train_mix, np.float64) / np.sum(train_mix))
    centers = (["train"] if mix is not None and np.abs(np.array(mix) - src).max() > 1e-6 else [])
    centers += ["site"] if site_mixes and all(k in site_mixes and site_mixes[k].sum() > 0 for k in present) else []
    centers += ["source", "uniform"]
    fallback = mix if mix is not None else tuple(float(v) for v in src)
    scores = {}
    for center in centers:
        for a in grid:
            est = PriorEstimator(float(a), center, center_mix=fallback if center in ("train", "site") else None)
            acc = []
            for k in present:
                idx = np.flatnonzero(sites == k)
                q = est.for_site(site_mixes[k] if center == "site" else None).estimate(probs[idx], source).prior
                acc.append(float((adapt(probs[idx], source, q).argmax(1) == labels[idx]).mean()))
            scores[f"{center}:{a:g}"] = float(np.mean(acc))
    keys = list(scores)
    best = keys[int(np.argmax(np.round(np.array(list(scores.values())), 12)))]  # first maximum
    center, a = best.split(":")
    return PriorEstimator(float(a), center, center_mix=fallback if center in ("train", "site") else None, record={
        "chosen": "validation", "criterion": "the mean over sites of the accuracy on each site's validation rows, "
        "adapted to the mix estimated from those rows", "validation_images": int(len(labels)),
        "sites": int(len(present)), "scores": scores})


def _check_compatible(ck: dict[str, Any], prep: Prepared) -> None:
    """A checkpoint to continue from must describe the same model over the same classes."""
    if list(ck["class_names"]) != list(prep.dataset.class_names):
        raise CheckpointError(f"cannot continue: the checkpoint's classes {ck['class_names']} differ from the new "
                              f"data's {prep.dataset.class_names}")
    if ModelConfig.from_dict(ck["model_config"]) != prep.model_cfg:
        raise CheckpointError(f"cannot continue: the checkpoint's model {ck['model_config']} differs from the "
                              f"config's {prep.model_cfg.to_dict()} (keep backbone, width, img_size and channels)")


def server_pool(cfg: RunConfig, ds: Dataset) -> torch.Tensor | None:
    """The server's unlabeled images for SimCLR (GTAFL's, and the extractor's pre-training): a split's images,
    never its labels."""
    if not (cfg.method == "gtafl" and cfg.cl) and not cfg.pretrain_steps and cfg.train_scope != "head":
        return None
    split = {"val": ds.val, "test": ds.test, "train": ds.train}[cfg.simclr_pool]
    if cfg.simclr_pool == "test":
        log.warning("SimCLR pool = the unlabeled TEST images (transductive, as the paper); reports are labelled so")
    return torch.from_numpy(split.images)


def _one_round(method: Method, state: GlobalState, transport: Transport, r: int, cfg: RunConfig,
               book: dict[str, Any]) -> GlobalState:
    t_round = time.perf_counter()
    selected = select_clients(transport.num_clients, cfg.frac, cfg.seed, r)
    stats = transport.stats(selected)
    round_cfg = method.round_config(state, stats, r)
    payload = {**method.broadcast(state), **method.head_basis(state)}  # the basis: train_scope head
    results, cost = transport.train(selected, payload, round_cfg)
    _privacy_ledger(method, book, results, cost)
    comm = book["communication"]
    comm["downlink_bytes"] += cost["downlink_bytes"]
    comm["uplink_bytes"] += cost["uplink_bytes"] + sum(tensor_bytes(s) for s in stats.values())
    for key in ("wire_uplink_bytes", "wire_downlink_bytes"):
        if key in cost:
            comm[key] = comm.get(key, 0) + cost[key]
    book["timing"]["client_s"] += cost["client_s"]
    t0 = time.perf_counter()
    state = method.server_update(state, results, r)
    book["timing"]["server_s"] += time.perf_counter() - t0
    for key, secs in state.meta.pop("round_timing", {}).items():
        book["timing"][key] = book["timing"].get(key, 0.0) + secs
    losses = [res.metrics.get("loss", float("nan")) for res in results]
    finite = [x for x in losses if np.isfinite(x)]
    answered = set(cost.get("answered", [res.client_id for res in results]))  # a secure round: one combined result
    # a DP run's clients keep their loss (it is computed from their images outside the accountant): None
    # and a method whose sites train nothing (lda) has none to report
    mean_loss = float(np.mean(finite)) if finite else (None if method.dp or not method.trains else float("nan"))
    book["history"].append({"round": r, "clients": selected, "loss": mean_loss,
                            "dropped": sorted(set(state.meta.get("dropped", [])) | (set(selected) - answered)),
                            "seconds": time.perf_counter() - t_round})
    if "secure_sum" in cost:  # SecAgg+: which clients the sum holds, entries clipped to their bounds, its seconds
        book["history"][-1]["secure_sum"] = {k: cost["secure_sum"].get(k) for k in ("clients", "clipped", "seconds")}
    steps = sum(res.metrics.get("steps", 0.0) + res.metrics.get("nonfinite_steps", 0.0) for res in results)
    bad_steps = sum(res.metrics.get("nonfinite_steps", 0.0) for res in results)
    book["history"][-1]["nonfinite_share"] = float(bad_steps / steps) if steps else 0.0
    check_divergence(book["history"], state, cfg)
    return state


def _privacy_ledger(method: Method, book: dict[str, Any], results: list, cost: dict[str, Any]) -> None:
    """Each client's DP-SGD steps and statistics releases so far, and its plan: what the accountant composes for
    the report's ε (tafl.training.privacy.privacy_section). A secure round returns one combined result; its
    transport reports each client's counters in the cost (`client_metrics`)."""
    if not method.dp:
        return
    ledger = book.setdefault("privacy", {})
    per_client = cost.get("client_metrics") or {r.client_id: {**r.metrics, "num_samples": r.num_samples}
                                                for r in results}
    for cid, m in per_client.items():
        steps, rel, n = m.get("dp_steps", 0.0), m.get("dp_releases", 0.0), int(m["num_samples"])
        if not (steps or rel):
            continue
        e = ledger.setdefault(str(cid), {"records": n, "steps": 0, "releases": 0,
                                         "plan": method.dp_plan(n).to_dict()})
        e["steps"] += int(steps)
        e["releases"] += int(rel)


EXPLODED = 1e3  # a round's mean loss this many times the first round's is a divergence
BAD_ROUNDS = 2  # consecutive rounds with no usable update (or mostly non-finite steps) before stopping


def _finite(v: Any) -> bool:
    return v is not None and bool(np.isfinite(v))


def check_divergence(history: list[dict[str, Any]], state: GlobalState, cfg: RunConfig) -> None:
    """Stop a run that has diverged, with a message a person can act on, before its round is saved.

    Diverged: the aggregated weights hold NaN/Inf; or the round's mean loss is EXPLODED times the
    first round's; or BAD_ROUNDS rounds in a row had every client dropped, no finite loss, or more
    than half the local steps non-finite. Dropping a few clients for NaN is not a divergence.
    """
    h = history[-1]
    why = None
    bad = [k for k, v in state.weights.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        why = f"the aggregated weights hold NaN or Inf ({', '.join(bad[:3])}{'…' if len(bad) > 3 else ''})"
    first = next((x["loss"] for x in history if _finite(x.get("loss", np.nan))), None)
    if why is None and first is not None and _finite(h["loss"]) and h["loss"] > EXPLODED * max(first, 1e-3):
        why = f"the mean local loss exploded from {first:.4g} (round {history[0]['round']}) to {h['loss']:.4g}"

    def broken(x: dict[str, Any]) -> bool:
        # a loss of None was not released (DP): only the weights and the step counts can tell
        return ((x.get("loss", np.nan) is not None and not _finite(x.get("loss", np.nan)))
                or x.get("nonfinite_share", 0.0) > 0.5
                or (bool(x.get("clients")) and set(x.get("dropped", [])) >= set(x["clients"])))

    if why is None and len(history) >= BAD_ROUNDS and all(broken(x) for x in history[-BAD_ROUNDS:]):
        why = (f"{BAD_ROUNDS} rounds in a row had no usable client update (every client dropped, no finite loss, "
               f"or most local steps non-finite)")
    if why is not None:
        from tafl.errors import TrainingDiverged

        hint = ("lower --lr" + (" or use --optimizer adam" if cfg.optimizer == "sgd" else "")
                + (" (with --dafl-scale paper the loss is ~100x cross-entropy: try --dafl-scale mean)"
                   if cfg.method == "dafl" and cfg.dafl_scale == "paper" and cfg.loss == "dafl" else ""))
        raise TrainingDiverged(f"training diverged in round {h['round']}: {why}. No model was written; the "
                               f"checkpoints of earlier rounds are kept. Try: {hint}.")


def _charge(book: dict[str, Any], cost: dict[str, Any]) -> None:
    """Book a features-only or calibration round's bytes and client time."""
    comm = book["communication"]
    comm["downlink_bytes"] += cost["downlink_bytes"]
    comm["uplink_bytes"] += cost["uplink_bytes"]
    for key in ("wire_uplink_bytes", "wire_downlink_bytes"):
        if key in cost:
            comm[key] = comm.get(key, 0) + cost[key]
    book["timing"]["client_s"] += cost["client_s"]


def _finish(method: Method, state: GlobalState, transport: Transport, round_cfg: dict[str, Any], cfg: RunConfig,
            book: dict[str, Any]) -> GlobalState:
    """The method's finishing round on the kept model: a share of the clients answer a features-only
    round (no local training) and the server's last step uses it (GTAFL: the experts' last retraining)."""
    t_round = time.perf_counter()
    ids = select_clients(transport.num_clients, round_cfg["clients_frac"], cfg.seed, round_cfg["round"])
    payload = method.broadcast(state)
    results, cost = transport.train(ids, payload, round_cfg)
    _privacy_ledger(method, book, results, cost)
    _charge(book, cost)
    t0 = time.perf_counter()
    state = method.server_finish(state, results, round_cfg["round"])
    own = {"client_s": cost["client_s"], "server_s": time.perf_counter() - t0}
    book["timing"]["server_s"] += own["server_s"]
    for key, secs in state.meta.pop("round_timing", {}).items():
        book["timing"][key] = book["timing"].get(key, 0.0) + secs
        own[key] = secs
    answered = set(cost.get("answered", [r.client_id for r in results]))  # a secure round: one combined result
    book["finish"] = {"clients": ids, "dropped": sorted(set(state.meta.get("finish_dropped", [])) | (set(ids) - answered)),
                      "seconds": time.perf_counter() - t_round, "timing": own,
                      "uplink_bytes": cost["uplink_bytes"], "downlink_bytes": cost["downlink_bytes"]}
    log.info("finishing round: %d of %d clients answered, %.1f s", len(answered), len(ids), book["finish"]["seconds"])
    return state


CALIB_KEYS = ("nll", "grad", "hess", "counts", "n")


def calibration_problem(r, num_classes: int, params: int) -> str | None:
    """Why a client's calibration statistics cannot be summed, or None."""
    e = r.extras
    shapes = {"nll": (1,), "grad": (params,), "hess": (params, params), "counts": (num_classes,), "n": (1,)}
    for k, shape in shapes.items():
        t = e.get(f"calib_{k}")
        if t is None or tuple(t.shape) != shape:
            return f"calib_{k} is missing or not of shape {shape}"
        if not bool(torch.isfinite(t).all()):
            return f"calib_{k} contains NaN or Inf"
    counts, n = e["calib_counts"], float(e["calib_n"][0])
    if bool((counts < 0).any()) or abs(float(counts.sum()) - n) > 1e-6 or n < 0:
        return "calibration counts are negative or do not add up to the number of images"
    return None


def _calibrate(method: Method, state: GlobalState, transport: Transport, cfg: RunConfig,
               book: dict[str, Any]) -> GlobalState:
    """The federated calibration (tafl.prior): damped Newton rounds on the NLL of every client's held-out rows.

    Each round sends the current (scale, bias); each client answers sums over its held-out rows (NLL, gradient,
    Hessian, class counts), so the fit equals one on the pooled held-out rows without pooling them. The clients
    that answer the first round are the calibration set; a later round missing one of them ends the fit at the
    best point so far. The source prior is the pooled held-out rows' class mix."""
    from tafl.prior import NewtonCalibrator, sum_stats
    from tafl.prior import n_params as prior_n_params

    t_start = time.perf_counter()
    C = int(method.model_cfg.num_classes)
    cal = NewtonCalibrator(C, cfg.calibration, cfg.calib_rounds, bias_l2=cfg.calib_l2, scale_l2=cfg.calib_l2)
    n_params = prior_n_params(cfg.calibration, C)
    ids = list(range(transport.num_clients))
    payload = method.broadcast(state)
    round_id = cfg.rounds + 2  # after the finishing round's rounds + 1
    members: set[int] | None = None
    cover: frozenset[int] = frozenset()
    counts = None
    params = cal.params()
    dropped: set[int] = set()
    while params is not None:
        scale, bias = params
        scale = float(scale) if np.ndim(scale) == 0 else [float(v) for v in scale]  # JSON for Flower
        round_cfg = {"round": round_id, "seed": cfg.seed, "calibrate": cfg.calibration, "scale": scale,
                     "bias": None if bias is None else [float(v) for v in bias]}
        results, cost = transport.train(ids, payload, round_cfg)
        _charge(book, cost)
        good = {}
        for r in results:
            why = calibration_problem(r, C, n_params)
            if why is None:
                good[r.client_id] = r
            elif r.client_id not in dropped:
                dropped.add(r.client_id)
                log.warning("calibration: dropping client %s: %s", r.client_id, why)
        # under secure aggregation one result stands for the sum over the clients the cost lists as answered
        covered = frozenset(cost.get("answered") or ())
        if members is None:
            members = {k for k, r in good.items() if float(r.extras["calib_n"][0]) > 0}
            cover = covered
            if not members:
                log.warning("calibration: no client sent held-out statistics; the model stays uncalibrated")
                return state
        if not members <= set(good) or covered != cover:
            log.warning("calibration: client(s) %s did not answer round %d; keeping the best fit so far",
                        sorted((members - set(good)) | (cover ^ covered)), cal.iterations + 1)
            break
        totals = sum_stats([{k: good[c].extras[f"calib_{k}"].numpy() for k in CALIB_KEYS} for c in sorted(members)])
        cal.noise = sum(float(good[c].metrics.get("calib_nll_error", 0.0)) for c in members)  # secure sums' error
        counts = totals["counts"]
        params = cal.step(totals)
    if cal.best is None or counts is None:
        return state
    calibration = cal.result(counts / counts.sum())
    calibration.fit.update(clients=sorted(cover or members or []), dropped=sorted(dropped),
                           seconds=time.perf_counter() - t_start)
    book["calibration"] = calibration.to_dict()
    log.info("calibration (%s): T %.3f on %d held-out images of %d clients, NLL %.4f -> %.4f in %d rounds",
             cfg.calibration, calibration.temperature, calibration.fit["images"], len(cover or members or []),
             calibration.fit["nll_before"], calibration.fit["nll_after"], calibration.fit["iterations"])
    return GlobalState(state.weights, state.extras, dict(state.meta, calibration=calibration.to_dict()))


def validate(method: Method, state: GlobalState, val: Split, batch_size: int) -> tuple[float, float]:
    module = method.inference_model(state).to(method.device)
    out = predict(module, val.images, method.normalize, batch_size, keys=("label",))
    preds = out["label"]
    return float((preds == val.labels).mean()), balanced_accuracy(preds, val.labels, int(method.model_cfg.num_classes))


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.2f}%"


def _common_fields(cfg: RunConfig, prep: Prepared) -> dict[str, Any]:
    return {
        "method": cfg.method,
        "model_config": prep.model_cfg.to_dict(),
        "run_config": cfg.to_dict(),
        "class_names": list(prep.dataset.class_names),
        "preprocess": prep.dataset.preprocess.to_dict(),
        "train_class_counts": [int(c) for c in prep.train_counts],
        "class_ranks": [int(r) for r in prep.ranks],
        "client_class_counts": prep.client_counts.tolist(),
        "index_sha256": prep.index_sha256,
        "data_provenance": {**prep.dataset.provenance, "training_index_sha256": prep.index_sha256,
                            "n_train": int(len(prep.train)), "n_val": int(len(prep.dataset.val)),
                            "n_test": int(len(prep.dataset.test))},
        "tafl_version": tafl.__version__,
        "created": _now(),
    }


# ------------------------------------------------------------------ evaluation of a checkpoint
GAP_BOOT = 200  # bootstrap replicates of the test report's gap to the oracle (docs/decisions.md, "The test split's resolution")


def _prior_adaptation(report: dict[str, Any], method: Method, state: GlobalState, cfg: RunConfig,
                      test_out: dict[str, np.ndarray], val_out: dict[str, np.ndarray], ds: Dataset,
                      ranks: np.ndarray) -> None:
    """Prior-aware inference in the report: per test distribution, the rule adapted to a prior estimated from
    n unlabeled images drawn with that distribution's prior (`adaptive`, per n), to the true prior (`oracle`),
    the calibrated argmax (`calibrated`) and the model's own label (`plain`: what `prior=train` and a blocked
    `prior=adaptive` serve); the same means on the validation split."""
    from tafl.prior import Calibration, PriorEstimator

    C = len(ds.class_names)
    calib = Calibration.from_dict(state.meta.get("calibration"), C)
    source = calib.source_prior if calib.source_prior is not None else method.default_source_prior(state)
    sizes = cfg.adapt_size_list()
    estimator = PriorEstimator.from_dict(state.meta.get("prior_estimator"))
    sec = {"calibration": calib.to_dict(), "source_prior": [float(v) for v in source],
           "calibrated": calib.kind != "none", "sizes": sizes, "draws": cfg.adapt_draws,
           "posteriors": method.posterior_description(), "estimator": estimator.to_dict()}
    for split, out, labels, target in (("test", test_out, ds.test.labels, report),
                                       ("validation", val_out, ds.val.labels, None)):
        probs = calib.probs(method.posterior_logits(out))
        res = adaptation_accuracies(probs, labels, ranks, source, sizes, cfg.adapt_draws, cfg.test_seed,
                                    estimate=lambda p: estimator.estimate(p, source).prior, plain=out["label"],
                                    boot=GAP_BOOT if split == "test" else 0)
        res["nll"] = float(-np.log(np.clip(probs[np.arange(len(labels)), labels], 1e-12, None)).mean())
        if target is not None:
            for name, d in res["distributions"].items():
                target["test_distributions"][name].update(d)
        sec[split] = {k: v for k, v in res.items() if k != "distributions"}
        if split == "validation":
            sec[split]["distributions"] = res["distributions"]
    report["prior_adaptation"] = sec


def site_evaluation(method: Method, state: GlobalState, test_out: dict[str, np.ndarray], ds: Dataset
                    ) -> dict[str, Any]:
    """Each site's own test rows, its real case mix (--client-column): accuracy and balanced accuracy at the
    model's own rule (`own`: what `prior=train` serves), at the site's own training mix (`site`: what `prior=site`
    serves there with `--site-mix`; no test image is used), adapted to the mix the package's estimator finds in
    that site's unlabeled test images (`adapted`: what `prior=adaptive` would serve there) and at that site's true
    mix (`oracle`); their mean over the sites; and the pooled test split's balanced accuracy at the model's own rule
    (the number Fed-ISIC2019/FLamby reports). A site without test rows is listed in `sites_without_test`."""
    from tafl.prior import Calibration, PriorEstimator, adapt, site_prior

    C = len(ds.class_names)
    calib = Calibration.from_dict(state.meta.get("calibration"), C)
    source = calib.source_prior if calib.source_prior is not None else method.default_source_prior(state)
    estimator = PriorEstimator.from_dict(state.meta.get("prior_estimator"))
    probs = calib.probs(method.posterior_logits(test_out))
    plain, labels = np.asarray(test_out["label"]), ds.test.labels

    def scores(preds: np.ndarray, truth: np.ndarray) -> dict[str, float]:
        return {"accuracy": float((preds == truth).mean()), "balanced_accuracy": balanced_accuracy(preds, truth, C)}

    own_mix = site_train_mixes(ds) or {}
    sites: dict[str, Any] = {}
    for k, name in enumerate(ds.site_names):
        idx = np.flatnonzero(ds.test.sites == k)
        if len(idx) == 0:
            continue
        truth, p = labels[idx], probs[idx]
        counts = np.bincount(truth, minlength=C)
        est = estimator.for_site(own_mix.get(k)).estimate(p, source)
        sites[name] = {"n_test": int(len(idx)), "test_class_counts": [int(c) for c in counts],
                       "own": scores(plain[idx], truth),
                       "adapted": scores(adapt(p, source, est.prior).argmax(1), truth),
                       "oracle": scores(adapt(p, source, counts / counts.sum()).argmax(1), truth),
                       "estimated_mix": [float(v) for v in est.prior],
                       "estimate_tv": float(0.5 * np.abs(est.prior - counts / counts.sum()).sum())}
        if k in own_mix and own_mix[k].sum() > 0:  # the site's own training mix, fixed: no test images used
            sites[name]["site"] = scores(adapt(p, source, site_prior(own_mix[k])).argmax(1), truth)
    rules = ("own", "site", "adapted", "oracle") if sites and all("site" in v for v in sites.values()) \
        else ("own", "adapted", "oracle")
    mean = {rule: {m: float(np.mean([v[rule][m] for v in sites.values()])) for m in ("accuracy", "balanced_accuracy")}
            for rule in rules} if sites else {}
    return {"sites": sites, "site_mean": mean,
            "sites_without_test": [n for n in ds.site_names if n not in sites],
            "pooled_balanced_accuracy": balanced_accuracy(plain, labels, C)}


def adaptation_accuracies(probs: np.ndarray, labels: np.ndarray, ranks: np.ndarray, source: np.ndarray,
                          sizes: list[int], draws: int, seed: int, estimate=None,
                          plain: np.ndarray | None = None, boot: int = 0) -> dict[str, Any]:
    """Prior-weighted accuracies of the calibrated, adapted and oracle rules over the eleven distributions.

    `estimate(probs_of_the_drawn_images) -> prior` is the prior estimator (default: EM, `em_prior`). `plain`, the
    model's own labels for the same rows (an operating point, a vote), adds their accuracy as `plain`.

    Every distribution also gets `one_image`: the most one of these rows can move its prior-weighted accuracy
    (π_c over the rows of class c, at its largest), the finest difference the rows can show. With `boot` > 0 it
    gets `gap`: oracle − adapted at the largest n, with a paired bootstrap 90 % interval over the rows (resampled
    within each class, `boot` replicates; the same rows score both rules, so the interval is how sure these rows
    are of the difference, not of either accuracy)."""
    from tafl.prior import adapt, em_prior, total_variation
    from tafl.training.longtail import DISTRIBUTIONS, distribution_prior

    C = probs.shape[1]
    counts = np.bincount(labels, minlength=C)
    present = counts > 0
    rows = [np.flatnonzero(labels == c) for c in range(C)]

    def by_class(score: np.ndarray, sel: np.ndarray | slice = slice(None)) -> np.ndarray:
        """Per-class mean of a per-row score over the rows `sel` (0 for a class without rows)."""
        lab = labels[sel]
        return np.bincount(lab, weights=score[sel], minlength=C) / np.maximum(np.bincount(lab, minlength=C), 1)

    def correct(preds: np.ndarray) -> np.ndarray:
        return (np.asarray(preds) == labels).astype(np.float64)

    resamples = []
    if boot > 0:  # one resampling of the rows per replicate, shared by every distribution
        rng_boot = np.random.default_rng([seed, 997])
        resamples = [np.concatenate([rng_boot.choice(r, len(r), replace=True) for r in rows if len(r)])
                     for _ in range(boot)]
    big = max(sizes) if sizes else None
    out: dict[str, Any] = {"distributions": {}}
    avg: dict[str, list[float]] = {"calibrated": [], "oracle": [], **{f"adaptive_{n}": [] for n in sizes},
                                   **{f"tv_{n}": [] for n in sizes}, **({"plain": []} if plain is not None else {})}
    for i, (name, kind, imf) in enumerate(DISTRIBUTIONS):
        prior = distribution_prior(ranks, kind, imf)
        target = np.where(present, prior, 0.0)
        target = target / target.sum()
        oracle_ok = correct(adapt(probs, source, target).argmax(1))
        d: dict[str, Any] = {"calibrated": float((target * by_class(correct(probs.argmax(1)))).sum()),
                             "oracle": float((target * by_class(oracle_ok)).sum()), "adaptive": {},
                             "one_image": float((target / np.maximum(counts, 1)).max())}
        if plain is not None:
            d["plain"] = float((target * by_class(correct(plain))).sum())
            avg["plain"].append(d["plain"])
        for n in sizes:
            accs, tvs, oks = [], [], []
            for k in range(draws):
                rng = np.random.default_rng([seed, 313, i, n, k])
                per_class = rng.multinomial(n, target)
                idx = np.concatenate([rng.choice(rows[c], m, replace=True) for c, m in enumerate(per_class) if m])
                q = em_prior(probs[idx], source).prior if estimate is None else estimate(probs[idx])
                ok = correct(adapt(probs, source, q).argmax(1))
                oks.append(ok)
                accs.append(float((target * by_class(ok)).sum()))
                tvs.append(total_variation(q, target))
            d["adaptive"][str(n)] = {"accuracy": float(np.mean(accs)), "accuracy_sd": float(np.std(accs)),
                                     "tv": float(np.mean(tvs))}
            avg[f"adaptive_{n}"].append(float(np.mean(accs)))
            avg[f"tv_{n}"].append(float(np.mean(tvs)))
            if n == big and resamples:
                diff = oracle_ok - np.mean(oks, axis=0)  # per row: oracle right minus the draws' share right
                reps = [float((target * by_class(diff, sel)).sum()) for sel in resamples]
                d["gap"] = {"n": int(n), "value": float((target * by_class(diff)).sum()),
                            "lo": float(np.percentile(reps, 5)), "hi": float(np.percentile(reps, 95)),
                            "replicates": int(boot)}
        avg["calibrated"].append(d["calibrated"])
        avg["oracle"].append(d["oracle"])
        out["distributions"][name] = d
    out["average"] = {k: float(np.mean(v)) for k, v in avg.items()}
    return out


def evaluate_checkpoint(ck: dict[str, Any], ds: Dataset,
                        method: Method | None = None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The report of a checkpoint on the dataset's test split (and its validation split), and the
    test outputs (probabilities, predictions, true labels) for the plots."""
    cfg = RunConfig.from_dict(ck["run_config"], "checkpoint run_config")
    model_cfg = ModelConfig.from_dict(ck["model_config"])
    if list(ds.class_names) != list(ck["class_names"]):
        raise CheckpointError(f"the checkpoint's classes {ck['class_names']} differ from the dataset's "
                              f"{ds.class_names}")
    from tafl.imaging import Preprocess

    pre = Preprocess.from_dict(ck["preprocess"])
    if ds.test.images.shape[1:] != (pre.size, pre.size, pre.channels):
        raise CheckpointError(f"the dataset was loaded at {ds.test.images.shape[1:]}, the model takes "
                              f"{(pre.size, pre.size, pre.channels)}")
    if method is None:
        method = make_method(cfg, model_cfg, pre, resolve_device(cfg.device))
    state = GlobalState.from_dict(ck["state"])
    ranks = np.asarray(ck["class_ranks"])
    t0 = time.perf_counter()
    module = method.inference_model(state).to(method.device)
    out = predict(module, ds.test.images, method.normalize, cfg.eval_batch_size, keys=method.output_keys)
    report: dict[str, Any] = {"method": ck["method"], "dataset": cfg.dataset, "label": ck["method"],
                              "config": ck["run_config"], "class_names": ck["class_names"],
                              "class_ranks": ck["class_ranks"], "train_class_counts": ck["train_class_counts"],
                              "client_class_counts": ck.get("client_class_counts")}
    report.update(evaluate_outputs(out["probs"], out["label"], ds.test.labels, ranks, cfg.test_seed))
    report.update(method.extra_report(state, out, ds.test, ranks))
    if state.meta.get("decision"):  # the operating point the labels above were decided at
        report["decision"] = state.meta["decision"]
    if state.meta.get("pretraining"):  # the extractor's server-side SimCLR before round 1
        report["pretraining"] = state.meta["pretraining"]
    from tafl.training.privacy import privacy_section

    report["privacy"] = privacy_section(cfg, (ck.get("book") or {}).get("privacy"), cfg.secure_aggregation)
    val = predict(module, ds.val.images, method.normalize, cfg.eval_batch_size, keys=method.output_keys)
    val_ev = evaluate_outputs(val["probs"], val["label"], ds.val.labels, ranks, cfg.test_seed)
    # accuracy: plain, on the validation split as it comes; distribution_accuracy: prior-weighted per distribution
    report["validation"] = {"accuracy": float((val["label"] == ds.val.labels).mean()),
                            "balanced_accuracy": balanced_accuracy(val["label"], ds.val.labels, len(ds.class_names)),
                            "average_accuracy": val_ev["average_accuracy"],
                            "distribution_accuracy": {k: d["accuracy"] for k, d in val_ev["test_distributions"].items()}}
    if "expert_labels" in val:  # each expert on the validation split too: specialisation is checked there
        names = list(state.meta.get("experts") or [])
        report["validation"]["experts"] = {}
        for e, name in enumerate(names):
            ev = evaluate_outputs(val["expert_probs"][:, e], val["expert_labels"][:, e], ds.val.labels, ranks,
                                  cfg.test_seed)
            report["validation"]["experts"][name] = {"average_accuracy": ev["average_accuracy"],
                                                     **{k: d["accuracy"] for k, d in ev["test_distributions"].items()}}
        report["validation"]["vote_rules"] = vote_rule_accuracies(val, names, state.meta, ds.val.labels, ranks,
                                                                  cfg.test_seed)
    _prior_adaptation(report, method, state, cfg, out, val, ds, ranks)
    if ds.test.sites is not None and ds.site_names:
        report.update(site_evaluation(method, state, out, ds))
    book = ck.get("book", {})
    report["timing"] = dict(book.get("timing", {}), test_eval_s=time.perf_counter() - t0)
    report["communication"] = dict(book.get("communication", {}))
    report["history"] = book.get("history", [])
    if "finish" in book:
        report["finishing_round"] = book["finish"]
    report["data_provenance"] = ck.get("data_provenance", {})
    report["selected_round"] = ck["round"]
    report["tafl_version"] = tafl.__version__
    return report, {"probs": out["probs"], "label": out["label"], "labels": ds.test.labels}
