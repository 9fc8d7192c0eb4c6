"""The input domain's header rules (issue 53, item 1): a package records the modalities, SOP classes and colour it
was trained on (from the training data's DICOM headers and images, or `tafl export --domain`), and a DICOM whose
header contradicts them is refused with the reason before the model runs: by the service (/predict and
/predict/batch, a real `bentoml serve`), by in-process scoring and by the DICOM listener. Absent tags decide
nothing."""

from __future__ import annotations

import csv
import io
import json

import httpx
import numpy as np
import pydicom
import pytest
from pydicom.data import get_testdata_file

from tafl.errors import ConfigError, OutsideDomain, PackageError
from tafl.packaging.domain import (DECLARED, FROM_DATA, FROM_PARENT, contradiction, from_training, parse_declarations,
                                  resolve)
from tafl.packaging.metadata import InputDomain, PackageMetadata
from tests.conftest import digit_png

XC = InputDomain(("XC",), (), "colour", {"modalities": DECLARED, "colour": FROM_DATA})


def dicom(modality: str | None, photometric: str = "MONOCHROME2", sop=pydicom.uid.SecondaryCaptureImageStorage,
          seed: int = 0) -> bytes:
    """A 32×32 8-bit DICOM image with the given header facts (Modality left out where None)."""
    ds = pydicom.Dataset()
    ds.file_meta = pydicom.dataset.FileMetaDataset()
    ds.file_meta.TransferSyntaxUID = pydicom.uid.ExplicitVRLittleEndian
    ds.file_meta.MediaStorageSOPClassUID = sop
    ds.file_meta.MediaStorageSOPInstanceUID = pydicom.uid.generate_uid()
    ds.SOPClassUID, ds.SOPInstanceUID = sop, ds.file_meta.MediaStorageSOPInstanceUID
    ds.StudyInstanceUID, ds.SeriesInstanceUID = pydicom.uid.generate_uid(), pydicom.uid.generate_uid()
    if modality:
        ds.Modality = modality
    rgb = photometric == "RGB"
    ds.Rows = ds.Columns = 32
    ds.SamplesPerPixel, ds.PhotometricInterpretation = (3, "RGB") if rgb else (1, photometric)
    if rgb:
        ds.PlanarConfiguration = 0
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 8, 8, 7, 0
    shape = (32, 32, 3) if rgb else (32, 32)
    ds.PixelData = np.random.default_rng(seed).integers(0, 255, shape, np.uint8).tobytes()
    buf = io.BytesIO()
    pydicom.dcmwrite(buf, ds, enforce_file_format=True)
    return buf.getvalue()


def digit_dicom(modality: str | None, index: int = 0) -> bytes:
    """A colour DICOM whose pixels are one of scikit-learn's digits (grey in three channels): in a digits model's
    learned domain, where `dicom`'s random pixels are not."""
    from sklearn.datasets import load_digits

    ds = pydicom.dcmread(io.BytesIO(dicom(modality, "RGB")))
    g = np.uint8(load_digits().images[index] * 15).repeat(4, 0).repeat(4, 1)
    ds.PixelData = np.stack([g, g, g], axis=-1).tobytes()
    buf = io.BytesIO()
    pydicom.dcmwrite(buf, ds, enforce_file_format=True)
    return buf.getvalue()


# ---------------------------------------------------------------- the rule
def test_a_header_that_contradicts_the_domain_is_named_and_absent_tags_decide_nothing():
    why = contradiction(XC, {"modality": "CT", "photometric": "MONOCHROME2"})
    assert why.startswith("its Modality is CT, and this model was trained on XC images only (declared at export)")
    assert "colour" in contradiction(XC, {"modality": "XC", "photometric": "MONOCHROME2"})
    assert contradiction(XC, {"modality": "XC", "photometric": "RGB"}) is None
    assert contradiction(XC, {"photometric": "YBR_FULL_422"}) is None  # no Modality: nothing said against it
    assert contradiction(XC, {}) is None and contradiction(XC, {"photometric": "other"}) is None
    grey = InputDomain((), ("CT Image Storage",), "greyscale", {"sop_classes": DECLARED, "colour": FROM_DATA})
    assert "a colour image (RGB)" in contradiction(grey, {"photometric": "RGB"})
    assert "MR Image Storage object" in contradiction(grey, {"sop_class": "MR Image Storage"})
    assert contradiction(grey, {"sop_class": "CT Image Storage", "modality": "CT", "photometric": "MONOCHROME1"}) is None
    assert not InputDomain() and contradiction(InputDomain(), {"modality": "CT", "photometric": "RGB"}) is None


def test_declarations_are_checked_and_name_the_fix():
    got = parse_declarations(["modality=XC,DMS", "sop-class=1.2.840.10008.5.1.4.1.1.77.1.4", "colour=Colour"])
    assert got == {"modalities": ("XC", "DMS"), "sop_classes": ("VL Photographic Image Storage",), "colour": "colour"}
    assert parse_declarations(["modality=any", "colour=any"]) == {"modalities": None, "colour": None}
    for bad, words in (("modality=ct", "no DICOM Modality code"), ("size=32", "KEY one of modality"),
                       ("colour=blue", "colour, greyscale or any"), ("modality=", "no value"),
                       ("sop-class=CT Image Storag", "did you mean 'CT Image Storage'"),
                       ("sop-class=1.2.3", "no SOP class UID")):
        with pytest.raises(ConfigError, match=words):
            parse_declarations([bad])


def test_the_training_data_give_the_domain_and_declarations_replace_it():
    prov = {"dicom": {"files": 3, "modalities": {"XC": 2, "DMS": 1}, "sop_classes": {"VL Photographic Image Storage": 3}},
            "colour": {"colour": 96, "greyscale": 4}}
    d = from_training(prov)
    assert d.modalities == ("DMS", "XC") and d.sop_classes == ("VL Photographic Image Storage",) and d.colour == "colour"
    assert set(d.source.values()) == {FROM_DATA}
    assert from_training({"colour": {"colour": 94, "greyscale": 6}}).colour is None  # mixed: decides nothing
    assert from_training({"colour": {"colour": 0, "greyscale": 10}}).colour == "greyscale"
    r = resolve(prov, ["modality=XC", "sop-class=any"])
    assert r.modalities == ("XC",) and r.sop_classes == () and r.colour == "colour"
    assert r.source == {"modalities": DECLARED, "colour": FROM_DATA}
    # a retrain's export keeps what the parent was told, and its own data's facts where the parent's came from data
    child = resolve({"colour": {"colour": 0, "greyscale": 5}}, [], parent=r)
    assert child.modalities == ("XC",) and child.source["modalities"] == FROM_PARENT and child.colour == "greyscale"


def test_the_domain_is_part_of_the_metadata_contract(gtafl_pkg):
    raw = json.loads((gtafl_pkg / "metadata.json").read_text())
    meta = PackageMetadata.from_json({**raw, "domain": XC.to_json()})
    assert meta.domain == XC and meta.to_json()["domain"] == XC.to_json()
    old = {k: v for k, v in raw.items() if k != "domain"}  # a package exported before the domain existed
    assert not PackageMetadata.from_json(old).domain
    with pytest.raises(PackageError, match=r"'domain.modalities' must be a list of DICOM Modality codes.*'domain.colour' is 'blue'"):
        PackageMetadata.from_json({**raw, "domain": {"colour": "blue", "modalities": ["ct scan"]}})


def test_colour_counts_tell_greyscale_stored_as_rgb_from_colour():
    from tafl.training.data import colour_counts

    rng = np.random.default_rng(0)
    grey = np.repeat(rng.integers(0, 255, (5, 8, 8, 1), np.uint8), 3, axis=-1)
    noisy = np.clip(grey.astype(int) + rng.integers(-2, 3, grey.shape), 0, 255).astype(np.uint8)  # JPEG-like chroma
    colour = rng.integers(0, 255, (3, 8, 8, 3), np.uint8)
    assert colour_counts(np.concatenate([grey, noisy, colour])) == {"colour": 3, "greyscale": 10}
    assert colour_counts(grey[..., :1]) == {"colour": 0, "greyscale": 5}


# ---------------------------------------------------------------- a package trained on DICOM files
@pytest.fixture(scope="module")
def dicom_pkg(tmp_path_factory):
    """A package trained on a folder of XC colour DICOMs (the digits, coloured), with the domain read from them."""
    pytest.importorskip("torch", reason="training and export need the train extra")
    from sklearn.datasets import load_digits

    from tafl.packaging.export import export_checkpoint
    from tafl.training.config import load_config
    from tafl.training.simulator import train
    from tests.conftest import CONFIGS

    root = tmp_path_factory.mktemp("xc")
    (root / "images").mkdir()
    d = load_digits()
    rows = []
    for i, (x, y) in enumerate(zip(d.images[:400], d.target[:400])):
        ds = pydicom.dcmread(io.BytesIO(dicom("XC", "RGB", sop=pydicom.uid.VLPhotographicImageStorage, seed=i)))
        g = np.uint8(x * 15)
        ds.PixelData = np.stack([g, 255 - g, g // 2], axis=-1).repeat(4, 0).repeat(4, 1).tobytes()
        ds.save_as(root / "images" / f"img{i}.dcm", enforce_file_format=True)
        rows.append((f"img{i}", str(y)))
    with open(root / "labels.csv", "w", newline="") as fh:
        csv.writer(fh).writerows([("image_id", "dx"), *rows])
    cfg = load_config(CONFIGS / "smoke.yaml", {"dataset": "folder", "data_root": str(root), "labels": "labels.csv",
                                               "label_column": "dx", "rounds": 1, "cache_dir": ""})
    train(cfg, root / "run", progress=False)
    pkg = root / "pkg"
    export_checkpoint(root / "run" / "final.pt", pkg, name="xc-model")
    return pkg


def test_a_dicom_training_folder_gives_the_package_its_domain(dicom_pkg):
    from tafl.packaging.package import load_package

    pkg = load_package(dicom_pkg)
    d = pkg.meta.domain
    assert d.modalities == ("XC",) and d.sop_classes == ("VL Photographic Image Storage",) and d.colour == "colour"
    assert set(d.source.values()) == {FROM_DATA}
    assert "Input domain: colour images (training data); Modality XC (training data)" in pkg.card
    ct = pydicom.dcmread(get_testdata_file("CT_small.dcm"))
    from tafl.imaging import decode_image

    with pytest.raises(OutsideDomain, match="its Modality is CT, and this model was trained on XC images only"):
        pkg.check_domain(decode_image(open(get_testdata_file("CT_small.dcm"), "rb").read()))
    assert ct.Modality == "CT"
    pkg.check_domain(decode_image(dicom("XC", "RGB", sop=pydicom.uid.VLPhotographicImageStorage)))  # in domain
    pkg.check_domain(decode_image(digit_png(3)))  # a PNG has no header to contradict it


# ---------------------------------------------------------------- where tafl classifies
@pytest.fixture(scope="module")
def skin_like(gtafl_run, tmp_path_factory):
    """The smoke GTAFL model exported as a colour XC model (declared), as a dermoscopy package would be."""
    pytest.importorskip("torch", reason="export needs the train extra")
    from tafl.packaging.export import export_checkpoint

    pkg = tmp_path_factory.mktemp("skin") / "pkg"
    export_checkpoint(gtafl_run / "final.pt", pkg, name="skin-like", domain=["modality=XC,DMS", "colour=colour"])
    return pkg


@pytest.fixture(scope="module")
def skin_server(skin_like, tmp_path_factory):
    from tafl.serving.launch import ServerProcess

    base = tmp_path_factory.mktemp("svc_domain")
    env = {"BENTOML_HOME": str(base / "home"), "TAFL_AUDIT_LOG": str(base / "audit.jsonl"), "TAFL_WORKERS": "1"}
    with ServerProcess([str(skin_like)], env=env, log_path=base / "service.log") as srv:
        srv.log = base / "service.log"
        yield srv


@pytest.mark.slow
def test_the_service_refuses_a_ct_slice_before_the_model_and_answers_the_rest(skin_server):
    ct = open(get_testdata_file("CT_small.dcm"), "rb").read()
    r = httpx.post(f"{skin_server.url}/predict", files={"file": ("ct.dcm", ct, "application/dicom")}, timeout=60)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "OutsideDomain" and "its Modality is CT" in err["message"]
    assert "XC or DMS images only (declared at export)" in err["message"] and "label" not in r.json()
    sr = httpx.post(f"{skin_server.url}/predict", data={"format": "sr"},
                    files={"file": ("ct.dcm", ct, "application/dicom")}, timeout=60)
    assert sr.status_code == 422 and sr.headers["content-type"].startswith("application/json")  # no SR to file
    grey = dicom("XC", "MONOCHROME2")
    g = httpx.post(f"{skin_server.url}/predict", files={"file": ("g.dcm", grey, "application/dicom")}, timeout=60)
    assert g.status_code == 422 and "a greyscale image (MONOCHROME2)" in g.json()["error"]["message"]
    ok = httpx.post(f"{skin_server.url}/predict", files={"file": ("c.dcm", dicom("XC", "RGB"), "application/dicom")},
                    timeout=60)
    assert ok.status_code == 200 and "label" in ok.json() and "abstained" in ok.json()
    unsaid = httpx.post(f"{skin_server.url}/predict",  # no Modality: the colour alone cannot refuse it
                        files={"file": ("u.dcm", dicom(None, "RGB"), "application/dicom")}, timeout=60)
    assert unsaid.status_code == 200
    files = [("file", ("a.png", digit_png(1), "image/png")), ("file", ("ct.dcm", ct, "application/dicom")),
             ("file", ("c.dcm", dicom("DMS", "RGB"), "application/dicom"))]
    b = httpx.post(f"{skin_server.url}/predict/batch", files=files, timeout=60)
    assert b.status_code == 200
    res = b.json()["results"]
    assert "label" in res[0] and "label" in res[2] and "label" not in res[1]
    assert res[1]["error"]["status"] == 422 and res[1]["error"]["code"] == "OutsideDomain"
    models = httpx.get(f"{skin_server.url}/models", timeout=30).json()["models"][0]
    assert models["metadata"]["domain"]["modalities"] == ["XC", "DMS"]
    # monitoring: four refusals (CT, CT as format=sr, the greyscale XC, the batch's CT) beside four images the model
    # saw (the digit is in its domain; the synthetic colour frames, to a digits model, may be abstained on by its
    # learned detector): neither the refused nor the abstained entered the case-mix window
    dom = models["domain"]
    assert dom["refused"] == 4 and dom["answered"] + dom["abstained"] == 4 and dom["refused_share"] == 0.5, dom
    assert dom["outside_share"] == (4 + dom["abstained"]) / 8 and dom["answered"] >= 1, dom
    assert dom["rule"].startswith("colour images (declared at export); Modality XC or DMS (declared at export)")
    assert models["case_mix"]["images_in_window"] == dom["answered"], models["case_mix"]
    metrics = httpx.get(f"{skin_server.url}/metrics", timeout=30).text
    assert 'tafl_outside_domain_total{by="header",model="skin-like",version="1.0.0"} 4.0' in metrics or \
        'tafl_outside_domain_total{model="skin-like",version="1.0.0",by="header"} 4.0' in metrics, metrics
    assert "Traceback" not in skin_server.log.read_text()


def test_in_process_scoring_gives_a_refused_image_a_row_with_the_reason(skin_like, tmp_path):
    from tafl.clients.score import score_folder

    folder = tmp_path / "imgs"
    folder.mkdir()
    (folder / "ct.dcm").write_bytes(open(get_testdata_file("CT_small.dcm"), "rb").read())
    (folder / "ok.dcm").write_bytes(dicom("XC", "RGB"))
    (folder / "d.png").write_bytes(digit_png(2))
    (folder / "digit.dcm").write_bytes(digit_dicom("XC", 3))
    score_folder(folder, tmp_path / "out.csv", package=str(skin_like), progress=False)
    rows = {r["path"]: r for r in csv.DictReader(open(tmp_path / "out.csv"))}
    assert rows["ct.dcm"]["error"].startswith("422 OutsideDomain: outside the model's domain: its Modality is CT")
    assert not rows["ct.dcm"]["label"] and rows["d.png"]["label"] and rows["d.png"]["in_domain"] == "True"
    assert rows["digit.dcm"]["label"] and rows["digit.dcm"]["in_domain"] == "True"
    # the synthetic colour frame passes the header rules; to a digits model's detector it is far from every class,
    # so it gets the row of an abstention: no label, in_domain false, its distance
    ok = rows["ok.dcm"]
    assert not ok["error"] and ok["in_domain"] == "False" and not ok["label"] and float(ok["domain_distance"]) > 0


def test_the_listener_files_no_finding_for_a_refused_instance(skin_like, tmp_path):
    from tafl.serving.dicom_listener import Destination, Listener
    from tests.dicom_net import free_port, send

    from tafl.clients.score import score_folder

    # an instance the model answers: a digit its learned detector keeps (about 5 % of in-domain images are not kept,
    # so which digit depends on the trained weights), found by scoring the ten in-process first
    digits = tmp_path / "digits"
    digits.mkdir()
    for d in range(10):
        (digits / f"{d}.dcm").write_bytes(digit_dicom("XC", d))
    score_folder(digits, tmp_path / "digits.csv", package=str(skin_like), progress=False)
    kept = [r["path"] for r in csv.DictReader(open(tmp_path / "digits.csv")) if r["in_domain"] == "True"]
    assert kept, "the detector kept none of the ten digits"
    port, spool, out = free_port(), tmp_path / "spool", tmp_path / "srs"
    lst = Listener(skin_like, Destination(folder=out), port=port, spool=spool, workers=1)
    lst.start()
    try:
        ct = pydicom.dcmread(get_testdata_file("CT_small.dcm"))
        ok = pydicom.dcmread(digits / kept[0])
        stats = send(port, [ct, ok], deadline=60)
        lst.stop(drain=True)
    finally:
        lst.stop()
    assert stats["acked"] == 2 and lst.stats["failed"] == 1 and lst.stats["delivered"] == 1, lst.stats
    [note] = (spool / "failed").glob("*.reason.json")
    reason = json.loads(note.read_text())
    assert reason["error"] == "OutsideDomain" and "its Modality is CT" in reason["reason"]
    srs = [pydicom.dcmread(p) for p in out.rglob("*.dcm")]
    assert len(srs) == 1 and all(s.StudyInstanceUID != ct.StudyInstanceUID for s in srs)  # nothing filed for the CT


@pytest.mark.parametrize("not_assessed", [False, True])
def test_the_listener_files_no_finding_for_an_image_the_model_abstains_on(skin_like, tmp_path, not_assessed):
    """A frame that passes the header rules but lies outside the learned domain: by default failed/ with the
    detector's reason and no SR; with not_assessed_sr an SR whose only evaluation says "not assessed"."""
    from tafl.imaging.dicom_sr import NOT_ASSESSED
    from tafl.serving.dicom_listener import Destination, Listener
    from tests.dicom_net import free_port, send

    port, spool, out = free_port(), tmp_path / "spool", tmp_path / "srs"
    lst = Listener(skin_like, Destination(folder=out), port=port, spool=spool, workers=1,
                   not_assessed_sr=not_assessed)
    lst.start()
    try:
        noise = pydicom.dcmread(io.BytesIO(dicom("XC", "RGB", seed=5)))
        stats = send(port, [noise], deadline=60)
        lst.stop(drain=True)
    finally:
        lst.stop()
    assert stats["acked"] == 1
    srs = [pydicom.dcmread(p) for p in out.rglob("*.dcm")]
    if not not_assessed:
        assert lst.stats["failed"] == 1 and not srs, lst.stats
        [note] = (spool / "failed").glob("*.reason.json")
        reason = json.loads(note.read_text())
        assert reason["error"] == "OutsideDomain" and reason["status"] == 422
        assert "the model abstained" in reason["reason"] and "validation images" in reason["reason"]
        return
    assert lst.stats["delivered"] == 1 and len(srs) == 1, lst.stats
    sr = srs[0]
    assert sr.StudyInstanceUID == noise.StudyInstanceUID and "not assessed" in sr.SeriesDescription
    group = sr.ContentSequence[-1].ContentSequence[0].ContentSequence
    codes = [(i.ConceptNameCodeSequence[0].CodeMeaning, i.ConceptCodeSequence[0].CodeMeaning)
             for i in group if i.ValueType == "CODE"]
    assert codes == [("Assessment", NOT_ASSESSED)]  # no finding type, no probability, no vote
    assert not any(i.ValueType == "NUM" for i in group)

