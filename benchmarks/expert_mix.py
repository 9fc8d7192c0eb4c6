"""Do GTAFL's experts specialise as built? A diagnostic that reads no test data.

    python benchmarks/expert_mix.py RUN [RUN ...] [--name NAME]

For each run's final.pt and each expert: the class mix of its GFF bank (what it was retrained on), the mix its
softmax implies on the validation split (mean probability) and the mix of its decisions there, and its validation
balanced accuracy; the training mix beside them. An expert whose decisions follow its bank's mix (forward toward
the head classes, backward toward the tail) specialises as designed; one whose decisions ignore its bank does not,
whatever the test split later says. Writes benchmarks/results/<NAME>.{json,md} (default expert_mix).

    --rebuild: also rebuild the experts from the run's stored GFF banks both ways (`expert_form` trained: each
    expert its own CE head; shifted: one balanced head plus each bank's log mix, docs/decisions.md, "Shifted experts"), same
    banks, same seed, and compare them on validation: each expert's head-class share and balanced accuracy and
    the hard vote's. Still no test data.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from prior_offline import open_run, write_results  # noqa: E402
from tafl.training.evaluate import predict  # noqa: E402


def tv(a: np.ndarray, b: np.ndarray) -> float:
    return float(0.5 * np.abs(np.asarray(a) - np.asarray(b)).sum())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--name", default="expert_mix")
    ap.add_argument("--rebuild", action="store_true", help="also rebuild the experts from the banks both ways")
    ns = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    payload, lines = {}, [f"# {ns.name}: GTAFL's experts on validation (no test data)", "",
                          "Per expert: total variation of its decisions' mix from its bank's mix and from the training "
                          "mix, the head-class (most common training class) share of its decisions, and its "
                          "validation balanced accuracy.", "",
                          "| run | expert | TV(decisions, bank) | TV(decisions, training) | head share: bank / decisions "
                          "| val bal. acc |", "|---|---|---|---|---|---|"]
    rebuilt_lines: list[str] = []
    for run in ns.runs:
        ck, cfg, ds, method, state = open_run(run)
        out = predict(method.inference_model(state), ds.val.images, method.normalize, 256, keys=method.output_keys)
        ep = np.asarray(out["expert_probs"])
        names = list(state.meta.get("experts") or method.names)
        banks = state.extras["gff.counts"].numpy().astype(np.float64)
        train = state.extras["global_counts"].numpy().astype(np.float64)
        train /= train.sum()
        head, y, C = int(np.argmax(train)), ds.val.labels, ep.shape[2]
        rows = {}
        for e, name in enumerate(names):
            pred = ep[:, e].argmax(1)
            decided = np.bincount(pred, minlength=C) / len(pred)
            bank = banks[e] / banks[e].sum()
            bal = float(np.mean([(pred[y == c] == c).mean() for c in range(C) if (y == c).any()]))
            rows[name] = {"bank_mix": bank.tolist(), "mean_softmax": ep[:, e].mean(0).tolist(),
                          "decision_mix": decided.tolist(), "val_balanced_accuracy": bal}
            lines.append(f"| {Path(run).name} | {name} | {tv(decided, bank):.3f} | {tv(decided, train):.3f} | "
                         f"{bank[head]:.2f} / {decided[head]:.2f} | {100 * bal:.1f} |")
        payload[str(run)] = {"training_mix": train.tolist(), "experts": rows}
        if ns.rebuild:
            payload[str(run)]["rebuilt"] = rebuilt = rebuild(method, state, ds, names)
            for form, r in rebuilt.items():
                shares = " / ".join(f"{v:.2f}" for v in r["head_share"])
                accs = " / ".join(f"{100 * v:.1f}" for v in r["val_balanced_accuracy"])
                rebuilt_lines.append(f"| {Path(run).name} | {form} | {shares} | {accs} | {100 * r['vote']:.1f} |")
    if rebuilt_lines:
        lines += ["", "Rebuilt from the stored banks (same banks, same seed): head-class share of each expert's "
                  f"decisions ({' / '.join(names)}), each expert's validation balanced accuracy, the hard vote's.", "",
                  "| run | expert_form | head share | val bal. acc | vote |", "|---|---|---|---|---|", *rebuilt_lines]
    write_results(ns.name, payload, lines)
    return 0


def rebuild(method, state, ds, names: list[str]) -> dict:
    """The experts retrained from the run's final banks in each `expert_form`, evaluated on validation."""
    import torch

    from tafl.training import gff
    from tafl.training.ensemble import ExpertEnsemble

    banks = gff.GFFBanks(state.extras["gff.features"], state.extras["gff.counts"])
    E, C, _, D = banks.features.shape
    centre = state.extras.get("gff.centre", torch.zeros(D))
    module = method.inference_model(state)
    with torch.no_grad():
        x = torch.as_tensor(np.asarray(ds.val.images))
        feats = torch.cat([module.extractor(method.normalize(x[i:i + 256])) for i in range(0, len(x), 256)])
    train = state.extras["global_counts"].numpy()
    head, y = int(np.argmax(train)), np.asarray(ds.val.labels)
    out = {}
    for form in ("trained", "shifted"):
        gen = torch.Generator().manual_seed(0)
        W0, b0 = gff.init_heads(E, C, D, gen)
        build = gff.balanced_experts if form == "shifted" else gff.retrain
        W, b, _ = build(banks, W0, b0, method.retrain_epochs, method.cfg.retrain_lr, method.cfg.retrain_batch, gen)
        b = b - torch.einsum("ecd,d->ec", W, centre)  # the banks' frame back to the raw features'
        ens = ExpertEnsemble(module.extractor, W, b, tuple(names)).eval()
        with torch.no_grad():
            res = ens.vote_on(feats)
        pred = res["expert_labels"].numpy()
        bal = [float(np.mean([(pred[y == c, e] == c).mean() for c in range(C) if (y == c).any()])) for e in range(E)]
        vote = res["label"].numpy()
        out[form] = {"head_share": [float((pred[:, e] == head).mean()) for e in range(E)],
                     "val_balanced_accuracy": bal,
                     "vote": float(np.mean([(vote[y == c] == c).mean() for c in range(C) if (y == c).any()]))}
    return out


if __name__ == "__main__":
    raise SystemExit(main())
