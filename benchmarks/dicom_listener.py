"""DICOM results and the DICOM listener, measured (issue 17).

    python benchmarks/dicom_listener.py PKG [--n 200] [--no-rest]

1. Coverage: every real DICOM in ../shared/data/dicom through the service's decoder (its default limits),
   the package in ONNX Runtime and tafl.imaging.dicom_sr: how many the service can classify, and for how
   many of those an SR and a heatmap secondary capture are created (and why not for the rest).
2. Burst: N instances (cycled from the shared DICOMs that carry the identity UIDs, each with its own SOP
   Instance UID and marker patient data) sent by a pynetdicom SCU over loopback to `tafl dicom-listen`
   (a subprocess, default decoder processes), which stores each SR to a destination SCP in this process.
   Run A: no interruption. Run B: the listener is killed with SIGKILL after N/2 acknowledgments and started
   again on the same spool; the sender retries what was not acknowledged. Counted: SRs received (distinct
   SOP Instance UIDs, each referencing a distinct source), patient data in the listener's log.
3. REST, in the same run: the same N instances posted to a real `bentoml serve` of the package at
   concurrency 2, as JSON and as format=sr.

The load generators share the machine's 2 cores with the listener and the service.
Writes benchmarks/results/dicom_listener.{json,md}.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import pydicom  # noqa: E402

from tafl.errors import ServiceError, UnprocessableImage  # noqa: E402
from tafl.imaging import decode_image, dicom_sr  # noqa: E402
from tests.dicom_net import PHI_BIRTH, PHI_ID, PHI_NAME, Sink, echo, free_port, instances, send  # noqa: E402

SHARED = Path(os.environ.get("TAFL_SHARED_DATA", REPO.parent / "shared" / "data")) / "dicom"


def coverage(pkg_dir: str) -> dict:
    from tafl.imaging.heatmap import overlay
    from tafl.packaging import load_package
    from tafl.serving.results import frame_result, overlay_frame
    from tafl.serving.settings import Settings

    pkg = load_package(pkg_dir)
    sess = pkg.session(["CPUExecutionProvider"], 1)
    algo = dicom_sr.Algorithm.from_metadata(pkg.meta, pkg.files["model.onnx"])
    s = Settings(packages=[])
    files = sorted(SHARED.glob("*.dcm"))
    res = {"files": len(files), "classifiable": 0, "sr_and_sc": 0, "not_classifiable": {}, "no_sr": {},
           "identity": 0}
    usable = []
    for p in files:
        data = p.read_bytes()
        try:
            d = decode_image(data, max_bytes=s.max_upload_bytes, max_pixels=s.max_pixels, max_frames=s.max_frames)
        except ServiceError as exc:
            res["not_classifiable"][p.name] = f"{exc.status} {type(exc).__name__}"
            continue
        res["classifiable"] += 1
        out = pkg.run(sess, pkg.preprocess(d.frames))
        result = frame_result(pkg, out, 0)
        try:
            src = dicom_sr.read_header(data)
            res["identity"] += 1
            sr, sc = dicom_sr.build(src, dicom_sr.Finding.from_result(result, algo.class_names,
                                                                      1 if len(d.frames) > 1 else None),
                                    algo, overlay(overlay_frame(d.frames[0]), out["heatmap"][0]))
            dicom_sr.to_bytes(sr), dicom_sr.to_bytes(sc)
            res["sr_and_sc"] += 1
            usable.append(p)
        except UnprocessableImage as exc:
            res["no_sr"][p.name] = exc.message[:90]
    res["pct_of_classifiable"] = 100 * res["sr_and_sc"] / max(1, res["classifiable"])
    res["pct_of_classifiable_with_identity"] = 100 * res["sr_and_sc"] / max(1, res["identity"])
    return res, usable


def _listener(pkg: str, port: int, dest: int, spool: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tafl.cli", "dicom-listen", "--package", pkg, "--port", str(port),
                             "--dest", f"DEST@127.0.0.1:{dest}", "--spool", str(spool)],
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)


def _reap(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def burst(pkg: str, sources: list[Path], n: int, work: Path, restart: bool) -> dict:
    sink = Sink()
    port, spool, log = free_port(), work / f"spool-{restart}", work / f"listener-{restart}.log"
    proc = _listener(pkg, port, sink.port, spool, log)
    if not echo(port, timeout=120):
        raise SystemExit(log.read_text()[-3000:])
    sent = instances(sources, n, seed=f"bench-{restart}-{time.time()}")
    killed = threading.Event()
    box = {"proc": proc}

    def on_ack(k: int) -> None:
        if restart and k == n // 2 and not killed.is_set():
            killed.set()
            box["proc"].send_signal(signal.SIGKILL)

    stats: dict = {}
    t0 = time.perf_counter()
    th = threading.Thread(target=lambda: stats.update(send(port, sent, deadline=900, on_ack=on_ack)))
    th.start()
    spooled_at_kill = None
    if restart:
        killed.wait(600)
        box["proc"].wait(30)
        _reap(box["proc"])  # the crashed listener's idle decoder processes (they outlive a SIGKILLed parent)
        spooled_at_kill = len(list((spool / "queue").glob("*.dcm")))
        t_kill = time.perf_counter()
        box["proc"] = _listener(pkg, port, sink.port, spool, log)
        echo(port, timeout=120)
        restart_s = time.perf_counter() - t_kill
    th.join()
    t_sent = time.perf_counter()
    want = {str(d.SOPInstanceUID) for d in sent}
    end = time.monotonic() + 600
    got: dict[str, str] = {}
    while time.monotonic() < end:
        for uid, data in list(sink.received.items()):
            if uid not in got:
                ds = pydicom.dcmread(io.BytesIO(data), stop_before_pixels=True)
                ref = ds.CurrentRequestedProcedureEvidenceSequence[0].ReferencedSeriesSequence[0]
                got[uid] = str(ref.ReferencedSOPSequence[0].ReferencedSOPInstanceUID)
        if want <= set(got.values()):
            break
        time.sleep(0.1)
    t_done = time.perf_counter()
    box["proc"].send_signal(signal.SIGTERM)
    try:
        box["proc"].wait(30)
    except subprocess.TimeoutExpired:
        box["proc"].kill()
    _reap(box["proc"])
    sink.close()
    text = log.read_text()
    phi = sum(text.count(x) for x in (PHI_NAME, PHI_NAME.split("^")[0], PHI_ID, PHI_BIRTH))
    phi += sum(text.count(str(d.SOPInstanceUID)) for d in sent)
    out = {"instances": n, "restart": restart, "sender": stats, "srs_received": len(got),
           "sources_covered": len(want & set(got.values())), "stores_at_destination": sink.stores,
           "lost": len(want - set(got.values())), "wall_s": t_done - t0, "send_s": t_sent - t0,
           "images_per_s": n / (t_done - t0), "phi_occurrences_in_log": phi,
           "log_lines": len(text.splitlines())}
    if restart:
        out.update(spooled_at_kill=spooled_at_kill, restart_s=restart_s)
    return out


def rest(pkg: str, sources: list[Path], n: int, work: Path) -> dict:
    import httpx

    from tafl.serving.launch import ServerProcess

    data = [_bytes(d) for d in instances(sources, n, seed="rest")]
    out = {}
    home = work / "bentoml_home"
    with ServerProcess([pkg], env={"BENTOML_HOME": str(home)}, log_path=work / "service.log") as srv:
        with httpx.Client(timeout=120) as c:
            def post(b: bytes, fmt: str) -> int:
                r = c.post(f"{srv.url}/predict", files={"file": ("x.dcm", b, "application/dicom")},
                           data={"format": fmt})
                return r.status_code
            post(data[0], "json")
            for fmt in ("json", "sr"):
                t0 = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(2) as ex:
                    codes = list(ex.map(lambda b: post(b, fmt), data))
                dt = time.perf_counter() - t0
                out[fmt] = {"images_per_s": n / dt, "ok": codes.count(200), "wall_s": dt, "concurrency": 2}
    return out


def _bytes(ds: pydicom.Dataset) -> bytes:
    buf = io.BytesIO()
    ds.save_as(buf, enforce_file_format=True)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("package")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--no-rest", action="store_true")
    ns = ap.parse_args()
    work = REPO / "benchmarks" / "out" / "dicom_listener"
    work.mkdir(parents=True, exist_ok=True)
    for old in work.glob("listener-*.log"):
        old.unlink()
    cov, usable = coverage(ns.package)
    print(json.dumps({k: v for k, v in cov.items() if k not in ("no_sr", "not_classifiable")}), flush=True)
    runs = [burst(ns.package, usable, ns.n, work, restart=False), burst(ns.package, usable, ns.n, work, restart=True)]
    for r in runs:
        print(json.dumps(r), flush=True)
    rest_res = {} if ns.no_rest else rest(ns.package, usable, ns.n, work)
    print(json.dumps(rest_res), flush=True)
    res = {"coverage": cov, "bursts": runs, "rest": rest_res, "cpus": os.cpu_count(),
           "load_avg_at_end": os.getloadavg()}
    (REPO / "benchmarks" / "results").mkdir(exist_ok=True)
    (REPO / "benchmarks" / "results" / "dicom_listener.json").write_text(json.dumps(res, indent=2))
    a, b = runs
    lines = ["# DICOM results and listener (issue 17)", "",
             f"`python benchmarks/dicom_listener.py {Path(ns.package).name} --n {ns.n}`; {os.cpu_count()} cores shared "
             f"with the load generators (load average at the end {os.getloadavg()[0]:.1f}).", "",
             "## SR and secondary capture over the shared real DICOMs", "",
             f"- files: {cov['files']}; the service can classify {cov['classifiable']}",
             f"- SR + SC created: **{cov['sr_and_sc']} / {cov['classifiable']} = {cov['pct_of_classifiable']:.1f} %** "
             f"of the classifiable; {cov['sr_and_sc']} / {cov['identity']} = "
             f"{cov['pct_of_classifiable_with_identity']:.1f} % of those carrying SOP Class, SOP Instance and "
             "Study Instance UIDs",
             "- no SR (422, the UIDs an SR must reference are missing): "
             + (", ".join(f"{k}" for k in cov["no_sr"]) or "none"),
             "- not classifiable (the same 4xx as the JSON route): "
             + (", ".join(f"{k} ({v})" for k, v in cov["not_classifiable"].items()) or "none"), "",
             "## Listener burst (pynetdicom SCU -> tafl dicom-listen -> destination SCP, loopback)", "",
             "| run | instances | SRs received | lost | sender retries (refused / failed) | wall s | images/s | "
             "PHI in log |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {'SIGKILL at ' + str(ns.n // 2) + ' acks, restart' if r['restart'] else 'uninterrupted'} | "
                     f"{r['instances']} | {r['srs_received']} | {r['lost']} | {r['sender']['refused']} / "
                     f"{r['sender']['failed_attempts']} | {r['wall_s']:.1f} | {r['images_per_s']:.2f} | "
                     f"{r['phi_occurrences_in_log']} |")
    lines += ["", f"Restart run: {b.get('spooled_at_kill')} acknowledged instances were in the spool at the kill; the "
                  f"new listener answered C-ECHO {b.get('restart_s', 0):.1f} s after it; "
                  f"{b['stores_at_destination']} C-STOREs reached the destination for {b['srs_received']} distinct SRs "
                  "(a redelivered SR has the same UID and replaces itself)."]
    if rest_res:
        lines += ["", "## REST, same instances, same run (concurrency 2)", "",
                  "| answer | images/s | 200s |", "|---|---|---|"]
        for k, v in rest_res.items():
            lines.append(f"| {k} | {v['images_per_s']:.2f} | {v['ok']} / {ns.n} |")
    (REPO / "benchmarks" / "results" / "dicom_listener.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
