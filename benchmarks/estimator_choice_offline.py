"""Offline: the estimator training chose (the confusion-matrix estimator, where it won on validation) against the best
EM candidate of the same validation scores, on the test split of the claims protocol's runs (mean of the eleven, adapted
to 500 images, 5 draws). Run from the repository root after benchmarks/claims_protocol.py:

    python benchmarks/estimator_choice_offline.py dermamnist,pneumoniamnist

Writes benchmarks/results/estimator_choice_offline.json."""

import json, sys
import numpy as np
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from estimator_guard_offline import outputs, window
from claims_protocol import run_dir
from tafl.prior import PriorEstimator, adapt
from tafl.training.longtail import DISTRIBUTIONS, distribution_prior
res = {}
for s in sys.argv[1].split(","):
    for r in ("recommended", "fedavg_tau"):
        for k in range(1, 6):
            run = run_dir(s, r, k, 0.25)
            o, source, ranks, est = outputs(run)
            if est.kind != "confusion":
                continue
            sc = est.record["scores"]
            a_em = max((v, float(key)) for key, v in sc.items() if not key.startswith("conf"))[1]
            em = PriorEstimator(a_em, "uniform")
            pt, plain, yt = o["test"]
            C = pt.shape[1]
            rows = [np.flatnonzero(yt == c) for c in range(C)]
            counts = np.bincount(yt, minlength=C)
            def acc(pred, target):
                rec = np.bincount(yt, weights=(pred == yt).astype(float), minlength=C) / np.maximum(counts, 1)
                return float((target * rec).sum())
            out = {"em": [], "confusion": []}
            for i, (_, kind, imf) in enumerate(DISTRIBUTIONS):
                target = np.where(counts > 0, distribution_prior(ranks, kind, imf), 0.0); target /= target.sum()
                for name, e in (("em", em), ("confusion", est)):
                    vals = []
                    for d in range(5):
                        idx = window(rows, target, 500, np.random.default_rng([313, i, 500, d]))
                        vals.append(acc(adapt(pt, source, e.estimate(pt[idx], source).prior).argmax(1), target))
                    out[name].append(np.mean(vals))
            res[f"{s}/{r}/{k}"] = {n: float(np.mean(v)) for n, v in out.items()}
            print(s, r, k, {n: round(100 * float(np.mean(v)), 1) for n, v in out.items()}, flush=True)
d = [v["confusion"] - v["em"] for v in res.values()]
print("confusion - em on test: mean %+.1f, runs worse %d of %d" % (100 * np.mean(d), sum(x < 0 for x in d), len(d)))
json.dump(res, open("benchmarks/results/estimator_choice_offline.json", "w"), indent=1)
