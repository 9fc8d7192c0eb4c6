"""SRs built in other processes against built in the scoring process, side by side (issue 35).

    python benchmarks/sr_processes.py PKG [--n 300] [--rounds 3]

The same N DICOM instances (benchmarks/pacs_dicomweb.py's mix: CT, MR, RLE, JPEG 2000, JPEG-LS) scored
in-process with PKG, in each round and in this order:
  (a) a local folder with --dicom-out, SRs built in the scoring process (sr_processes=0, the code before),
  (b) the same with the SRs built in min(2, cores) processes (what `tafl score` does from 16 inputs on),
  (c) from Orthanc over DICOMweb with --store-sr, SRs built in the scoring process,
  (d) the same with SR processes.
Reported: images per second of each, the ratios b/a and d/c (the gain) and d/b (DICOMweb against the local
folder, issue 35's target >= 0.8), each as the median over rounds with the range. Orthanc is started by the
script (tests/orthanc.py) and must be installed. Writes benchmarks/results/sr_processes.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("package")
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import pacs_dicomweb as pd

    from tafl.clients.dicomweb import score_dicomweb
    from tafl.clients.score import score_folder
    from tests.orthanc import Orthanc

    work = Path(tempfile.mkdtemp(prefix="tafl-srproc-"))
    sent = pd.make_instances(args.n, "sr-processes")
    folder = work / "folder"
    folder.mkdir()
    for i, d in enumerate(sent):
        (folder / f"{i:04d}.dcm").write_bytes(pd.part10(d))
    pacs = Orthanc(work / "orthanc").start()
    rounds = []
    try:
        pd.loaded(pacs, sent)
        for r in range(args.rounds):
            res = {}
            for name, procs in (("local_inline", 0), ("local_processes", None)):
                t0 = time.perf_counter()
                s = score_folder(folder, work / f"{name}{r}.csv", package=args.package, dicom_out=work / f"{name}{r}",
                                 progress=False, sr_processes=procs)
                res[name] = len(sent) / (time.perf_counter() - t0)
                assert s["dicom_written"] == len(sent), s
            for name, procs in (("dicomweb_inline", 0), ("dicomweb_processes", None)):
                t0 = time.perf_counter()
                s = score_dicomweb(pacs.dicomweb, work / f"{name}{r}.csv", package=args.package,
                                   studies=pd.studies_of(sent), store_sr=True, progress=False, sr_processes=procs)
                res[name] = len(sent) / (time.perf_counter() - t0)
                assert s["stored_sr"] == len(sent) and not s["failed"], s
            print(json.dumps({k: round(v, 1) for k, v in res.items()}), flush=True)
            rounds.append(res)
        srs = pd.tally(pd.srs_per_source(pacs), sent)
    finally:
        pacs.stop()

    def ratio(a: str, b: str) -> dict:
        xs = [x[a] / x[b] for x in rounds]
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}

    out = {"n": args.n, "rounds": rounds, "cores": os.cpu_count(), "package": args.package,
           "local_gain": ratio("local_processes", "local_inline"),
           "dicomweb_gain": ratio("dicomweb_processes", "dicomweb_inline"),
           "dicomweb_to_local": ratio("dicomweb_processes", "local_processes"),
           "dicomweb_to_local_inline": ratio("dicomweb_inline", "local_inline"), "srs_in_orthanc": srs}
    res_dir = REPO / "benchmarks" / "results"
    (res_dir / "sr_processes.json").write_text(json.dumps(out, indent=1))
    lines = [f"# SRs built in other processes (benchmarks/sr_processes.py, {args.n} instances, {os.cpu_count()} cores)",
             "", "| round | local, inline | local, processes | DICOMweb, inline | DICOMweb, processes |", "|---|---|---|---|---|"]
    for i, x in enumerate(rounds):
        lines.append(f"| {i + 1} | {x['local_inline']:.1f} | {x['local_processes']:.1f} | {x['dicomweb_inline']:.1f} | "
                     f"{x['dicomweb_processes']:.1f} |")
    lines.append("")
    for key, what in (("local_gain", "local folder, processes / inline"),
                      ("dicomweb_gain", "DICOMweb, processes / inline"),
                      ("dicomweb_to_local", "DICOMweb / local folder, both with processes"),
                      ("dicomweb_to_local_inline", "DICOMweb / local folder, both inline")):
        r = out[key]
        lines.append(f"- {what}: median {r['median']:.2f} (range {r['min']:.2f}–{r['max']:.2f})")
    lines.append(f"- SRs in Orthanc per source: {srs}")
    (res_dir / "sr_processes.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
