"""The round loop: each training round's steps in order (select, statistics, plan, payload, client updates, server
update), its bookkeeping (history, time, bytes, the privacy ledger), validation, a checkpoint every round and the
divergence guard; and the features-only finishing round a method may ask for after the last one."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tafl.errors import CheckpointError
from tafl.training.checkpoint import latest_round_checkpoint, load_checkpoint, save_checkpoint
from tafl.training.config import RunConfig
from tafl.training.contract import GlobalState, Method, RoundConfig, tensor_bytes
from tafl.training.data import Dataset, Split
from tafl.training.evaluate import balanced_accuracy, predict
from tafl.training.longtail import select_clients
from tafl.training.prepare import Prepared
from tafl.training.transport import Transport

log = logging.getLogger(__name__)


def new_book() -> dict[str, Any]:
    """What a run accumulates besides the model: per-round history, time, bytes, the best round so far."""
    return {"history": [], "timing": {"client_s": 0.0, "server_s": 0.0, "eval_s": 0.0},
            "communication": {"uplink_bytes": 0, "downlink_bytes": 0}, "best": None}


def resume_state(ckpt_dir: Path, prep: Prepared, state: GlobalState,
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


def round_loop(method: Method, state: GlobalState, transport: Transport, cfg: RunConfig, book: dict[str, Any],
               common: dict[str, Any], ds: Dataset, ckpt_dir: Path, start: int,
               progress: bool | None) -> GlobalState:
    """Rounds start+1 .. cfg.rounds: train, validate every eval_every rounds, checkpoint every round."""
    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm(), tqdm(total=cfg.rounds, initial=start, desc=f"{cfg.method} rounds", unit="round",
                                       disable=(not progress) if progress is not None else None,
                                       dynamic_ncols=True) as bar:
        for r in range(start + 1, cfg.rounds + 1):
            state = one_round(method, state, transport, r, cfg, book)
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
            bar.set_postfix(loss=loss, val_acc=pct(h.get("val_acc")), val_bacc=pct(h.get("val_bacc")))
            log.info("round %d/%d: loss %s, val acc %s, val balanced acc %s, %.1f s", r, cfg.rounds, loss,
                     pct(h.get("val_acc")), pct(h.get("val_bacc")), h["seconds"])
    return state


def one_round(method: Method, state: GlobalState, transport: Transport, r: int, cfg: RunConfig,
              book: dict[str, Any]) -> GlobalState:
    t_round = time.perf_counter()
    selected = select_clients(transport.num_clients, cfg.frac, cfg.seed, r)
    stats = transport.stats(selected)
    round_cfg = method.round_config(state, stats, r)
    payload = {**method.broadcast(state), **method.head_basis(state)}  # the basis: train_scope head
    results, cost = transport.train(selected, payload, round_cfg)
    privacy_ledger(method, book, results, cost)
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


def privacy_ledger(method: Method, book: dict[str, Any], results: list, cost: dict[str, Any]) -> None:
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
                                         "plan": method.privacy.plan(n).to_dict()})
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
                + cfg.settings().divergence_hint(cfg))
        raise TrainingDiverged(f"training diverged in round {h['round']}: {why}. No model was written; the "
                               f"checkpoints of earlier rounds are kept. Try: {hint}.")


def charge(book: dict[str, Any], cost: dict[str, Any]) -> None:
    """Book a features-only or calibration round's bytes and client time."""
    comm = book["communication"]
    comm["downlink_bytes"] += cost["downlink_bytes"]
    comm["uplink_bytes"] += cost["uplink_bytes"]
    for key in ("wire_uplink_bytes", "wire_downlink_bytes"):
        if key in cost:
            comm[key] = comm.get(key, 0) + cost[key]
    book["timing"]["client_s"] += cost["client_s"]


def finish_round(method: Method, state: GlobalState, transport: Transport, round_cfg: RoundConfig,
                 cfg: RunConfig, book: dict[str, Any]) -> GlobalState:
    """The method's finishing round on the kept model: a share of the clients answer a features-only
    round (no local training) and the server's last step uses it (GTAFL: the experts' last retraining)."""
    t_round = time.perf_counter()
    ids = select_clients(transport.num_clients, round_cfg["clients_frac"], cfg.seed, round_cfg["round"])
    payload = method.broadcast(state)
    results, cost = transport.train(ids, payload, round_cfg)
    privacy_ledger(method, book, results, cost)
    charge(book, cost)
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


def validate(method: Method, state: GlobalState, val: Split, batch_size: int) -> tuple[float, float]:
    module = method.inference_model(state).to(method.device)
    out = predict(module, val.images, method.normalize, batch_size, keys=("label",))
    preds = out["label"]
    return float((preds == val.labels).mean()), balanced_accuracy(preds, val.labels, int(method.model_cfg.num_classes))


def pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.2f}%"
