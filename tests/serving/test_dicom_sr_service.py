"""`POST /predict` with format=sr / Accept: application/dicom against a real `bentoml serve`, and
`tafl score --dicom-out` (in-process and through the service, resumable)."""

from __future__ import annotations

import csv
import io
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pydicom
import pytest
from pydicom.data import get_testdata_file

from tafl.clients.dicom_out import _split
from tafl.imaging import dicom_sr
from tests.conftest import TOKEN, digit_png, shared

pytestmark = pytest.mark.slow
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def post(srv, data: bytes, ctype="application/dicom", headers=None, **fields):
    return httpx.post(f"{srv.url}/predict", files={"file": ("x.dcm", data, ctype)}, headers={**AUTH, **(headers or {})},
                      data={k: str(v) for k, v in fields.items()}, timeout=60)


def _items(ds):
    for item in ds.get("ContentSequence", []):
        yield item
        yield from _items(item)


def _finding(sr) -> str:
    return [i for i in _items(sr) if i.ConceptNameCodeSequence[0].CodeValue == "121071"][0] \
        .ConceptCodeSequence[0].CodeMeaning


def test_format_sr_returns_a_comprehensive_sr_of_the_json_answer(auth_server, gtafl_pkg):
    import highdicom as hd

    from tafl.packaging import load_package

    pkg = load_package(gtafl_pkg)
    raw = Path(get_testdata_file("CT_small.dcm")).read_bytes()
    src = pydicom.dcmread(io.BytesIO(raw))
    js = post(auth_server, raw).json()
    r = post(auth_server, raw, format="sr")
    assert r.status_code == 200 and r.headers["content-type"] == "application/dicom", r.text[:300]
    sr = pydicom.dcmread(io.BytesIO(r.content))
    hd.sr.srread(io.BytesIO(r.content))
    assert sr.SOPClassUID == dicom_sr.SR_STORAGE and sr.VerificationFlag == "UNVERIFIED"
    assert sr.StudyInstanceUID == src.StudyInstanceUID and sr.PatientID == src.PatientID
    assert str(sr.PatientName) == str(src.PatientName)
    refs = sr.CurrentRequestedProcedureEvidenceSequence[0].ReferencedSeriesSequence[0].ReferencedSOPSequence
    assert refs[0].ReferencedSOPInstanceUID == src.SOPInstanceUID
    assert _finding(sr) == js["class_name"]  # the same prediction as the JSON answer
    texts = {i.TextValue for i in _items(sr) if getattr(i, "ValueType", "") == "TEXT"}
    assert pkg.files["model.onnx"] in " ".join(texts) and pkg.name in texts and pkg.version in texts
    votes = {i.ConceptNameCodeSequence[0].CodeMeaning: i.ConceptCodeSequence[0].CodeMeaning for i in _items(sr)
             if i.ConceptNameCodeSequence[0].CodeMeaning.startswith("Expert vote")}
    assert votes == {f"Expert vote: {e['name']}": e["class_name"] for e in js["experts"]}
    # Accept: application/dicom asks for the same
    a = post(auth_server, raw, headers={"Accept": "application/dicom"})
    assert a.headers["content-type"] == "application/dicom"
    assert pydicom.dcmread(io.BytesIO(a.content)).SOPInstanceUID == sr.SOPInstanceUID


def test_heatmap_true_adds_a_secondary_capture_the_sr_references(auth_server):
    raw = Path(get_testdata_file("MR_small_RLE.dcm")).read_bytes()
    r = post(auth_server, raw, format="sr", heatmap="true")
    assert r.status_code == 200 and r.headers["content-type"].startswith("multipart/related"), r.text[:300]
    sr_b, sc_b = _split(r.content, r.headers["content-type"])
    sr, sc = pydicom.dcmread(io.BytesIO(sr_b)), pydicom.dcmread(io.BytesIO(sc_b))
    assert sc.SOPClassUID == dicom_sr.SC_STORAGE and sc.StudyInstanceUID == sr.StudyInstanceUID
    assert sc.pixel_array.shape[-1] == 3
    assert any(getattr(i, "ValueType", "") == "IMAGE" and i.ReferencedSOPSequence[0].ReferencedSOPInstanceUID
               == sc.SOPInstanceUID for i in _items(sr))


def test_bad_inputs_with_format_sr_are_clear_4xx(auth_server):
    png = post(auth_server, digit_png(0), ctype="image/png", format="sr")
    assert png.status_code == 415 and "needs a DICOM input" in png.json()["error"]["message"]
    assert post(auth_server, digit_png(0), ctype="image/png", format="xml").status_code == 400
    broken = Path(get_testdata_file("MR_truncated.dcm")).read_bytes()
    plain, as_sr = post(auth_server, broken), post(auth_server, broken, format="sr")
    assert 400 <= plain.status_code < 500 and as_sr.status_code == plain.status_code  # the same 4xx as today
    ds = pydicom.dcmread(get_testdata_file("CT_small.dcm"))
    del ds.StudyInstanceUID
    buf = io.BytesIO()
    ds.save_as(buf)
    r = post(auth_server, buf.getvalue(), format="sr")
    assert r.status_code == 422 and "StudyInstanceUID" in r.json()["error"]["message"]


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "in"
    (folder / "a").mkdir(parents=True)
    for name in ("CT_small.dcm", "MR_small.dcm", "MR_small_RLE.dcm"):
        shutil.copy(get_testdata_file(name), folder / "a" / name)
    (folder / "digit.png").write_bytes(digit_png(1))
    return folder


def test_score_dicom_out_in_process_and_resume(gtafl_pkg, tmp_path):
    from tafl.clients.score import score_folder

    folder, out, dicom = _folder(tmp_path), tmp_path / "r.csv", tmp_path / "dicom"
    s = score_folder(folder, out, package=str(gtafl_pkg), dicom_out=dicom, dicom_heatmap=True, progress=False)
    assert s["dicom_written"] == 3 and not s["dicom_failed"]
    srs = sorted(dicom.rglob("*.sr.dcm"))
    assert [p.name for p in srs] == ["CT_small.dcm.sr.dcm", "MR_small.dcm.sr.dcm", "MR_small_RLE.dcm.sr.dcm"]
    assert len(list(dicom.rglob("*.heatmap.dcm"))) == 3 and not list(dicom.rglob("*.part"))
    rows = {r["path"]: r for r in csv.DictReader(open(out))}
    for p in srs:
        sr = pydicom.dcmread(p)
        src = pydicom.dcmread(folder / "a" / p.name[:-len(".sr.dcm")], stop_before_pixels=True)
        assert sr.CurrentRequestedProcedureEvidenceSequence[0].StudyInstanceUID == src.StudyInstanceUID
        assert _finding(sr) == rows["a/" + src_name(p)]["class_name"]
    # a kill after an SR but before its row: the row is scored again on --resume and its SR rewritten, once
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:-1]))  # the last row: a/MR_small_RLE.dcm (the root folder is walked first)
    again = score_folder(folder, out, package=str(gtafl_pkg), dicom_out=dicom, resume=True, progress=False)
    assert again["scored_now"] == 1 and len(list(dicom.rglob("*.sr.dcm"))) == 3


def src_name(p: Path) -> str:
    return p.name[:-len(".sr.dcm")]


def test_score_dicom_out_through_the_service(auth_server, tmp_path):
    from tafl.clients.score import score_folder

    folder, dicom = _folder(tmp_path), tmp_path / "dicom"
    s = score_folder(folder, tmp_path / "r.csv", url=auth_server.url, token=TOKEN, dicom_out=dicom, progress=False)
    assert s["dicom_written"] == 3 and s["predicted"] == 4
    for p in dicom.rglob("*.sr.dcm"):
        assert pydicom.dcmread(p).SOPClassUID == dicom_sr.SR_STORAGE


def test_shared_real_dicoms_through_the_service(auth_server):
    """SR and SC over HTTP for a sample of the shared real DICOMs (all codecs); the full set is
    tests/test_dicom_sr.py and benchmarks/dicom_listener.py."""
    folder = shared("dicom")
    for name in ("liver.dcm", "US1_J2KR.dcm", "emri_small_jpeg_ls_lossless.dcm", "SC_rgb_2frame.dcm", "color-pl.dcm"):
        raw = (folder / name).read_bytes()
        r = post(auth_server, raw, format="sr", heatmap="true")
        assert r.status_code == 200, (name, r.text[:300])
        sr_b, sc_b = _split(r.content, r.headers["content-type"])
        src = pydicom.dcmread(io.BytesIO(raw), stop_before_pixels=True)
        sr = pydicom.dcmread(io.BytesIO(sr_b))
        refs = {x.ReferencedSOPInstanceUID for s in sr.CurrentRequestedProcedureEvidenceSequence
                for se in s.ReferencedSeriesSequence for x in se.ReferencedSOPSequence}
        assert src.SOPInstanceUID in refs and pydicom.dcmread(io.BytesIO(sc_b)).SOPInstanceUID in refs


def test_score_dicom_out_with_sr_processes_gives_what_this_process_gives(gtafl_pkg, tmp_path):
    """A job of many inputs builds its SRs in other processes (as `tafl score` does from 16 on): the same SRs as
    built here, the rows in the same order, each row after its SR, and an SR that cannot be made listed."""
    from tafl.clients.score import score_folder

    folder = tmp_path / "in"
    folder.mkdir()
    names = ("CT_small.dcm", "MR_small.dcm", "MR_small_RLE.dcm")
    for i in range(18):
        ds = pydicom.dcmread(get_testdata_file(names[i % 3]))
        ds.SOPInstanceUID = pydicom.uid.generate_uid(entropy_srcs=["pool", str(i)])
        ds.save_as(folder / f"{i:02d}.dcm")
    no_study = pydicom.dcmread(get_testdata_file("CT_small.dcm"))
    del no_study.StudyInstanceUID  # scored, but no SR can reference its study
    no_study.save_as(folder / "99-no-study.dcm")
    (folder / "digit.png").write_bytes(digit_png(3))
    runs = {}
    for procs in (0, 2):
        out, dicom = tmp_path / f"r{procs}.csv", tmp_path / f"dicom{procs}"
        s = score_folder(folder, out, package=str(gtafl_pkg), dicom_out=dicom, dicom_heatmap=True, progress=False,
                         sr_processes=procs)
        runs[procs] = (s, [r["path"] for r in csv.DictReader(open(out))], dicom)
    (s0, order0, d0), (s2, order2, d2) = runs[0], runs[2]
    assert s2["dicom_written"] == s0["dicom_written"] == 18 and s2["predicted"] == 20
    assert [p for p, _ in s2["dicom_failed"]] == [p for p, _ in s0["dicom_failed"]] == ["99-no-study.dcm"]
    assert order2 == order0 and len(order2) == 20
    for p in sorted(d0.rglob("*.dcm")):
        built_here, built_there = pydicom.dcmread(p), pydicom.dcmread(d2 / p.relative_to(d0))
        assert built_there.SOPInstanceUID == built_here.SOPInstanceUID  # derived from the source and the model
        if built_here.SOPClassUID == dicom_sr.SR_STORAGE:
            assert _finding(built_there) == _finding(built_here)
        else:
            assert built_there.pixel_array.tobytes() == built_here.pixel_array.tobytes()  # the heatmap
    assert len(list(d2.rglob("*.heatmap.dcm"))) == 18 and not list(d2.rglob("*.part"))
    # `tafl score` itself (its processes are spawned from the command's own entry point)
    cli = subprocess.run([sys.executable, "-m", "tafl.cli", "score", str(folder), "--out", str(tmp_path / "cli.csv"),
                          "--package", str(gtafl_pkg), "--dicom-out", str(tmp_path / "cli"), "--no-progress"],
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 1, cli.stderr[-2000:]  # 99-no-study.dcm has its row but no SR: some inputs not done
    assert len(list((tmp_path / "cli").rglob("*.sr.dcm"))) == 18 and "99-no-study.dcm" in cli.stdout + cli.stderr
