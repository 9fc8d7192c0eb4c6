"""`tafl score --dicomweb` and `tafl dicom-listen` against a real PACS: Orthanc with its DICOMweb plugin, started by
the tests on 127.0.0.1 (tests/orthanc.py; they skip where Orthanc is not installed, and .ci/run installs it).

Every SR tafl files is fetched back by WADO-RS and read with highdicom: it references its source instance and study,
carries the model's name, version and checksum, and is UNVERIFIED; Orthanc's own REST API shows it in the source's
study; a PACS that goes away mid-run costs a resumable stop and no duplicate."""

from __future__ import annotations

import copy
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pydicom
import pytest
from pydicom.data import get_testdata_file
from pydicom.uid import generate_uid

from tafl.cli import main
from tafl.clients.score import csv_uncell
from tafl.imaging import dicom_sr
from tests.conftest import SHARED_DATA, digit_png
from tests.dicom_net import echo, free_port, instances
from tests.orthanc import Orthanc

pytestmark = pytest.mark.skipif(not Orthanc.available(), reason="Orthanc (Debian: orthanc, orthanc-dicomweb) is "
                                                                 "not installed")
REPO = Path(__file__).resolve().parents[2]
PYDICOM_SOURCES = [Path(get_testdata_file(n)) for n in ("CT_small.dcm", "MR_small.dcm", "MR_small_RLE.dcm")]
# real instances from ../shared/data/dicom that both the service and Orthanc 1.10 accept (JPEG 2000, JPEG-LS)
SHARED_NAMES = ("693_J2KR.dcm", "JLSL_08_07_0_1F.dcm", "JLSL_RGB_ILV1.dcm")


def _sources() -> list[Path]:
    """pydicom's files, and the shared real ones where ../shared/data is present (the tests run without them)."""
    found = [SHARED_DATA / "dicom" / n for n in SHARED_NAMES]
    return PYDICOM_SOURCES + [p for p in found if p.exists()]


def _part10(ds) -> bytes:
    buf = io.BytesIO()
    pydicom.dcmwrite(buf, ds, enforce_file_format=True)
    return buf.getvalue()


def _study(n: int, seed: str) -> list[pydicom.Dataset]:
    """`n` image instances cycled from the sources, all in one new study (each keeps its own series)."""
    study = generate_uid(entropy_srcs=[seed, "study"])
    out = instances(_sources(), n, seed=seed)
    for ds in out:
        ds.StudyInstanceUID = study
        ds.SeriesInstanceUID = generate_uid(entropy_srcs=[seed, str(ds.SOPClassUID), str(ds.get("Rows"))])
    return out


def _oversized(study: str) -> pydicom.Dataset:
    """An instance over the decoder's pixel limit (10,000 × 10,000 declared, 1.5 MB of RLE)."""
    from tests.hostile_corpus import rle_dicom

    ds = pydicom.dcmread(io.BytesIO(rle_dicom(10000, 10000, segment=b"\x81\x00" * 781_250)))
    ds.StudyInstanceUID, ds.SeriesInstanceUID = study, generate_uid()
    ds.PatientID, ds.Modality = "ANON-1", "OT"
    return ds


def _non_image(study: str) -> pydicom.Dataset:
    """An SR that is not tafl's: a non-image instance in the study, skipped and counted."""
    ds = pydicom.dcmread(get_testdata_file("test-SR.dcm"))
    ds = copy.deepcopy(ds)
    ds.StudyInstanceUID, ds.SeriesInstanceUID, ds.SOPInstanceUID = study, generate_uid(), generate_uid()
    ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID
    return ds


def _stow(pacs: Orthanc, datasets: list[pydicom.Dataset]) -> None:
    from dicomweb_client.api import DICOMwebClient

    DICOMwebClient(pacs.dicomweb).store_instances(datasets)


def _srs(pacs: Orthanc) -> dict[str, list[pydicom.Dataset]]:
    """Source SOP Instance UID -> tafl's SRs in the PACS that reference it, each fetched back by WADO-RS (an SR's
    own heatmap capture, also referenced, is left out: tafl derives its UID from the source's, with "sc")."""
    from dicomweb_client.api import DICOMwebClient

    client = DICOMwebClient(pacs.dicomweb)
    heatmaps = {t["SOPInstanceUID"] for t in map(pacs.tags, pacs.instances())
                if t.get("Manufacturer") == dicom_sr.MANUFACTURER and t.get("Modality") != "SR"}
    out: dict[str, list[pydicom.Dataset]] = {}
    for rec in client.search_for_instances(search_filters={"Modality": "SR"}):
        uid = lambda t: rec[t]["Value"][0]  # noqa: E731
        ds = client.retrieve_instance(uid("0020000D"), uid("0020000E"), uid("00080018"))
        if ds.get("Manufacturer") != dicom_sr.MANUFACTURER:
            continue
        refs = [r.ReferencedSOPInstanceUID for s in ds.CurrentRequestedProcedureEvidenceSequence
                for se in s.ReferencedSeriesSequence for r in se.ReferencedSOPSequence
                if r.ReferencedSOPInstanceUID not in heatmaps]
        for ref in refs:
            out.setdefault(str(ref), []).append(ds)
    return out


def _check_sr(ds: pydicom.Dataset, source: pydicom.Dataset, meta: dict, checksum: str) -> None:
    import highdicom as hd

    hsr = hd.sr.srread(io.BytesIO(_part10(ds)))  # highdicom reads it as an SR document
    assert hsr.SOPInstanceUID == ds.SOPInstanceUID and ds.VerificationFlag == "UNVERIFIED"
    assert ds.StudyInstanceUID == source.StudyInstanceUID
    text = " ".join(_values(ds))
    assert meta["name"] in text and meta["version"] in text and checksum in text


def _values(ds):
    for el in ds:
        if el.VR == "SQ":
            for item in el.value:
                yield from _values(item)
        else:
            yield str(el.value)


@pytest.fixture
def pacs(tmp_path):
    o = Orthanc(tmp_path / "orthanc").start()
    yield o
    o.stop()


@pytest.mark.slow
def test_score_and_file_srs_through_dicomweb_then_resume_files_nothing_twice(gtafl_pkg, pacs, tmp_path, capsys):
    from tafl.packaging import load_package

    pkg = load_package(gtafl_pkg)
    sent = _study(8, str(tmp_path))
    study = str(sent[0].StudyInstanceUID)
    big, other = _oversized(study), _non_image(study)
    _stow(pacs, sent + [big, other])
    out = tmp_path / "results.csv"
    args = ["score", "--dicomweb", pacs.dicomweb, "--study", study, "--package", str(gtafl_pkg), "--out", str(out),
            "--store-sr", "--dicom-heatmap", "--batch-size", "3", "--no-progress"]
    assert main(args) == 1  # the oversized instance is a failed row: some inputs answered, one not (exit 1)
    printed = capsys.readouterr().out
    import csv

    rows = {csv_uncell(r["path"]): r for r in csv.DictReader(open(out, newline=""))}
    keys = {f"{d.StudyInstanceUID}/{d.SeriesInstanceUID}/{d.SOPInstanceUID}": d for d in sent}
    big_key = f"{study}/{big.SeriesInstanceUID}/{big.SOPInstanceUID}"
    assert set(rows) == set(keys) | {big_key}  # every image instance has a row; the SR is not one
    assert rows[big_key]["error"].startswith("413") and not rows[big_key]["label"]  # the 4xx reason, no SR
    assert "not fetched" in rows[big_key]["error"]  # refused from QIDO's declared geometry, before WADO-RS
    assert all(rows[k]["label"] and not rows[k]["error"] for k in keys)
    assert "1 other file(s) skipped" in printed and "SRs filed to" in printed

    srs = _srs(pacs)
    assert set(srs) == {str(d.SOPInstanceUID) for d in sent}, (len(srs), len(pacs.by_modality("SR")), printed)
    for d in sent:
        assert len(srs[str(d.SOPInstanceUID)]) == 1
        _check_sr(srs[str(d.SOPInstanceUID)][0], d, pkg.metadata, pkg.files["model.onnx"])
    # Orthanc's own view: each SR sits in the source's study (its series' ParentStudy), as do the heatmap captures
    study_id = [r["ID"] for r in pacs.post("/tools/lookup", study.encode()).json() if r["Type"] == "Study"][0]
    ours = [i for i in pacs.instances() if pacs.tags(i).get("Manufacturer") == dicom_sr.MANUFACTURER]
    sr_ids = [i for i in ours if pacs.tags(i).get("Modality") == "SR"]
    assert len(sr_ids) == len(sent)
    for i in ours:
        assert pacs.get(f"/instances/{i}/tags?simplify")["StudyInstanceUID"] == study
        assert pacs.get(f"/series/{pacs.get(f'/instances/{i}')['ParentSeries']}")["ParentStudy"] == study_id
    assert len(ours) - len(sr_ids) == len(sent)  # and one heatmap capture per image

    # --resume: nothing fetched or filed again; a fresh query of the study skips tafl's own SRs and captures
    before = len(pacs.instances())
    assert main(args + ["--resume"]) == 0
    assert "0 scored now" in capsys.readouterr().out and len(pacs.instances()) == before
    again = tmp_path / "again.csv"
    assert main(["score", "--dicomweb", pacs.dicomweb, "--study", study, "--package", str(gtafl_pkg), "--out",
                 str(again), "--no-progress"]) == 1
    assert f"{len(sent) + 1 + len(sent)} other file(s) skipped" in capsys.readouterr().out  # SRs, theirs, SCs
    assert len(list(csv.DictReader(open(again, newline="")))) == len(sent) + 1


@pytest.mark.slow
def test_through_the_service_the_services_srs_are_filed(server, gtafl_pkg, pacs, tmp_path):
    from tafl.clients.dicomweb import score_dicomweb
    from tafl.packaging import load_package

    pkg = load_package(gtafl_pkg)
    sent = _study(4, str(tmp_path))
    _stow(pacs, sent)
    summary = score_dicomweb(pacs.dicomweb, tmp_path / "r.csv", url=server.url, model=pkg.name,
                             studies=[str(sent[0].StudyInstanceUID)], store_sr=True, progress=False)
    assert summary["stored_sr"] == 4 and not summary["failed"] and summary["predicted"] == 4
    srs = _srs(pacs)
    assert set(srs) == {str(d.SOPInstanceUID) for d in sent}
    for d in sent:  # the service built them (format=sr): the same SR content as in-process
        _check_sr(srs[str(d.SOPInstanceUID)][0], d, pkg.metadata, pkg.files["model.onnx"])


def test_a_pacs_that_is_down_at_the_start_is_one_clear_error(gtafl_pkg, tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}/dicom-web"
    code = main(["score", "--dicomweb", url, "--study", "1.2.3", "--package", str(gtafl_pkg), "--out",
                 str(tmp_path / "r.csv")])
    err = capsys.readouterr().err
    assert code != 0 and "did not answer" in err and url in err and "Traceback" not in err
    assert not (tmp_path / "r.csv").exists()  # nothing started, nothing to resume


def test_dicomweb_flags_are_checked_before_anything_runs(gtafl_pkg, tmp_path, capsys):
    base = ["score", "--package", str(gtafl_pkg), "--out", str(tmp_path / "r.csv")]
    for extra, why in ((["--dicomweb", "http://127.0.0.1:9/dicom-web"], "--study UID"),
                       (["--dicomweb", "pacs:8042", "--study", "1.2"], "base URL"),
                       (["--dicomweb", "http://127.0.0.1:9/x", "--study", "1.2", "--since", "2026-01-01"], "not both"),
                       (["--dicomweb", "http://127.0.0.1:9/x", "--since", "yesterday"], "YYYY-MM-DD"),
                       ([str(tmp_path), "--store-sr"], "--dicomweb"),
                       (["--dicomweb", "http://127.0.0.1:9/x", "--study", "1.2", "--dicom-heatmap"], "--store-sr")):
        assert main(base + extra) == 2, extra
        assert why in capsys.readouterr().err, extra
    os.environ["TAFL_DICOMWEB_USER"] = "alice"
    try:
        assert main(base + ["--dicomweb", "http://127.0.0.1:9/x", "--study", "1.2"]) == 2
        assert "TAFL_DICOMWEB_PASSWORD" in capsys.readouterr().err
    finally:
        del os.environ["TAFL_DICOMWEB_USER"]


@pytest.mark.slow
def test_a_pacs_gone_mid_run_stops_resumably_and_resume_files_each_sr_once(gtafl_pkg, pacs, tmp_path):
    from tafl.clients.dicomweb import PacsUnavailable, score_dicomweb

    sent = _study(24, str(tmp_path))
    study = str(sent[0].StudyInstanceUID)
    _stow(pacs, sent)
    out = tmp_path / "results.csv"
    seen = []

    def kill_pacs(row) -> None:
        seen.append(row)
        if len(seen) == 7:
            pacs.stop(kill=True)  # gone, mid-batch, with the next batch's fetch in flight

    with pytest.raises(PacsUnavailable, match="did not answer"):
        score_dicomweb(pacs.dicomweb, out, package=str(gtafl_pkg), studies=[study], store_sr=True, batch_size=4,
                       progress=False, on_row=kill_pacs, retries=2, backoff=0.1)
    lines = out.read_text().splitlines()
    assert 7 <= len(lines) - 1 < 24 and all(line.count(",") >= 5 for line in lines)  # whole rows only
    pacs.start()
    summary = score_dicomweb(pacs.dicomweb, out, package=str(gtafl_pkg), studies=[study], store_sr=True,
                             batch_size=4, progress=False, resume=True)
    assert summary["already_done"] == len(lines) - 1 and summary["images"] == 24 and not summary["failed"]
    import csv

    rows = [csv_uncell(r["path"]) for r in csv.DictReader(open(out, newline=""))]
    assert len(rows) == len(set(rows)) == 24
    srs = _srs(pacs)
    assert set(srs) == {str(d.SOPInstanceUID) for d in sent} and all(len(v) == 1 for v in srs.values())


@pytest.mark.slow
def test_a_refused_stow_is_said_on_its_row_and_the_run_goes_on(gtafl_pkg, tmp_path, capsys):
    pacs = Orthanc(tmp_path / "orthanc", refuse_stow=True).start()
    try:
        sent = _study(5, str(tmp_path))
        for d in sent:
            pacs.upload(_part10(d))  # the images arrive by REST; every STOW-RS is answered 403
        out = tmp_path / "results.csv"
        code = main(["score", "--dicomweb", pacs.dicomweb, "--study", str(sent[0].StudyInstanceUID), "--package",
                     str(gtafl_pkg), "--out", str(out), "--store-sr", "--no-progress"])
        assert code == 1  # every image was scored, but no SR was filed as asked: the refusal is on the rows
        import csv

        rows = list(csv.DictReader(open(out, newline="")))
        assert len(rows) == 5 and all(r["label"] and r["error"].startswith("SR not stored") and "403" in r["error"]
                                      for r in rows)
        assert "refused: 5" in capsys.readouterr().out
        assert not [i for i in pacs.instances() if pacs.tags(i).get("Modality") == "SR"]
    finally:
        pacs.stop()


def test_since_and_modality_pick_studies_and_credentials_come_from_the_environment(gtafl_pkg, tmp_path, capsys,
                                                                                   monkeypatch):
    pacs = Orthanc(tmp_path / "orthanc", users={"tafl": "s3cret-pacs"}).start()
    try:
        old, new = _study(3, str(tmp_path) + "old"), _study(6, str(tmp_path) + "new")
        for ds in old:
            ds.StudyDate = "20190102"
        for ds in new:
            ds.StudyDate = "20261201"
        for d in old + new:
            pacs.upload(_part10(d))
        out = tmp_path / "r.csv"
        args = ["score", "--dicomweb", pacs.dicomweb, "--since", "2026-01-01", "--package", str(gtafl_pkg),
                "--out", str(out), "--no-progress"]
        assert main(args) == 2  # no credentials: one clear line, no traceback
        err = capsys.readouterr().err
        assert "401" in err and "TAFL_DICOMWEB_TOKEN" in err and "Traceback" not in err
        monkeypatch.setenv("TAFL_DICOMWEB_USER", "tafl")
        monkeypatch.setenv("TAFL_DICOMWEB_PASSWORD", "s3cret-pacs")
        assert main(args) == 0
        import csv

        rows = [csv_uncell(r["path"]) for r in csv.DictReader(open(out, newline=""))]
        assert {r.split("/")[0] for r in rows} == {str(new[0].StudyInstanceUID)} and len(rows) == 6
        from tafl.clients.dicomweb import Pacs

        web = Pacs(pacs.dicomweb)  # QIDO page by page: 6 instances in pages of 2 (Orthanc honours offset here)
        got = web.pages("QIDO", lambda **kw: web.client.search_for_instances(
            study_instance_uid=str(new[0].StudyInstanceUID), **kw), "00080018", page=2)
        assert sorted(r["00080018"]["Value"][0] for r in got) == sorted(str(d.SOPInstanceUID) for d in new)
        mr = [d for d in new if d.get("Modality") == "MR"]
        # ModalitiesInStudy: Orthanc 1.10 ignores offset there, which once made the paging ask forever
        assert main(args[:-1] + ["--modality", "MR", "--out", str(tmp_path / "mr.csv"), "--no-progress"]) == 0
        rows = [csv_uncell(r["path"]) for r in csv.DictReader(open(tmp_path / "mr.csv", newline=""))]
        assert sorted(r.split("/")[2] for r in rows) == sorted(str(d.SOPInstanceUID) for d in mr) and mr
        assert "s3cret-pacs" not in capsys.readouterr().out  # never printed
    finally:
        pacs.stop()


def test_without_v_the_job_prints_no_library_info_line_and_names_what_it_skipped(gtafl_pkg, pacs, tmp_path):
    """The CLI as a user runs it (a process of its own, so that its logging is configured as in use): without -v,
    stderr holds no INFO line of a library (dicomweb-client's per query, highdicom's per SR); the summary says what
    a skipped instance is, by SOP class. With -v the same run shows the libraries' lines: they were there to hide."""
    sent = _study(3, str(tmp_path))
    study = str(sent[0].StudyInstanceUID)
    other = _non_image(study)
    _stow(pacs, sent + [other])
    args = [sys.executable, "-m", "tafl.cli", "score", "--dicomweb", pacs.dicomweb, "--study", study, "--package",
            str(gtafl_pkg), "--out", str(tmp_path / "r.csv"), "--store-sr", "--dicom-heatmap", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(args, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    chatter = [line for line in run.stderr.splitlines() if line.startswith(("INFO ", "DEBUG "))
               and not line.split(" ", 2)[1].startswith("tafl")]
    assert not chatter, chatter[:5]
    key = f"{study}/{other.SeriesInstanceUID}/{other.SOPInstanceUID}"
    assert (f"skipped: not an image instance (Comprehensive SR Storage, 1.2.840.10008.5.1.4.1.1.88.33): {key}"
            in run.stdout), run.stdout
    assert "not DICOM, PNG or JPEG" not in run.stdout  # that is a folder's file, not a PACS's instance

    loud = subprocess.run(args[:3] + ["-v"] + args[3:] + ["--force"], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=300)
    assert loud.returncode == 0, loud.stderr[-3000:]
    assert "INFO dicomweb_client" in loud.stderr and "INFO highdicom" in loud.stderr


def test_a_folders_other_files_are_still_said_to_be_no_image(gtafl_pkg, tmp_path, capsys):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.png").write_bytes(digit_png(3))
    (folder / "notes.txt").write_text("not an image")
    assert main(["score", str(folder), "--package", str(gtafl_pkg), "--out", str(tmp_path / "r.csv"),
                 "--no-progress"]) == 0
    assert "skipped (not DICOM, PNG or JPEG): notes.txt" in capsys.readouterr().out


def test_since_says_which_studies_it_cannot_see_for_want_of_a_studydate(gtafl_pkg, pacs, tmp_path, capsys,
                                                                       monkeypatch):
    """QIDO's StudyDate range matches no study without a date: the job says how many there are and how to score
    them, and the way it names (--study UID) scores them."""
    import csv

    import tafl.clients.dicomweb as dw

    new, old, undated = _study(3, str(tmp_path) + "new"), _study(2, str(tmp_path) + "old"), _study(2, str(tmp_path))
    for ds in new:
        ds.StudyDate = "20261201"
    for ds in old:
        ds.StudyDate = "20190102"
    for ds in undated:
        ds.StudyDate = ""  # present and empty: Type 2, as a modality writes it when it does not know
    _stow(pacs, new + old + undated)
    uid = str(undated[0].StudyInstanceUID)
    base = ["score", "--dicomweb", pacs.dicomweb, "--package", str(gtafl_pkg), "--no-progress"]
    assert main(base + ["--since", "2026-01-01", "--out", str(tmp_path / "since.csv")]) == 0
    out = capsys.readouterr().out
    assert ("1 study has no StudyDate, so --since did not score it (a date range matches no study without a date); "
            f"score it with --study UID: {uid}\n") in out, out
    assert str(old[0].StudyInstanceUID) not in out  # dated, before --since: not missed, left out
    rows = list(csv.DictReader(open(tmp_path / "since.csv", newline="")))
    assert {csv_uncell(r["path"]).split("/")[0] for r in rows} == {str(new[0].StudyInstanceUID)}

    assert main(base + ["--study", uid, "--out", str(tmp_path / "undated.csv")]) == 0  # the way the line names
    rows = list(csv.DictReader(open(tmp_path / "undated.csv", newline="")))
    assert len(rows) == 2 and all(r["label"] and not r["error"] for r in rows)
    capsys.readouterr()

    assert main(base + ["--since", "2030-01-01", "--out", str(tmp_path / "none.csv")]) == 2  # nothing that late
    err = capsys.readouterr().err
    assert "no image instance for this query" in err and f"score it with --study UID: {uid}" in err

    monkeypatch.setattr(dw, "UNDATED_SCAN", 2)  # a large archive: the count stops early, and says "at least"
    assert main(base + ["--since", "2026-01-01", "--out", str(tmp_path / "since.csv"), "--force"]) == 0
    out = capsys.readouterr().out
    assert "at least 1 of the first 3 studies listed have no StudyDate, so --since did not score them" in out, out


# ------------------------------------------------------------------ the DIMSE listener against Orthanc
def _listener(pkg: Path, port: int, pacs: Orthanc, spool: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TAFL_DECODE_PROCESSES": "1"}
    return subprocess.Popen([sys.executable, "-m", "tafl.cli", "dicom-listen", "--package", str(pkg), "--port",
                             str(port), "--dest", f"{pacs.aet}@127.0.0.1:{pacs.dicom_port}", "--spool", str(spool)],
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env, cwd=REPO,
                            start_new_session=True)


def _stop(proc: subprocess.Popen, kill: bool = False) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
        proc.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its decoder processes too
    except (ProcessLookupError, PermissionError):
        pass


def _wait_for(cond, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.3)
    return cond()


@pytest.mark.slow
def test_orthanc_sends_to_the_listener_which_files_srs_back_and_a_killed_listener_loses_nothing(gtafl_pkg, tmp_path):
    from tafl.packaging import load_package

    pkg = load_package(gtafl_pkg)
    port, spool, log = free_port(), tmp_path / "spool", tmp_path / "listener.log"
    pacs = Orthanc(tmp_path / "orthanc", modalities={"tafl": ("TAFL", port)}).start()
    proc = _listener(gtafl_pkg, port, pacs, spool, log)
    try:
        assert echo(port, timeout=90), log.read_text()[-2000:]
        sent = _study(20, str(tmp_path))
        ids = [pacs.upload(_part10(d))["ID"] for d in sent]
        # Orthanc sends the study to its modality "tafl" as a job; the listener is killed mid-transfer
        job = pacs.post("/modalities/tafl/store", {"Resources": ids, "Asynchronous": True}).json()["ID"]
        assert _wait_for(lambda: len(pacs.by_modality("SR")) >= 3, 120), log.read_text()[-2000:]
        _stop(proc, kill=True)
        state = pacs.get(f"/jobs/{job}")
        assert _wait_for(lambda: pacs.get(f"/jobs/{job}")["State"] in ("Success", "Failure"), 60)
        proc = _listener(gtafl_pkg, port, pacs, spool, log)  # the same spool: what it acknowledged is finished
        assert echo(port, timeout=90)
        if pacs.get(f"/jobs/{job}")["State"] == "Failure":  # the sender retries what it could not deliver
            pacs.post(f"/jobs/{job}/resubmit", {})
        assert _wait_for(lambda: len(_srs(pacs)) == len(sent), 180), (state, log.read_text()[-3000:])
        srs = _srs(pacs)
        assert set(srs) == {str(d.SOPInstanceUID) for d in sent} and all(len(v) == 1 for v in srs.values())
        for d in sent[:5]:
            _check_sr(srs[str(d.SOPInstanceUID)][0], d, pkg.metadata, pkg.files["model.onnx"])
        assert not list((spool / "queue").glob("*.dcm"))
    finally:
        _stop(proc)
        pacs.stop()
