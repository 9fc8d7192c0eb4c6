"""How long one C-STORE of a tafl SR takes, and what Nagle's algorithm has to do with it (issue 35).

`python benchmarks/dimse_latency.py PKG [--n 60]` builds N SRs from PKG's algorithm facts and sends them one by one
over one association with tafl's own C-STORE SCU (tafl.serving.dicom_listener.Deliverer, the path the listener
files its SRs by), timing each round trip, in four arms side by side in one run:

  * tafl's socket with and without TCP_NODELAY (tafl sets it; "without" clears it after the association opens),
  * against Orthanc as Debian ships it (DCMTK leaves Nagle on) and with DCMTK's own switch, the environment
    variable TCP_NODELAY=1, set for Orthanc.

A DIMSE message goes out as several writes; with Nagle on, the last write waits for the peer's delayed ACK (40 ms on
Linux). Results: benchmarks/results/dimse_latency.{json,md}. Needs Orthanc (apt-get install orthanc).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pydicom.data import get_testdata_file  # noqa: E402
from pydicom.uid import generate_uid  # noqa: E402

from tafl.imaging import dicom_sr  # noqa: E402
from tafl.packaging import load_package  # noqa: E402
from tafl.serving.dicom_listener import Deliverer, Destination  # noqa: E402
from tests.dicom_net import instances  # noqa: E402
from tests.orthanc import Orthanc  # noqa: E402


def srs(pkg_dir: str, n: int) -> list:
    pkg = load_package(pkg_dir)
    algo = dicom_sr.Algorithm.from_metadata(pkg.meta, pkg.files.get("model.onnx", ""))
    k = len(algo.class_names)
    out = []
    sources = [Path(get_testdata_file(f)) for f in ("CT_small.dcm", "MR_small.dcm")]
    for i, src in enumerate(instances(sources, n, seed="dimse-latency")):
        finding = dicom_sr.Finding(i % k, 0.5, [("forward", i % k, 0.5), ("uniform", 0, 0.4), ("backward", 1 % k, 0.3)])
        out.append(dicom_sr.build(src, finding, algo)[0])
    return out


def arm(objs: list, pacs: Orthanc, nodelay: bool) -> list[float]:
    dest = Destination.parse(f"{pacs.aet}@127.0.0.1:{pacs.dicom_port}", None)
    d = Deliverer(dest, "TAFLBENCH")
    d.deliver(objs[:1])  # opens the association (not timed)
    if not nodelay:
        d._assoc.dul.socket.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 0)
    times = []
    try:
        for ds in objs[1:]:
            t0 = time.perf_counter()
            d.deliver([ds])
            times.append(1000 * (time.perf_counter() - t0))
    finally:
        d.close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("package")
    ap.add_argument("--n", type=int, default=60)
    ns = ap.parse_args()
    if not Orthanc.available():
        sys.exit("Orthanc is not installed: apt-get install orthanc orthanc-dicomweb")
    objs = srs(ns.package, ns.n)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tafl-dimse-") as tmp:
        for dcmtk in (False, True):
            pacs = Orthanc(Path(tmp) / f"o{int(dcmtk)}", env={"TCP_NODELAY": "1" if dcmtk else "0"}).start()
            try:
                for nodelay in (False, True):
                    for ds in objs:  # a fresh UID per arm, so Orthanc stores every one anew
                        ds.SOPInstanceUID = generate_uid()
                        if "file_meta" in dir(ds):
                            ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID
                    t = arm(objs, pacs, nodelay)
                    rows.append({"orthanc_tcp_nodelay": dcmtk, "tafl_tcp_nodelay": nodelay, "n": len(t),
                                 "median_ms": statistics.median(t), "p90_ms": sorted(t)[int(0.9 * len(t))],
                                 "min_ms": min(t)})
                    print(json.dumps(rows[-1]), flush=True)
            finally:
                pacs.stop()
    res = {"date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} cores", "package": Path(ns.package).name,
           "n": ns.n, "arms": rows}
    out = REPO / "benchmarks" / "results"
    (out / "dimse_latency.json").write_text(json.dumps(res, indent=1) + "\n")
    lines = ["# One C-STORE of a tafl SR to Orthanc: the round trip, with and without Nagle's algorithm", "",
             f"`python benchmarks/dimse_latency.py PKG --n {ns.n}`, {res['date']}, {res['machine']}; tafl's own "
             "C-STORE SCU (the listener's Deliverer), one association, SRs sent one after another.", "",
             "| Orthanc (DCMTK) TCP_NODELAY | tafl's socket TCP_NODELAY | C-STOREs | median ms | p90 ms | min ms |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {'1 (env)' if r['orthanc_tcp_nodelay'] else 'off (Debian default)'} | "
                     f"{'on (tafl default)' if r['tafl_tcp_nodelay'] else 'off'} | {r['n']} | {r['median_ms']:.1f} | "
                     f"{r['p90_ms']:.1f} | {r['min_ms']:.1f} |")
    (out / "dimse_latency.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
