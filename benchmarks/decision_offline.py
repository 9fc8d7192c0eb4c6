"""The validation-chosen operating point (`--decision validation`, tafl.training.decision) on finished runs.

    python benchmarks/decision_offline.py RUN [RUN ...] [--data-root DIR] [--at validation|argmax]

For each run folder's final.pt: the τ that training with `decision: validation` would choose (the same
function, `tafl.training.simulator.choose_operating_point`, on the run's validation split), then the
product's own evaluation of the checkpoint at that operating point (`evaluate_checkpoint`), written to
RUN/decision/{report.json,report.md,final.pt}. `--at argmax` does the reverse for a run trained with
`decision: validation`: the same checkpoint evaluated at the plain argmax, written to RUN/argmax/.
Nothing is tuned on test. Compare with
benchmarks/dafl_summary.py, e.g. `DAFL=RUN1,RUN2,RUN3 "DAFL + op=RUN1/decision,RUN2/decision,RUN3/decision"`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from prior_offline import open_run  # noqa: E402  (benchmarks/)
from tafl.training.checkpoint import save_checkpoint  # noqa: E402
from tafl.training.contract import GlobalState  # noqa: E402
from tafl.training.report import write_report  # noqa: E402
from tafl.training.simulator import choose_operating_point, evaluate_checkpoint  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--data-root", help="where the runs' dataset lies now, if it moved")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--at", choices=("validation", "argmax"), default="validation",
                    help="validation: choose the operating point (default); argmax: drop it")
    ns = ap.parse_args()
    import torch

    torch.set_num_threads(ns.threads)
    for run in map(Path, ns.runs):
        t0 = time.perf_counter()
        ck, cfg, ds, method, state = open_run(run, ns.data_root)
        state = GlobalState(state.weights, state.extras, {k: v for k, v in state.meta.items() if k != "decision"})
        if ns.at == "validation":
            state = choose_operating_point(method, state, ds, cfg)
        ck = dict(ck, state=state.to_dict(), run_config=dict(ck["run_config"], decision=ns.at))
        out = run / ("decision" if ns.at == "validation" else "argmax")
        out.mkdir(exist_ok=True)
        save_checkpoint(ck, out / "final.pt")
        report, outputs = evaluate_checkpoint(ck, ds, method=method)
        report.update(selected_round=ck["round"], selection=cfg.select, rounds_run=cfg.rounds)
        write_report(out, report, outputs)
        um = report["uniform_metrics"]
        tau = report["decision"]["tau"] if report.get("decision") else 0.0
        print(f"{run}: tau {tau:.1f}, macro F1 {100 * um['macro_f1']:.1f}, balanced recall "
              f"{100 * um['recall']:.1f}, eleven-mean {100 * report['average_accuracy']:.1f} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
