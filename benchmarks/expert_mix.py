"""Do GTAFL's experts specialise as built? A diagnostic that reads no test data.

    python benchmarks/expert_mix.py RUN [RUN ...] [--name NAME]

For each run's final.pt and each expert: the class mix of its GFF bank (what it was retrained on), the mix its
softmax implies on the validation split (mean probability) and the mix of its decisions there, and its validation
balanced accuracy; the training mix beside them. An expert whose decisions follow its bank's mix (forward toward
the head classes, backward toward the tail) specialises as designed; one whose decisions ignore its bank does not,
whatever the test split later says. Writes benchmarks/results/<NAME>.{json,md} (default expert_mix).
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
    ns = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    payload, lines = {}, [f"# {ns.name}: GTAFL's experts on validation (no test data)", "",
                          "Per expert: total variation of its decisions' mix from its bank's mix and from the training "
                          "mix, the head-class (most common training class) share of its decisions, and its "
                          "validation balanced accuracy.", "",
                          "| run | expert | TV(decisions, bank) | TV(decisions, training) | head share: bank / decisions "
                          "| val bal. acc |", "|---|---|---|---|---|---|"]
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
    write_results(ns.name, payload, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
