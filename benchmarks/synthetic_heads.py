"""Which synthetic features train a good linear head? The measurement behind docs/decisions.md, "Decisions, each taken on the validation split", decision 2.

    python benchmarks/synthetic_heads.py RUN_DIR [RUN_DIR ...]

For each run's final extractor (a run folder with `final.pt`): embed its long-tailed training
split and its validation split, then train the same linear head (SGD, lr 0.01, batch 32, from
zero) on
- the real training features, class-balanced sampling (the ceiling for a head on this extractor);
- 100 real training features per class;
- 100 draws per class from N(μ_c, diag σ_c²) of the real features (what `bank_init: stats` starts
  from), and from N(μ_c, Σ_c) with the full covariance;
- 100 draws per class from N(μ_c, I): the class means with CReFF's isotropic unit noise,
and score each head on the validation split (eleven-distribution mean, forward50, backward50).
The test split is not read. Writes benchmarks/results/synthetic_heads.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tafl.training.config import RunConfig  # noqa: E402
from tafl.training.evaluate import evaluate_outputs  # noqa: E402
from tafl.training.models import build_model  # noqa: E402
from tafl.training.simulator import prepare  # noqa: E402


@torch.no_grad()
def embed(run: Path):
    cfg = RunConfig.from_dict(json.loads((run / "run.json").read_text())["config"], str(run / "run.json"))
    if cfg.bank_init == "auto":
        cfg.bank_init = "normal"
    prep = prepare(cfg.validate())
    model = build_model(prep.model_cfg)
    model.load_state_dict(torch.load(run / "final.pt", weights_only=True)["state"]["weights"])
    model.eval()
    pre = prep.dataset.preprocess

    def feats(images):
        return torch.cat([model.features(torch.from_numpy(pre.normalize(images[s:s + 512])))
                          for s in range(0, len(images), 512)])
    return (feats(prep.train.images), torch.from_numpy(prep.train.labels), feats(prep.dataset.val.images),
            prep.dataset.val.labels, prep.ranks)


def fit(X, Y, C, epochs, gen, weights=None, lr=0.01, batch=32):
    W, b = torch.zeros(C, X.shape[1]), torch.zeros(C)
    n = len(X)
    for _ in range(epochs):
        order = (torch.randperm(n, generator=gen) if weights is None
                 else torch.multinomial(weights, n, replacement=True, generator=gen))
        for s in range(0, n, batch):
            i = order[s:s + batch]
            p = torch.softmax(X[i] @ W.t() + b, -1)
            p[torch.arange(len(i)), Y[i]] -= 1
            W -= lr * p.t() @ X[i] / len(i)
            b -= lr * p.sum(0) / len(i)
    return W, b


def score(W, b, X, y, ranks):
    p = torch.softmax(X @ W.t() + b, -1).numpy()
    ev = evaluate_outputs(p, p.argmax(1), y, ranks)
    return {"avg": ev["average_accuracy"], "forward50": ev["test_distributions"]["forward50"]["accuracy"],
            "backward50": ev["test_distributions"]["backward50"]["accuracy"]}


def one_run(run: Path, seed: int = 1) -> dict:
    tr, ytr, va, yva, ranks = embed(run)
    C, D = len(ranks), tr.shape[1]
    g = torch.Generator().manual_seed(seed)
    counts = torch.bincount(ytr, minlength=C).float()
    mu = torch.stack([tr[ytr == c].mean(0) for c in range(C)])
    sd = torch.stack([tr[ytr == c].std(0) for c in range(C)])
    y100 = torch.arange(C).repeat_interleave(100)
    out = {}
    W, b = fit(tr, ytr, C, 30, g, weights=(1 / counts)[ytr])
    out["real features, class-balanced sampling"] = score(W, b, va, yva, ranks)
    idx = torch.cat([torch.nonzero(ytr == c).squeeze(1)[torch.randperm(int(counts[c]), generator=g)[:100]]
                     for c in range(C)])
    W, b = fit(tr[idx], ytr[idx], C, 300, g)
    out["100 real features per class"] = score(W, b, va, yva, ranks)
    Xd = torch.cat([mu[c] + sd[c] * torch.randn(100, D, generator=g) for c in range(C)])
    W, b = fit(Xd, y100, C, 300, g)
    out["N(mu_c, diag sigma_c^2), 100 per class"] = score(W, b, va, yva, ranks)
    Xf = []
    for c in range(C):
        z = tr[ytr == c].double()
        L = torch.linalg.cholesky(torch.cov(z.t()) + 1e-4 * torch.eye(D, dtype=torch.float64))
        Xf.append((mu[c].double() + torch.randn(100, D, generator=g, dtype=torch.float64) @ L.t()).float())
    W, b = fit(torch.cat(Xf), y100, C, 300, g)
    out["N(mu_c, Sigma_c) full covariance, 100 per class"] = score(W, b, va, yva, ranks)
    Xi = torch.cat([mu[c] + torch.randn(100, D, generator=g) for c in range(C)])
    W, b = fit(Xi, y100, C, 300, g)
    out["N(mu_c, I), 100 per class"] = score(W, b, va, yva, ranks)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="+", type=Path)
    a = p.parse_args()
    torch.set_num_threads(2)
    res = {run.name: one_run(run) for run in a.runs}
    rows = list(next(iter(res.values())))
    lines = ["# synthetic_heads", "", f"`python benchmarks/synthetic_heads.py {' '.join(r.name for r in a.runs)}` "
             f"({time.strftime('%Y-%m-%d')}): a linear head trained on each kind of feature, scored on the validation "
             "split of each run's final extractor; mean ± sd over the runs.", "",
             "| training features | val mean (11) | val forward50 | val backward50 |", "|---|---|---|---|"]
    for row in rows:
        cells = []
        for k in ("avg", "forward50", "backward50"):
            xs = [100 * r[row][k] for r in res.values()]
            cells.append(f"{statistics.mean(xs):.2f} ± {statistics.stdev(xs) if len(xs) > 1 else 0:.2f}")
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    out = REPO / "benchmarks" / "results"
    (out / "synthetic_heads.json").write_text(json.dumps(res, indent=1))
    (out / "synthetic_heads.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
