"""`tafl validate` (issue 55): a site validates a package on its own labelled images. The report's numbers equal an
independent computation (scikit-learn's metrics, statsmodels' Wilson intervals, scikit-learn's calibration curve)
to 1e-9; acceptance criteria are judged on the interval and set the exit status; a labels CSV with problems gives
one line each and no report; the HTML report renders in real Chromium with its verdict and charts, and prints to
PDF with them."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tafl.errors import ConfigError
from tests.conftest import digit_png

TAFL = [sys.executable, "-m", "tafl.cli"]


def labelled(root: Path, n: int = 240, extra_rows: list[dict] | None = None) -> tuple[Path, Path]:
    """DIR/img/dI.png for the first n digits and DIR/labels.csv (path without suffix, label)."""
    from sklearn.datasets import load_digits

    target = load_digits().target
    (root / "img").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        (root / "img" / f"d{i}.png").write_bytes(digit_png(i))
        rows.append({"path": f"d{i}", "label": str(target[i])})
    rows += extra_rows or []
    with open(root / "labels.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, ["path", "label"])
        w.writeheader()
        w.writerows(rows)
    return root / "img", root / "labels.csv"


@pytest.fixture(scope="module")
def report(gtafl_pkg, tmp_path_factory):
    from tafl.clients.validate import validate

    img, labels = labelled(tmp_path_factory.mktemp("val"))
    return validate(gtafl_pkg, img, labels, criteria=["balanced_accuracy>=0.05", "sensitivity(1)>0.99"])


def check_independently(report: dict, out: dict, y: np.ndarray, names: list[str]) -> None:
    """The report's numbers against scikit-learn's metrics, statsmodels' Wilson intervals and scikit-learn's
    calibration curve, to 1e-9, on the package's outputs `out` for the images whose classes are `y`."""
    from sklearn.calibration import calibration_curve
    from sklearn.metrics import balanced_accuracy_score, confusion_matrix, roc_auc_score
    from statsmodels.stats.proportion import proportion_confint

    pred, C = out["label"], len(names)
    cm = confusion_matrix(y, pred, labels=range(C))
    assert report["confusion"] == cm.tolist()
    for c, name in enumerate(names):
        tp, fn = cm[c, c], cm[c].sum() - cm[c, c]
        fp, tn = cm[:, c].sum() - tp, cm.sum() - cm[c].sum() - cm[:, c].sum() + tp
        sens, spec = report["per_class"][name]["sensitivity"], report["per_class"][name]["specificity"]
        if tp + fn:
            lo, hi = proportion_confint(tp, tp + fn, alpha=0.05, method="wilson")
            np.testing.assert_allclose(sens, [tp / (tp + fn), lo, hi], atol=1e-9)
            assert report["roc"][name]["auc"] == pytest.approx(
                roc_auc_score(y == c, out["calibrated_probs"][:, c]), abs=1e-9)
        lo, hi = proportion_confint(tn, tn + fp, alpha=0.05, method="wilson")
        np.testing.assert_allclose(spec, [tn / (tn + fp), lo, hi], atol=1e-9)
    acc = report["rules"]["default"]
    lo, hi = proportion_confint((pred == y).sum(), len(y), alpha=0.05, method="wilson")
    np.testing.assert_allclose(acc["accuracy"], [(pred == y).mean(), lo, hi], atol=1e-9)
    assert acc["balanced_accuracy"][0] == pytest.approx(balanced_accuracy_score(y, pred), abs=1e-9)
    assert acc["balanced_accuracy"][1] <= acc["balanced_accuracy"][0] <= acc["balanced_accuracy"][2]
    conf = out["probs"][np.arange(len(y)), pred]
    frac, mean_conf = calibration_curve(pred == y, conf, n_bins=10, strategy="uniform")
    counts = np.histogram(conf, bins=np.linspace(0, 1, 11))[0]
    counts = counts[counts > 0]
    ece = float(np.sum(counts / counts.sum() * np.abs(frac - mean_conf)))
    assert report["calibration"]["ece"] == pytest.approx(ece, abs=1e-9)
    assert set(report["rules"]) == {"default", "site", "adapted"}


def test_the_numbers_equal_an_independent_computation(report, gtafl_pkg):
    pytest.importorskip("statsmodels")
    from sklearn.datasets import load_digits

    from tafl.imaging import decode_image
    from tafl.packaging import load_package

    pkg = load_package(gtafl_pkg)
    y = load_digits().target[:240]
    out = pkg.run(pkg.session(["CPUExecutionProvider"]), [decode_image(digit_png(i)).frames[0] for i in range(240)])
    check_independently(report, out, y, list(pkg.class_names))
    assert report["sets"]["level"] == 0.9 and 0 <= report["sets"]["coverage"][0] <= 1


def test_criteria_are_judged_on_the_interval(report):
    from tafl.clients.validate import Criterion, judge, parse_criteria

    by = {c["criterion"]: c for c in report["criteria"]}
    ba = by["balanced_accuracy>=0.05"]
    assert ba["judged_on"] == ba["interval"][0] and ba["passed"] == (ba["interval"][0] >= 0.05)
    est, lo, hi = report["rules"]["default"]["balanced_accuracy"]
    # an estimate above the bar with its interval's lower end below it does not pass; an upper bound uses the top
    assert not judge(Criterion("x", "balanced_accuracy", None, ">=", (lo + est) / 2), report)["passed"]
    assert judge(Criterion("x", "balanced_accuracy", None, "<=", hi + 1e-6), report)["passed"]
    assert not judge(Criterion("x", "balanced_accuracy", None, "<=", (est + hi) / 2), report)["passed"]
    assert report["passed"] == all(c["passed"] for c in report["criteria"])
    with pytest.raises(ConfigError) as err:
        parse_criteria(["sensitivity(mel)>=0.8", "accuracy(nowhere)>0.5", "f1>0.3", "accuracy>=80%",
                        "refused<=2"], [str(i) for i in range(10)])
    lines = err.value.message.splitlines()
    assert len(lines) == 4 and "one of the model's classes" in lines[0] and "rule is one of" in lines[1]
    assert "expected METRIC(ARG)OP VALUE" in lines[2] and "not a share" in lines[3]
    assert parse_criteria(["accuracy>=80%"], ["a"])[0].value == 0.8


def test_the_cli_exit_status_follows_the_verdict_and_a_criteria_file(gtafl_pkg, tmp_path):
    img, labels = labelled(tmp_path / "d", n=120)
    ok = subprocess.run([*TAFL, "validate", str(gtafl_pkg), str(img), "--labels", str(labels), "--out",
                         str(tmp_path / "ok"), "--require", "accuracy>=0.0"], capture_output=True, text=True,
                        timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("PASS: all 1 acceptance criteria met")
    (tmp_path / "crit.yaml").write_text("require:\n  - accuracy >= 0.99\n  - refused <= 0.5\n")
    bad = subprocess.run([*TAFL, "validate", str(gtafl_pkg), str(img), "--labels", str(labels), "--out",
                          str(tmp_path / "bad"), "--criteria", str(tmp_path / "crit.yaml")], capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 1 and bad.stdout.startswith("FAIL: 1 of 2 acceptance criteria not met (accuracy >= 0.99)")
    rep = json.loads((tmp_path / "bad" / "validation.json").read_text())
    assert [c["passed"] for c in rep["criteria"]] == [False, True] and rep["package"]["model_sha256"]
    assert (tmp_path / "bad" / "validation.html").read_text().count("<svg") == 3


def test_a_labels_csv_with_problems_gives_one_line_each_and_no_report(gtafl_pkg, tmp_path):
    img, labels = labelled(tmp_path / "d", n=20, extra_rows=[
        {"path": "missing", "label": "3"}, {"path": "d4", "label": "4"}, {"path": "d5x", "label": ""},
        {"path": "d6", "label": "cat"}])
    (img / "d5x.png").write_bytes(digit_png(5))
    run = subprocess.run([*TAFL, "validate", str(gtafl_pkg), str(img), "--labels", str(labels), "--out",
                          str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and not (tmp_path / "out").exists()
    err = run.stderr
    assert "4 problem(s), no report made" in err
    assert "line 22: missing: no such file" in err and "line 23: d4 is listed again (first on line 6)" in err
    assert "line 24: d5x has no class" in err and "line 25: d6 is listed again" in err
    other = subprocess.run([*TAFL, "validate", str(gtafl_pkg), str(img), "--labels", str(labels), "--label-column",
                            "dx", "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert other.returncode == 2 and "no column 'dx'" in other.stderr


def test_the_report_renders_in_chromium_and_prints_with_its_charts(report, tmp_path):
    pytest.importorskip("selenium")
    import base64
    import shutil

    from selenium import webdriver
    from selenium.webdriver.common.by import By

    from tafl.clients.validate_report import write

    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        pytest.skip("needs Debian's chromium and chromedriver")
    html_path, _ = write(report, tmp_path / "rep")
    opts = webdriver.ChromeOptions()
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,1800"):
        opts.add_argument(a)
    opts.binary_location = shutil.which("chromium")
    drv = webdriver.Chrome(options=opts, service=webdriver.ChromeService(shutil.which("chromedriver")))
    try:
        drv.get(html_path.as_uri())
        verdict = drv.find_element(By.ID, "verdict")
        assert verdict.is_displayed() and verdict.text == report["verdict"]
        assert "fail" in verdict.get_attribute("class") or "pass" in verdict.get_attribute("class")
        charts = drv.find_elements(By.CSS_SELECTOR, "svg.chart")
        assert len(charts) == 3 and all(c.size["width"] > 200 and c.size["height"] > 200 for c in charts)
        assert len(drv.find_elements(By.CSS_SELECTOR, "svg.roc polyline.curve")) == 10
        png = tmp_path / "shot.png"
        drv.save_screenshot(str(png))
        from PIL import Image

        shot = np.asarray(Image.open(png).convert("RGB"), np.int64)
        box = verdict.rect  # the verdict's box is tinted red or green, not white
        patch = shot[int(box["y"]) + 3:int(box["y"] + box["height"]) - 3, int(box["x"]) + 3:int(box["x"]) + 40]
        assert patch.size and (patch.mean(axis=(0, 1)) < 250).any()
        # printing: the charts keep their size under print media and the PDF holds every page
        drv.execute_cdp_cmd("Emulation.setEmulatedMedia", {"media": "print"})
        assert all(c.size["width"] > 200 for c in drv.find_elements(By.CSS_SELECTOR, "svg.chart"))
        pdf = base64.b64decode(drv.execute_cdp_cmd("Page.printToPDF", {"printBackground": True})["data"])
        assert pdf.startswith(b"%PDF") and pdf.count(b"/Type /Page") >= 2
    finally:
        drv.quit()
    if not shutil.which("pdftoppm"):
        pytest.skip("needs poppler's pdftoppm (Debian: poppler-utils) to read the PDF back")
    (tmp_path / "r.pdf").write_bytes(pdf)
    subprocess.run(["pdftoppm", "-r", "72", "-png", str(tmp_path / "r.pdf"), str(tmp_path / "page")], check=True)
    pages = [np.asarray(Image.open(p).convert("RGB"), np.int64) for p in sorted(tmp_path.glob("page*.png"))]
    ink = np.concatenate([p.reshape(-1, 3) for p in pages])

    def near(rgb, tol) -> int:  # pixels of one chart's own colour, anywhere in the printed pages
        return int((np.abs(ink - np.asarray(rgb)).sum(axis=1) < tol).sum())

    assert near((87, 153, 199), 25) > 50  # the reliability diagram's bars (#1f77b4 at opacity .75)
    assert near((44, 160, 44), 30) > 10  # the ROC curve of the third class (green, nowhere else on the page)
    r, g, b = ink.T  # the confusion matrix's filled cells: rgb(s, s, 255), s < 200
    assert int(((b > 245) & (r < 200) & (np.abs(r - g) < 8)).sum()) > 50


def test_headline_numbers_carry_their_interval_in_the_card_and_models(gtafl_pkg, auth_server):
    """Issue 55, item 3: the card, /models and the page state the headline number with its 95% Wilson interval
    from the test split's size, equal to statsmodels' interval."""
    pytest.importorskip("statsmodels")
    import httpx
    from statsmodels.stats.proportion import proportion_confint

    from tafl.intervals import wilson, with_interval
    from tafl.packaging import load_package
    from tests.conftest import TOKEN

    for k, n in ((0, 10), (3, 10), (10, 10), (57, 140), (1999, 2003)):
        np.testing.assert_allclose(wilson(k, n)[1:], proportion_confint(k, n, alpha=0.05, method="wilson"),
                                   atol=1e-12)
    pkg = load_package(gtafl_pkg)
    met = pkg.meta.metrics
    n = met.test_images
    assert n and n == sum(met.test_class_counts)
    shown = with_interval(met.average_accuracy, n, 1)
    assert f"Mean over the eleven test distributions: **{shown}** (95% Wilson interval for {n} test images)" \
        in pkg.card
    models = httpx.get(f"{auth_server.url}/models", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).json()
    head = next(m for m in models["models"] if m["name"] == pkg.name)["headline"]
    assert head["text"] == shown and head["test_images"] == n
    np.testing.assert_allclose(head["interval"], proportion_confint(met.average_accuracy * n, n, method="wilson"),
                               atol=1e-12)
    page = httpx.get(f"{auth_server.url}/ui/panel", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).text
    assert f"Mean over the eleven: <strong>{shown}</strong>" in page


def test_validation_on_a_pacs_over_dicomweb_equals_the_same_files_in_a_folder(gtafl_pkg, tmp_path):
    """`tafl validate --dicomweb URL --study UID` (a real Orthanc): the study's instances, fetched by WADO-RS and
    named by SOP Instance UID in the labels, give the report the same files give from a folder."""
    import io

    import pydicom

    from tests.orthanc import Orthanc

    if not Orthanc.available():
        pytest.skip("Orthanc (Debian: orthanc, orthanc-dicomweb) is not installed")
    from dicomweb_client.api import DICOMwebClient
    from sklearn.datasets import load_digits

    from tests.packaging.test_domain import dicom

    d, study = load_digits(), pydicom.uid.generate_uid()
    folder, rows, datasets = tmp_path / "dcm", [], []
    folder.mkdir()
    for i in range(40):
        ds = pydicom.dcmread(io.BytesIO(dicom("OT", seed=i)))
        ds.StudyInstanceUID = study
        ds.PixelData = np.uint8(d.images[i] * 15).repeat(4, 0).repeat(4, 1).tobytes()
        datasets.append(ds)
        ds.save_as(folder / f"{ds.SOPInstanceUID}.dcm", enforce_file_format=True)
        rows.append({"path": str(ds.SOPInstanceUID), "label": str(d.target[i])})
    with open(tmp_path / "labels.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, ["path", "label"])
        w.writeheader()
        w.writerows(rows)
    pacs = Orthanc(tmp_path / "orthanc").start()
    try:
        DICOMwebClient(pacs.dicomweb).store_instances(datasets)
        args = [str(gtafl_pkg), "--labels", str(tmp_path / "labels.csv"), "--require", "accuracy>=0.0"]
        remote = subprocess.run([*TAFL, "validate", *args, "--dicomweb", pacs.dicomweb, "--study", study, "--out",
                                 str(tmp_path / "remote")], capture_output=True, text=True, timeout=300)
        assert remote.returncode == 0, remote.stderr
    finally:
        pacs.stop()
    local = subprocess.run([*TAFL, "validate", *args[:1], str(folder), *args[1:], "--out", str(tmp_path / "local")],
                           capture_output=True, text=True, timeout=300)
    assert local.returncode == 0, local.stderr
    a, b = (json.loads((tmp_path / k / "validation.json").read_text()) for k in ("remote", "local"))
    assert a["data"]["images"] == b["data"]["images"] == 40 and study in a["data"]["root"]
    for key in ("per_class", "rules", "confusion", "calibration", "roc", "refused"):
        assert a[key] == b[key], key
    neither = subprocess.run([*TAFL, "validate", str(gtafl_pkg), "--labels", str(tmp_path / "labels.csv"), "--out",
                              str(tmp_path / "x")], capture_output=True, text=True, timeout=120)
    assert neither.returncode == 2 and "DATA" in neither.stderr and "--dicomweb" in neither.stderr


def test_a_file_over_the_upload_limit_is_not_read_and_is_named_in_the_report(gtafl_pkg, tmp_path, monkeypatch):
    from tafl.clients.validate import validate

    img, labels = labelled(tmp_path / "d", n=30)
    with open(img / "d7.png", "ab") as fh:  # 2 MiB more: over a 1 MiB limit, never decoded
        fh.write(b"\0" * (2 << 20))
    monkeypatch.setenv("TAFL_MAX_UPLOAD_MB", "1")
    rep = validate(gtafl_pkg, img, labels)
    assert rep["data"]["images"] == 30 and rep["data"]["scored"] == 29
    assert rep["not_scored"] == [{"id": "d7", "why": "2 MiB: over the 1 MiB upload limit (TAFL_MAX_UPLOAD_MB)"}]
