"""What the coordinator can learn from what GTAFL's clients send (issue 34): a leakage check a reviewer can run.

The server receives, per client, its class counts (the census) and, every round, its per-class feature sums, sums of
squares and counts with its expert gradients. Two attacks on exactly those messages, built by tafl's own client code
(`Method.client_stats`, `GTAFL.feature_extras`, and under DP `GTAFL.private_feature_extras`):

  (a) counts: each client's class counts read off the census; the share of (client, class) cells recovered exactly
      (after rounding) and the mean absolute error;
  (b) nearest image: for each rare cell (a client holding 1 to 3 images of a class), the received class mean
      (feature sum / count) against a candidate pool of every training image of that class in the federation
      (features clipped as the release clips them); success when the nearest candidate is one of that client's
      images. Chance is the client's share of the pool.

Protections, each on the same clients and features:
  none                the plaintext messages;
  dp eps=E            record-level DP at ε = E (δ 1e-5, the run config's noise plan for a full run of its rounds);
                      a class whose noisy count is not clear of the noise is not sent at all (counted as a miss);
  secagg              SecAgg+: the server sees sums over a round's clients only (the census total; per class the
                      sums over the round's holders). The sums are Flower's SecAgg+ output to within its
                      quantisation error (tests/training/test_secagg.py), so they are formed here directly;
  secagg + dp eps=E   both.
Under SecAgg the attacker's target is unchanged (the client's own images); the received mean is the round's sum
over every client holding the class divided by the total count. A class held by one client alone in the round is
that client's numbers, sum or not: the check reports how often that happens.

Usage: python benchmarks/leakage.py [--config configs/benchmark.yaml] [--data-root DIR] [--eps 8,3,1]
           [--checkpoint RUN/final.pt] [--repeats 3] [--out benchmarks/results/leakage.json]
Features come from the checkpoint's extractor when given, else from the config's freshly initialised (seeded)
GroupNorm ResNet-8; the attack needs no training to work (random features already identify an image).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tafl.training.config import load_config  # noqa: E402
from tafl.training.methods import method_class  # noqa: E402
from tafl.training.contract import ClientData  # noqa: E402
from tafl.training.privacy import clip_rows  # noqa: E402
from tafl.training.simulator import prepare, select_clients  # noqa: E402


# GTAFL as a DP run can train it: no GI-GDS, no federated calibration (a config may ask for both)
PLAIN_GTAFL = {"method": "gtafl", "gs": False, "calibration": "none", "calib_holdout": 0}


def _method(cfg_path: str, overrides: dict, prep, noise_seed: int):
    cfg = load_config(cfg_path, {**overrides, **PLAIN_GTAFL})
    m = method_class("gtafl")(cfg, prep.model_cfg, prep.dataset.preprocess)
    m.privacy.noise = torch.Generator().manual_seed(noise_seed)  # a fixed draw per repeat (runs seed it from the OS)
    return m


def client_view(m, feats: torch.Tensor, labels: torch.Tensor, parts, images, W, b, eps: float | None):
    """Per client: the census counts and one round's statistics, as that method's clients send them."""
    out = []
    for k, rows in enumerate(parts):
        rows_t = torch.from_numpy(rows)
        data = ClientData(k, images, labels, rows_t, m.model_cfg.num_classes)
        counts = m.client_stats(data)["class_counts"].double()
        f, y = feats[rows_t], labels[rows_t]
        ex = m.private_feature_extras(f, y, W, b, len(rows)) if eps is not None else m.feature_extras(f, y, W, b)
        C, D = m.model_cfg.num_classes, feats.shape[1]
        S, N = torch.zeros(C, D, dtype=torch.float64), torch.zeros(C, dtype=torch.float64)
        S[ex["grad_classes"]] = ex["stat_sum"].double()
        N[ex["grad_classes"]] = ex["stat_count"].double()
        out.append({"counts": counts, "S": S, "N": N})
    return out


def attack(view, parts, labels, feats_clip, secagg_rounds: list[list[int]] | None, participants: set[int],
           debug: bool = False):
    """(a) count recovery and (b) nearest-image matches for rare cells; with SecAgg the server sees sums only."""
    C = len(view[0]["counts"])
    true = np.stack([np.bincount(labels[torch.from_numpy(p)].numpy(), minlength=C) for p in parts])
    if secagg_rounds is None:
        seen_counts = np.stack([v["counts"].numpy() for v in view])
    else:  # the census total only: the best per-client guess is the total split evenly
        seen_counts = np.tile(sum(v["counts"].numpy() for v in view) / len(view), (len(view), 1))
    exact = float((np.round(seen_counts) == true).mean())
    mae = float(np.abs(seen_counts - true).mean())
    hits, chance, sent, alone, total = 0, 0.0, 0, 0, 0
    lab = labels.numpy()
    for k, rows in enumerate(parts):
        if k not in participants:
            continue  # a client no round selects sends no statistics
        for c in range(C):
            n_kc = int(true[k, c])
            if not 1 <= n_kc <= 3:
                continue
            total += 1
            if secagg_rounds is None:
                S, N = view[k]["S"][c], float(view[k]["N"][c])
            else:  # the sum over the clients of a round that includes k
                members = next(r for r in secagg_rounds if k in r)
                S = sum(view[j]["S"][c] for j in members)
                N = float(sum(view[j]["N"][c] for j in members))
                alone += int(sum(true[j, c] > 0 for j in members) == 1)
            pool = np.flatnonzero(lab == c)
            chance += n_kc / len(pool)
            if N < 1:
                continue  # not released
            sent += 1
            mean = (S / N).float()
            d = torch.cdist(mean[None], feats_clip[torch.from_numpy(pool)].float())[0]
            nearest = int(pool[int(d.argmin())])
            own = set(rows[lab[rows] == c].tolist())
            hits += int(nearest in own)
            if debug:
                print(k, c, n_kc, N, nearest in own, float(d.min()), sorted(own)[:3], nearest)
    return {"counts_exact_share": exact, "counts_mae": mae, "rare_cells": total, "rare_cells_released": sent,
            "nearest_image_hits": hits, "nearest_image_rate": hits / total if total else None,
            "chance_rate": chance / total if total else None,
            **({"rare_cells_alone_in_round": alone} if secagg_rounds is not None else {})}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs/benchmark.yaml"))
    ap.add_argument("--data-root", default=str(ROOT.parent / "shared/data/medmnist"))
    ap.add_argument("--eps", default="8,3,1")
    ap.add_argument("--checkpoint")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--debug", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/leakage.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    base = {"data_root": args.data_root}
    cfg = load_config(args.config, {**base, **PLAIN_GTAFL})
    prep = prepare(cfg)
    images = torch.from_numpy(prep.train.images)
    labels = torch.from_numpy(prep.train.labels)
    torch.manual_seed(cfg.seed)  # the fresh extractor is the config seed's
    m0 = _method(args.config, {**base, "dp_epsilon": 8.0}, prep, 0)  # GroupNorm model, as a DP run trains
    if args.checkpoint:
        from tafl.training.checkpoint import load_checkpoint

        m0.model.load_state_dict(load_checkpoint(args.checkpoint)["state"]["weights"])
    m0.model.eval()
    with torch.no_grad():
        feats = torch.cat([m0.model.features(m0.normalize(images[i:i + 256])) for i in range(0, len(images), 256)])
    D = feats.shape[1]
    feats_clip = clip_rows(feats.double(), cfg.dp_feature_clip * D ** 0.5)
    E, C = 3, prep.model_cfg.num_classes
    W, b = torch.zeros(E, C, D), torch.zeros(E, C)
    per_round = max(1, int(round(cfg.frac * cfg.clients)))
    rounds = [select_clients(cfg.clients, cfg.frac, cfg.seed, r) for r in range(1, cfg.rounds + 1)]
    # SecAgg: the round in which each client is first summed (every client that ever takes part)
    first = {}
    for r in rounds:
        for k in r:
            first.setdefault(k, r)
    secagg_rounds = [first[k] for k in range(cfg.clients) if k in first]
    eps_list = [None] + [float(e) for e in args.eps.split(",") if e.strip()]
    results = []
    for eps in eps_list:
        for secagg in (False, True):
            reps = []
            for rep in range(args.repeats if eps is not None else 1):
                m = _method(args.config, {**base, **({"dp_epsilon": eps} if eps is not None else {})}, prep, 100 + rep)
                # clipped features (what a DP release sums), also without DP: the attack compares like with like
                view = client_view(m, feats_clip.float() if eps is None else feats, labels, prep.parts, images,
                                   W, b, eps)
                parts = prep.parts if not secagg else prep.parts
                reps.append(attack(view, parts, labels, feats_clip, secagg_rounds if secagg else None,
                                   set(first), debug=bool(args.debug)))
            row = {"protection": ("secagg + " if secagg else "") + ("none" if eps is None and not secagg else
                                                                   f"dp eps={eps:g}" if eps is not None else "")
                   .strip() or "secagg", "epsilon": eps, "secure_aggregation": secagg, "repeats": len(reps)}
            row["protection"] = row["protection"].rstrip(" +").replace("secagg + none", "secagg")
            for key in reps[0]:
                vals = [r[key] for r in reps if r[key] is not None]
                row[key] = {"mean": float(np.mean(vals)), "sd": float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0} \
                    if vals else None
            results.append(row)
            print(f"{row['protection']:>20}: counts exact {row['counts_exact_share']['mean']:.3f} "
                  f"(MAE {row['counts_mae']['mean']:.2f}); rare cells {int(row['rare_cells']['mean'])}, released "
                  f"{row['rare_cells_released']['mean']:.1f}, nearest-image hits "
                  f"{row['nearest_image_rate']['mean']:.3f} (chance {row['chance_rate']['mean']:.3f})", flush=True)
    out = {"config": args.config, "dataset": cfg.dataset, "clients": cfg.clients, "per_round": per_round,
           "feature_dim": D, "features": args.checkpoint or "fresh GroupNorm ResNet-8 (seeded)",
           "feature_clip": cfg.dp_feature_clip * D ** 0.5, "delta": cfg.dp_delta, "rounds_planned": cfg.rounds,
           "machine": platform.machine(), "seconds": time.perf_counter() - t0, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    md = Path(args.out).with_suffix(".md")
    lines = [f"# Leakage check: {cfg.dataset}, {cfg.clients} clients ({per_round} a round), features {out['features']}",
             "", "From what the server receives (census counts; one round's class statistics). Mean ± sd over "
             f"{args.repeats} noise draws where DP is on.", "",
             "| protection | counts recovered exactly | counts MAE | rare cells (1-3 images) | released | "
             "nearest image is theirs | chance |", "|---|---|---|---|---|---|---|"]
    for r in results:
        f = lambda v, d=3: "—" if v is None else (f"{v['mean']:.{d}f}" + (f" ± {v['sd']:.{d}f}" if v["sd"] else ""))  # noqa: E731
        lines.append(f"| {r['protection']} | {f(r['counts_exact_share'])} | {f(r['counts_mae'], 2)} | "
                     f"{int(r['rare_cells']['mean'])} | {f(r['rare_cells_released'], 1)} | "
                     f"{f(r['nearest_image_rate'])} | {f(r['chance_rate'])} |")
    alone = next((r.get("rare_cells_alone_in_round") for r in results if r["secure_aggregation"]), None)
    if alone:
        lines += ["", f"Under SecAgg, {alone['mean']:.0f} of the rare cells belong to a class no other client in the "
                  "same round holds: the sum is that client's numbers."]
    md.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out} and {md} in {out['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
