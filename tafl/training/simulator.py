"""The run driver of docs/design.md, "Federated learning": `train` prepares a run (tafl.training.prepare), runs its rounds
(tafl.training.rounds) over a transport (in-process by default; Flower's engine passes its own), then finishes the
kept model and writes its report.

The in-process transport keeps one copy of the data (clients hold index tensors into it) and one working model
inside the method. After every round an atomic checkpoint is written; `resume=True` continues a killed run from the
newest one and, because every random draw is a function of (seed, round, client), ends with exactly the weights of
an uninterrupted run. The kept model (last round, or best validation balanced accuracy with `select: val`) gets its
finishing round, operating point (tafl.training.estimator), federated calibration (tafl.training.calibrate) and
case-mix estimator, goes to `OUT/final.pt` and is evaluated on the eleven test distributions
(tafl.training.checkpoint_eval).

The functions that lived here before the driver was split keep their names here too (re-exported below), so
`tafl.training.simulator.evaluate_checkpoint` and the like still resolve.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

import tafl
from tafl.errors import ConfigError
from tafl.training.calibrate import CALIB_KEYS, calibrate, calibration_problem, check_calibration  # noqa: F401
from tafl.training.checkpoint import save_checkpoint
from tafl.training.checkpoint_eval import evaluate_checkpoint
from tafl.training.config import RunConfig
from tafl.training.contract import ClientData, GlobalState, Method
from tafl.training.data import Dataset
from tafl.training.detector import fit_detector
from tafl.training.sets import fit_sets
from tafl.training.estimator import (choose_operating_point, choose_prior_estimator,  # noqa: F401  (re-exported)
                                     select_prior_smoothing, select_prior_smoothing_sites)
from tafl.training.longtail import ranks_from_counts, select_clients  # noqa: F401  (select_clients: re-exported)
from tafl.training.prepare import (Prepared, check_compatible, check_privacy_data, make_method,  # noqa: F401
                                   prepare, resolve_device, server_pool, site_parts)
from tafl.training.prior_eval import GAP_BOOT, adaptation_accuracies  # noqa: F401  (re-exported)
from tafl.training.report import write_report
from tafl.training.rounds import (check_divergence, finish_round, new_book, pct, resume_state,  # noqa: F401
                                  round_loop, validate)
from tafl.training.rundir import discard_unstarted_run, now, prepare_out
from tafl.training.site_eval import site_evaluation, site_train_mixes  # noqa: F401  (re-exported)
from tafl.training.transport import InProcessTransport, Transport

log = logging.getLogger(__name__)


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
    cfg = prepare_out(out, cfg.validate(), resume, force)
    try:
        return _train_logged(cfg, out, resume, progress, init_from, parent_package, transport_factory)
    except BaseException:
        if not resume:
            discard_unstarted_run(out, fresh)
        raise


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
    book, start = new_book(), 0
    if resume:
        state, start, book = resume_state(out / "checkpoints", prep, state, book)
    common = _common_fields(cfg, prep)
    if method.dp:  # what the federation knows of its mix is the sites' noisy census, not the exact counts
        noisy = state.extras["global_counts"].numpy()
        common.update(train_class_counts=[int(round(float(c))) for c in noisy], client_class_counts=None,
                      class_ranks=[int(r) for r in ranks_from_counts(noisy)])
    if parent_package:
        common["parent_package"] = parent_package
    state = round_loop(method, state, transport, cfg, book, common, prep.dataset, out / "checkpoints", start,
                       progress)
    return _finalise(method, state, transport, cfg, book, common, prep.dataset, out)


def _setup(cfg: RunConfig, device: torch.device, init_from: dict[str, Any] | None,
           transport_factory) -> tuple[Prepared, Method, Transport]:
    """The data, the method and the transport that reaches its clients (default: in-process)."""
    prep = prepare(cfg)
    ds = prep.dataset
    if init_from is not None:
        from tafl.imaging import Preprocess

        check_compatible(init_from, prep)
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
        # the parent's calibration, operating point, case-mix estimator, in-domain detector and conformal sets
        # describe the parent's weights: the retrained model fits its own (they are carried through every round's
        # meta otherwise, and a stale one would skip the new fit)
        meta = {k: v for k, v in start_state.meta.items()
                if k not in ("calibration", "decision", "prior_estimator", "domain_detector", "conformal")}
        extras = {k: v for k, v in start_state.extras.items()
                  if not k.startswith(("domain.", "conformal."))}  # refitted too
        state = GlobalState(start_state.weights, {**state.extras, **extras}, {**meta, "client_counts": {}, "round": 0})
    method.round_config(state, transport.census(), 0)
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
        kept = finish_round(method, kept, transport, finish_cfg, cfg, book)
    if cfg.decision == "validation" and "decision" not in kept.meta:  # before calibration: GTAFL's moves its experts
        kept = choose_operating_point(method, kept, ds, cfg)
    if cfg.calibration != "none" and "calibration" not in kept.meta:
        kept = calibrate(method, kept, transport, cfg, book)
        if cfg.calibration_check:
            kept = check_calibration(method, kept, ds.val.images, ds.val.labels, cfg.eval_batch_size)
    if "calibration" not in kept.meta:  # uncalibrated: record the prior its posteriors describe, for the package
        from tafl.prior import Calibration

        identity = Calibration(source_prior=np.asarray(method.default_source_prior(kept), np.float64))
        kept = GlobalState(kept.weights, kept.extras, dict(kept.meta, calibration=identity.to_dict()))
    if "prior_estimator" not in kept.meta:
        kept = choose_prior_estimator(method, kept, ds, cfg, np.asarray(common["class_ranks"]))
    if "domain_detector" not in kept.meta:
        kept = fit_detector(method, kept, transport, cfg, ds.val.images, book)
    if "conformal" not in kept.meta:
        kept = fit_sets(method, kept, transport, cfg, ds.val, book, ds.site_names)
    final = {**common, "state": kept.to_dict(), "round": kept_round, "book": {k: v for k, v in book.items()
                                                                              if k != "best"}}
    save_checkpoint(final, out / "final.pt")
    report, outputs = evaluate_checkpoint(final, ds, method=method)
    report.update(selected_round=kept_round, selection=cfg.select, rounds_run=cfg.rounds)
    write_report(out, report, outputs)
    log.info("mean prior-weighted accuracy over the eleven distributions: %s (backward50 %s, forward50 %s)",
             pct(report["average_accuracy"]), pct(report["test_distributions"]["backward50"]["accuracy"]),
             pct(report["test_distributions"]["forward50"]["accuracy"]))
    return report


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
        "created": now(),
    }
