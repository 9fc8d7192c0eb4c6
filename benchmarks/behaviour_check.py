"""Behaviour to the last digit: fixed-seed smoke runs of every method, their reports and packages, compared before
and after a change that must not change what tafl computes (a refactor).

    python benchmarks/behaviour_check.py write DIR     # before the change: runs, packages and answers into DIR
    python benchmarks/behaviour_check.py check DIR     # after it: the same runs again, compared with DIR's

Each case trains on configs/smoke.yaml with a few overrides (every method; DP; the federated calibration with the
validation operating point; one client per site from a folder dataset; Flower's engine when installed), then
exports the package and runs it on fixed images. `write` keeps, per case, report.json without what differs between
two runs of the same config (seconds, dates), the package's metadata without its creation time, and the package's
answers; it also keeps the packages themselves. `check` trains and exports the same cases with the code as it is
now and compares all of it exactly (floats by their repr), and loads the packages `write` kept and compares their
answers: a package exported before the change must load and answer as it did. Exit 1 on any difference, listing
where. About 6 minutes on 2 cores.

DP noise comes from a secret seed (tafl.training.privacy.noise_generator), so that nobody can replay it from the
run's public seed: two DP runs differ by design. This script pins that seed for its own runs, so the DP case
compares to the last digit too; tafl itself never does.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VOLATILE = {"timing", "seconds", "created", "date", "tafl_version", "path", "run_dir", "checkpoint_path",
            "exported", "loaded_at"}

SMOKE_GTAFL = {"method": "gtafl", "simclr_steps": 2, "simclr_batch": 32, "retrain_epochs": 20, "match_steps": 20}
CASES: dict[str, dict[str, Any]] = {
    "fedavg": {},
    "fedprox": {"method": "fedprox", "mu": 0.01},
    "creff": {"method": "creff", "retrain_epochs": 20, "match_steps": 20},
    "gtafl": SMOKE_GTAFL,
    "gtafl_calibrated": {**SMOKE_GTAFL, "calibration": "vector", "calib_holdout": 0.2, "decision": "validation"},
    "dafl": {"method": "dafl", "backbone": "vit_tafl_tiny", "tokenizer": "conv", "optimizer": "adam", "lr": 0.002},
    "lda": {"method": "lda"},
    "fedavg_dp": {"dp_epsilon": 8.0, "dp_delta": 1e-3},
    "fedavg_sites": {"dataset": "folder", "labels": "labels.csv", "label_column": "dx", "client_column": "site"},
    "fedavg_flower": {"engine": "flower", "frac": 1.0},
}


def strip(obj: Any) -> Any:
    """`obj` without what differs between two runs of the same config; floats as their repr (to the last digit)."""
    if isinstance(obj, dict):
        return {k: strip(v) for k, v in obj.items() if k not in VOLATILE}
    if isinstance(obj, list):
        return [strip(v) for v in obj]
    if isinstance(obj, float):
        return repr(obj)
    return obj


def site_folder(root: Path) -> Path:
    """The digits as a folder of PNGs with a labels CSV naming three sites (client_column)."""
    import csv

    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    d = load_digits()
    (root / "images").mkdir(parents=True, exist_ok=True)
    with open(root / "labels.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["image_id", "dx", "site"])
        for i, (x, y) in enumerate(zip(d.images, d.target)):
            Image.fromarray(np.uint8(x * 15)).save(root / "images" / f"img{i}.png")
            w.writerow([f"img{i}", str(y), f"site{i % 3}"])
    return root


def answers(pkg_dir: Path) -> dict[str, Any]:
    """The package's outputs on fixed images (every output of the graph, and at prior=train and a given prior)."""
    import numpy as np
    from sklearn.datasets import load_digits

    from tafl.packaging import load_package

    pkg = load_package(pkg_dir)
    d = load_digits()
    images = [np.uint8(d.images[i] * 15) for i in range(0, 60, 3)]
    sess = pkg.session(["CPUExecutionProvider"], threads=1)
    out = pkg.run(sess, pkg.preprocess(images))
    res = {k: np.asarray(v).tolist() for k, v in sorted(out.items())}
    if "prior" in pkg.metadata:
        q = np.linspace(1, 2, len(pkg.class_names))
        ratio = np.log(q / q.sum()) - np.log(np.asarray(pkg.metadata["prior"]["source_prior"]))
        res["with_prior"] = {k: np.asarray(v).tolist()
                             for k, v in sorted(pkg.run(sess, pkg.preprocess(images), ratio).items())}
    return strip(res)


def pin_dp_noise() -> None:
    """The DP noise of this script's runs from a fixed seed (tafl draws it from a secret one)."""
    import torch

    from tafl.training import privacy

    privacy.noise_generator = lambda: torch.Generator().manual_seed(20261207)


def run_case(name: str, overrides: dict[str, Any], work: Path) -> tuple[dict[str, Any], Path] | None:
    from tafl.packaging.export import export_checkpoint
    from tafl.training.config import load_config

    if overrides.get("engine") == "flower":
        try:
            from tafl.training.flower import run_flower_simulation
        except ImportError:
            print(f"{name}: Flower is not installed; skipped", flush=True)
            return None
    if overrides.get("dataset") == "folder":
        overrides = {**overrides, "data_root": str(site_folder(work / "sites_data"))}
    cfg = load_config(REPO / "configs" / "smoke.yaml", overrides)
    out = work / name
    if cfg.engine == "flower":
        report = run_flower_simulation(cfg, out)
    else:
        from tafl.training.simulator import train

        report = train(cfg, out, progress=False)
    pkg = work / f"pkg_{name}"
    export_checkpoint(out / "final.pt", pkg, name=f"check-{name.replace('_', '-')}")
    meta = json.loads((pkg / "metadata.json").read_text())
    facts = {"report": strip(report), "metadata": strip(meta), "answers": answers(pkg)}
    return json.loads(json.dumps(facts).replace(str(work), "<work>")), pkg  # the temporary folder differs


def diff(a: Any, b: Any, where: str = "") -> list[str]:
    if type(a) is not type(b):
        return [f"{where}: {type(a).__name__} -> {type(b).__name__}"]
    if isinstance(a, dict):
        out = [f"{where}.{k}: only before" for k in a.keys() - b.keys()]
        out += [f"{where}.{k}: only after" for k in b.keys() - a.keys()]
        for k in sorted(a.keys() & b.keys()):
            out += diff(a[k], b[k], f"{where}.{k}")
        return out
    if isinstance(a, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} items -> {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in diff(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {str(a)[:60]} -> {str(b)[:60]}"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("write", "check"))
    ap.add_argument("dir", help="where `write` keeps the runs' facts and packages, and `check` reads them")
    ap.add_argument("--cases", help="comma-separated subset of: " + ", ".join(CASES))
    ns = ap.parse_args()
    keep = Path(ns.dir)
    names = ns.cases.split(",") if ns.cases else list(CASES)
    problems: list[str] = []
    pin_dp_noise()
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            got = run_case(name, dict(CASES[name]), Path(tmp))
            if got is None:
                continue
            facts, pkg = got
            if ns.mode == "write":
                (keep / "packages").mkdir(parents=True, exist_ok=True)
                (keep / f"{name}.json").write_text(json.dumps(facts, indent=1, sort_keys=True))
                shutil.rmtree(keep / "packages" / name, ignore_errors=True)
                shutil.copytree(pkg, keep / "packages" / name)
                print(f"{name}: written", flush=True)
                continue
            before = json.loads((keep / f"{name}.json").read_text())
            found = diff(before, json.loads(json.dumps(facts, sort_keys=True)), name)
            old_pkg = answers(keep / "packages" / name)  # a package exported by the code before, loaded now
            found += diff(before["answers"], old_pkg, f"{name} (the package exported before)")
            problems += found
            print(f"{name}: {'identical' if not found else f'{len(found)} difference(s)'}", flush=True)
    for p in problems[:200]:
        print("  " + p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
