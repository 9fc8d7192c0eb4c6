"""tafl and a real PACS (issue 35): Orthanc with its DICOMweb plugin, on this machine.

    python benchmarks/pacs_dicomweb.py PKG [--n 100] [--repeats 2] [--seed S]

1. Throughput, side by side in one run (interleaved, `--repeats` times each): the same N instances scored
   in-process with PKG (a) from a local folder with `--dicom-out` (each SR written to disk) and (b) from Orthanc
   with `tafl score --dicomweb --store-sr` (QIDO, WADO-RS, STOW-RS of every SR). The ratio b/a is the target
   (>= 0.8).
2. A kill at a random point: `tafl score --dicomweb --store-sr` as a subprocess, SIGKILLed once its results file
   holds K rows, K drawn uniformly in 1..N-1 (from --seed, default a fresh one, recorded), then run again with
   --resume.
   Counted: rows (distinct instances), SRs in Orthanc per source instance (lost = 0, duplicated = 0 is the target).
3. The DIMSE listener: Orthanc sends the same N instances to `tafl dicom-listen` (its modality "tafl", a store
   job), the listener files each SR back to Orthanc by C-STORE; once uninterrupted, once with the listener
   SIGKILLed after a third of the SRs arrived, restarted on the same spool, and Orthanc's failed job resubmitted.
   Its images/s run from the store job's start until Orthanc holds every SR (polled on /statistics), against
   the local folder's of part 1 (the ratio the target reads, >= 0.8).

Instances: cycled from pydicom's CT_small, MR_small, MR_small_RLE and three real instances from
../shared/data/dicom (JPEG 2000 lossless, JPEG-LS), each with its own SOP Instance UID, in studies of 10.
Writes benchmarks/results/pacs_dicomweb.{json,md}.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import pydicom  # noqa: E402
from pydicom.uid import generate_uid  # noqa: E402

from tests.dicom_net import echo, free_port, instances  # noqa: E402
from tests.orthanc import Orthanc  # noqa: E402

SHARED = Path(os.environ.get("TAFL_SHARED_DATA", REPO.parent / "shared" / "data")) / "dicom"
# Orthanc as docs/pacs.md tells a site to run it: DCMTK's Nagle off (TCP_NODELAY=1; docs/results.md, "One C-STORE, and Nagle's algorithm"). Without
# it, every C-STORE to the listener waits on a delayed ACK (--orthanc-nagle measures that case).
ORTHANC_ENV: dict[str, str] | None = {"TCP_NODELAY": "1"}
ENV = {**os.environ, "PYTHONPATH": str(REPO)}  # the listener at its defaults (decoder processes: min(2, cores))


def make_instances(n: int, seed: str) -> list[pydicom.Dataset]:
    from pydicom.data import get_testdata_file

    sources = [Path(get_testdata_file(x)) for x in ("CT_small.dcm", "MR_small.dcm", "MR_small_RLE.dcm")]
    sources += [p for p in (SHARED / "693_J2KR.dcm", SHARED / "JLSL_08_07_0_1F.dcm", SHARED / "JLSL_RGB_ILV1.dcm")
                if p.exists()]
    out = instances(sources, n, seed=seed)
    for i, ds in enumerate(out):
        ds.StudyInstanceUID = generate_uid(entropy_srcs=[seed, "study", str(i // 10)])
        ds.SeriesInstanceUID = generate_uid(entropy_srcs=[seed, "series", str(i // 10), str(ds.SOPClassUID)])
    return out


def part10(ds) -> bytes:
    buf = io.BytesIO()
    pydicom.dcmwrite(buf, ds, enforce_file_format=True)
    return buf.getvalue()


def srs_per_source(pacs: Orthanc) -> dict[str, int]:
    """Source SOP Instance UID -> how many tafl SRs in Orthanc reference it."""
    counts: dict[str, int] = {}
    for iid in pacs.instances():
        t = pacs.tags(iid)
        if t.get("Modality") != "SR" or t.get("Manufacturer") != "tafl":
            continue
        ds = pydicom.dcmread(io.BytesIO(__import__("httpx").get(f"{pacs.url}/instances/{iid}/file", timeout=60)
                                        .content))
        for s in ds.CurrentRequestedProcedureEvidenceSequence:
            for se in s.ReferencedSeriesSequence:
                for r in se.ReferencedSOPSequence:
                    counts[str(r.ReferencedSOPInstanceUID)] = counts.get(str(r.ReferencedSOPInstanceUID), 0) + 1
    return counts


def loaded(pacs: Orthanc, sent: list[pydicom.Dataset]) -> list[str]:
    return [pacs.upload(part10(d))["ID"] for d in sent]


def studies_of(sent) -> list[str]:
    return sorted({str(d.StudyInstanceUID) for d in sent})


def tally(counts: dict[str, int], sent) -> dict[str, int]:
    uids = [str(d.SOPInstanceUID) for d in sent]
    return {"sources": len(uids), "with_sr": sum(1 for u in uids if counts.get(u)),
            "lost": sum(1 for u in uids if not counts.get(u)), "duplicated": sum(max(counts.get(u, 0) - 1, 0)
                                                                               for u in uids)}


def throughput(pkg: str, sent, work: Path, repeats: int) -> dict:
    from tafl.clients.dicomweb import score_dicomweb
    from tafl.clients.score import score_folder

    folder = work / "folder"
    folder.mkdir()
    for i, d in enumerate(sent):
        (folder / f"{i:04d}.dcm").write_bytes(part10(d))
    pacs = Orthanc(work / "orthanc_tp", env=ORTHANC_ENV).start()
    try:
        loaded(pacs, sent)
        local, web = [], []
        for r in range(repeats):
            t0 = time.perf_counter()
            s = score_folder(folder, work / f"local{r}.csv", package=pkg, dicom_out=work / f"sr{r}", progress=False,
                             sr_processes=None)
            local.append(time.perf_counter() - t0)
            assert s["dicom_written"] == len(sent), s
            t0 = time.perf_counter()
            s = score_dicomweb(pacs.dicomweb, work / f"web{r}.csv", package=pkg, studies=studies_of(sent),
                               store_sr=True, progress=False, sr_processes=None)
            web.append(time.perf_counter() - t0)
            assert s["stored_sr"] == len(sent) and not s["failed"], s
        counts = tally(srs_per_source(pacs), sent)
    finally:
        pacs.stop()
    best_local, best_web = min(local), min(web)
    return {"local_folder_s": local, "dicomweb_s": web, "local_images_per_s": len(sent) / best_local,
            "dicomweb_images_per_s": len(sent) / best_web, "ratio": best_local / best_web, "srs": counts}


def kill_and_resume(pkg: str, sent, work: Path, rng: random.Random) -> dict:
    pacs = Orthanc(work / "orthanc_kill", env=ORTHANC_ENV).start()
    try:
        loaded(pacs, sent)
        out = work / "killed.csv"
        cmd = [sys.executable, "-m", "tafl.cli", "score", "--dicomweb", pacs.dicomweb, "--package", pkg, "--out",
               str(out), "--store-sr", "--no-progress"] + [a for s in studies_of(sent) for a in ("--study", s)]
        kill_at = rng.randint(1, len(sent) - 1)  # rows in the file when the kill lands
        proc = subprocess.Popen(cmd, env=ENV, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        t0 = time.perf_counter()
        while proc.poll() is None and (not out.exists() or len(out.read_text().splitlines()) - 1 < kill_at):
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        killed_after = time.perf_counter() - t0
        rows_at_kill = max(len(out.read_text().splitlines()) - 1, 0) if out.exists() else 0
        srs_at_kill = tally(srs_per_source(pacs), sent)["with_sr"]
        done = subprocess.run(cmd + ["--resume"], env=ENV, cwd=REPO, capture_output=True, text=True)
        import csv

        from tafl.clients.score import csv_uncell

        keys = [csv_uncell(r["path"]) for r in csv.DictReader(open(out, newline=""))]
        counts = tally(srs_per_source(pacs), sent)
    finally:
        pacs.stop()
    return {"kill_at_rows": kill_at, "killed_after_s": killed_after, "rows_at_kill": rows_at_kill,
            "srs_at_kill": srs_at_kill, "resume_rc": done.returncode, "rows": len(keys),
            "distinct_rows": len(set(keys)), "srs": counts}


def listener(pkg: str, sent, work: Path, kill: bool) -> dict:
    port = free_port()
    tag = "kill" if kill else "plain"
    spool, log = work / f"spool_{tag}", work / f"listener_{tag}.log"
    pacs = Orthanc(work / f"orthanc_l_{tag}", modalities={"tafl": ("TAFL", port)}, env=ORTHANC_ENV).start()

    def start():
        return subprocess.Popen([sys.executable, "-m", "tafl.cli", "dicom-listen", "--package", pkg, "--port",
                                 str(port), "--dest", f"{pacs.aet}@127.0.0.1:{pacs.dicom_port}", "--spool",
                                 str(spool)], stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=ENV, cwd=REPO,
                                start_new_session=True)

    def n_srs() -> int:  # Orthanc's instance count (cheap, unlike a C-FIND-like /tools/find) less the sources
        return pacs.get("/statistics")["CountInstances"] - len(sent)

    proc = start()
    res: dict = {"killed": kill}
    try:
        assert echo(port, timeout=120), log.read_text()[-2000:]
        ids = loaded(pacs, sent)
        t0 = time.perf_counter()
        job = pacs.post("/modalities/tafl/store", {"Resources": ids, "Asynchronous": True}).json()["ID"]
        if kill:
            while n_srs() < len(sent) // 3:
                time.sleep(0.2)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            res["srs_at_kill"] = n_srs()
            res["spooled_at_kill"] = len(list((spool / "queue").glob("*.dcm")))
            while pacs.get(f"/jobs/{job}")["State"] not in ("Success", "Failure"):
                time.sleep(0.2)
            res["job_after_kill"] = pacs.get(f"/jobs/{job}")["State"]
            proc = start()
            assert echo(port, timeout=120)
            if res["job_after_kill"] == "Failure":
                pacs.post(f"/jobs/{job}/resubmit", {})
        deadline = time.perf_counter() + 900
        while (left := len(sent) - n_srs()) > 0 and time.perf_counter() < deadline:
            # coarse while far from done (polling takes CPU from what is measured), fine near the end: a 0.3 s
            # poll overstated a 4 s run by 0.15 s on average, 4 % of the ratio
            time.sleep(0.3 if left > len(sent) // 10 else 0.02)
        res["wall_s"] = time.perf_counter() - t0
        res["images_per_s"] = len(sent) / res["wall_s"]
        time.sleep(2)  # a late duplicate would show now
        res["srs"] = tally(srs_per_source(pacs), sent)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        pacs.stop()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("package")
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=None, help="the kill point's draw (default: a fresh one, recorded)")
    ap.add_argument("--quick", action="store_true", help="throughput and the uninterrupted listener only (no kills); "
                    "prints, writes no results file")
    ap.add_argument("--orthanc-nagle", action="store_true", help="Orthanc with DCMTK's default (Nagle's algorithm "
                    "on), not as docs/pacs.md configures it")
    ns = ap.parse_args()
    global ORTHANC_ENV
    ORTHANC_ENV = None if ns.orthanc_nagle else ORTHANC_ENV
    if not Orthanc.available():
        sys.exit("Orthanc is not installed: apt-get install orthanc orthanc-dicomweb")
    seed = ns.seed if ns.seed is not None else secrets.randbelow(2**31)
    rng = random.Random(seed)
    pkg = str(Path(ns.package).resolve())
    sent = make_instances(ns.n, f"pacs-bench-{seed}")
    with tempfile.TemporaryDirectory(prefix="tafl-pacs-") as tmp:
        work = Path(tmp)
        res = {"n": ns.n, "package": Path(pkg).name, "seed": seed, "date": time.strftime("%Y-%m-%d"),
               "machine": f"{os.cpu_count()} cores", "orthanc_env": ORTHANC_ENV or {}}
        res["throughput"] = throughput(pkg, sent, work, ns.repeats)
        print(json.dumps(res["throughput"], indent=1), flush=True)
        if ns.quick:
            lis = listener(pkg, sent, work, kill=False)
            lis["ratio_to_local"] = lis["images_per_s"] / res["throughput"]["local_images_per_s"]
            print(json.dumps(lis, indent=1), flush=True)
            return
        res["kill_resume"] = kill_and_resume(pkg, sent, work, rng)
        print(json.dumps(res["kill_resume"], indent=1), flush=True)
        res["listener"] = [listener(pkg, sent, work, kill=False), listener(pkg, sent, work, kill=True)]
        for r in res["listener"]:
            r["ratio_to_local"] = r["images_per_s"] / res["throughput"]["local_images_per_s"]
        print(json.dumps(res["listener"], indent=1), flush=True)
    out = REPO / "benchmarks" / "results"
    (out / "pacs_dicomweb.json").write_text(json.dumps(res, indent=1) + "\n")
    tp, kr = res["throughput"], res["kill_resume"]
    lines = [
        "# tafl and a real PACS: Orthanc 1.10 with DICOMweb 1.7 (issue 35)", "",
        f"`python benchmarks/pacs_dicomweb.py PKG --n {ns.n} --repeats {ns.repeats}` (package {res['package']}, "
        f"kill draw seed {seed}), {res['date']}, {res['machine']}; Orthanc, tafl and the listener share them. "
        f"Orthanc's environment: {ORTHANC_ENV or 'Debian defaults (Nagle on)'}.", "",
        "## Throughput: the same instances, side by side (best of the repeats)", "",
        "| path | runs (s) | images/s |", "|---|---|---|",
        f"| local folder, `--dicom-out` | {', '.join(f'{t:.2f}' for t in tp['local_folder_s'])} | "
        f"{tp['local_images_per_s']:.1f} |",
        f"| Orthanc, `--dicomweb --store-sr` (QIDO + WADO-RS + STOW-RS) | "
        f"{', '.join(f'{t:.2f}' for t in tp['dicomweb_s'])} | {tp['dicomweb_images_per_s']:.1f} |", "",
        f"**Ratio DICOMweb / local folder: {tp['ratio']:.2f}** (target ≥ 0.8). SRs in Orthanc: "
        f"{tp['srs']['with_sr']} of {tp['srs']['sources']} sources, {tp['srs']['duplicated']} duplicated.", "",
        "## A kill at a random point, then --resume", "",
        f"`tafl score --dicomweb --store-sr` (a subprocess) killed with SIGKILL once its file held {kr['kill_at_rows']} "
        f"rows (a random draw in 1..N-1), {kr['killed_after_s']:.2f} s after it started: {kr['rows_at_kill']} rows and "
        f"{kr['srs_at_kill']} SRs in Orthanc at the kill (an SR is filed before its row is written). `--resume` exit "
        f"code {kr['resume_rc']}.", "",
        f"**Rows: {kr['rows']} ({kr['distinct_rows']} distinct) for {ns.n} instances; SRs: "
        f"{kr['srs']['with_sr']} sources with an SR, {kr['srs']['lost']} lost, {kr['srs']['duplicated']} "
        "duplicated.**", "",
        "## The DIMSE listener: Orthanc sends, the listener files SRs back by C-STORE", "",
        "| run | wall s | images/s | ratio to the local folder | sources with an SR | lost | duplicated | notes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["listener"]:
        note = (f"SIGKILL at {r['srs_at_kill']} SRs ({r['spooled_at_kill']} in the spool); Orthanc's job "
                f"{r['job_after_kill']}{', resubmitted' if r['job_after_kill'] == 'Failure' else ''}"
                if r["killed"] else "")
        lines.append(f"| {'killed, restarted' if r['killed'] else 'uninterrupted'} | {r['wall_s']:.1f} | "
                     f"{r['images_per_s']:.2f} | {r['ratio_to_local']:.2f} | {r['srs']['with_sr']} | {r['srs']['lost']} | "
                     f"{r['srs']['duplicated']} | {note} |")
    (out / "pacs_dicomweb.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
