"""A checkpoint's report: the model on the eleven test distributions, the validation split, prior-aware inference,
the sites (where the run had real ones), privacy, time and bytes. `tafl train` writes it for its kept model,
`tafl eval` for any checkpoint."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

import tafl
from tafl.errors import CheckpointError
from tafl.training.config import RunConfig
from tafl.training.contract import GlobalState, Method
from tafl.training.data import Dataset
from tafl.training.detector import detector_report
from tafl.training.ensemble import vote_rule_accuracies
from tafl.training.evaluate import balanced_accuracy, evaluate_outputs, predict
from tafl.training.models import ModelConfig
from tafl.training.prepare import make_method, resolve_device
from tafl.training.prior_eval import prior_adaptation
from tafl.training.site_eval import site_evaluation


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
                            "distribution_accuracy": {k: d["accuracy"]
                                                      for k, d in val_ev["test_distributions"].items()}}
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
    prior_adaptation(report, method, state, cfg, out, val, ds, ranks)
    detector = detector_report(method, state, ds, out["label"], cfg.eval_batch_size, cfg.test_seed,
                               cfg.ood_dicom_dir)
    if detector is not None:
        report["domain_detector"] = detector
    from tafl.prior import Calibration
    from tafl.training.sets import sets_report

    calib = Calibration.from_dict(state.meta.get("calibration"), len(ds.class_names))
    sets = sets_report(state, calib.probs(method.posterior_logits(out)), ds.test.labels, ranks, list(ds.class_names),
                       ds.test.sites, list(ds.site_names or []))
    if sets is not None:
        report["conformal"] = sets
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
