"""The page for people (GET /, /ui/...; tafl/serving/ui.py) against a real `bentoml serve`.

HTTP-level tests check what the page holds, the auth rule (with TAFL_API_TOKEN nothing about the models before
the token) and that a package's text is escaped. Browser tests drive Debian's headless Chromium with Selenium
and the system chromedriver: load the page, upload a PNG, a DICOM and a file that is no image through the
page's form (which posts to /predict), and read what it rendered. Each browser test leaves a screenshot in
$TAFL_TEST_ARTIFACTS (default build/test-artifacts/). They skip where no browser or Selenium is installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import httpx
import pytest

from tafl.packaging import load_package
from tests.conftest import REPO, TOKEN, digit_png

pytestmark = pytest.mark.slow

HOSTILE_CLASS = '<img src=x onerror="window.__pwned=1">'
HOSTILE_CARD = """# ui-hostile 1.0.0

<script>window.__pwned = 2</script>

<img src=x onerror="window.__pwned=3">

[click me](javascript:window.__pwned=4) and [fine](https://example.org/card)

| a | b |
|---|---|
| <b>bold?</b> | 1 |
"""


def get(srv, path: str, **headers) -> httpx.Response:
    return httpx.get(f"{srv.url}{path}", headers=headers, timeout=30)


def predict(srv, data: bytes, ctype: str = "image/png", token: str | None = None, **fields) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(f"{srv.url}/predict", files={"file": ("x", data, ctype)}, headers=headers,
                      data={k: str(v) for k, v in fields.items()}, timeout=60)


def predicted_total(html: str, name: str) -> int:
    """The 'N image(s) predicted' line of one model's section."""
    section = html.split(f'<span class="model-name">{name}</span>', 1)[1]
    return int(re.search(r"(\d+) image\(s\) predicted by this version", section).group(1))


# ---------------------------------------------------------------- HTTP level
def test_open_page_shows_each_model_its_validation_and_live_mix(server, gtafl_pkg, dafl_pkg):
    r = get(server, "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in r.headers["content-security-policy"] and r.headers["cache-control"] == "no-store"
    html = r.text
    for path in (gtafl_pkg, dafl_pkg):
        pkg = load_package(path)
        assert f'<span class="model-name">{pkg.name}</span> <span class="version">{pkg.version}</span>' in html
        assert pkg.files["model.onnx"] in html  # the checksum SHA256SUMS gave and load_package verified
        forward50 = f"{100 * pkg.metadata['metrics']['accuracy']['forward50']:.1f}%"
        assert f"forward50 {forward50}" in html  # the chart's text alternative carries the numbers
    assert html.count('role="img"') == 4  # accuracy and class-mix chart per model, each with a title and desc
    assert len(re.findall(r'<svg [^>]*aria-labelledby="[^"]+-t [^"]+-d"', html)) == 4
    assert "unsigned; signatures are not required here" in html
    assert "first version (no parent package)" in html and "<h1>derm-gtafl 1.0.0</h1>" in html  # the card
    assert "/tmp" not in html and str(gtafl_pkg) not in html  # no host path of the package folder
    assert 'label for="try-file"' in html and 'id="try-file"' in html

    before = predicted_total(html, "derm-gtafl")
    for i in range(3):
        assert predict(server, digit_png(i), model="derm-gtafl").status_code == 200
    # the live mix is the /metrics counter's: both move by the same three predictions
    after = get(server, "/").text
    assert predicted_total(after, "derm-gtafl") == before + 3
    metrics = get(server, "/metrics").text
    counted = sum(float(v) for v in re.findall(
        r'^tafl_predicted_class_total\{[^}]*model="derm-gtafl"[^}]*version="1\.0\.0"[^}]*\} (\S+)$', metrics, re.M))
    assert counted == before + 3
    assert get(server, "/ui/panel").status_code == 200  # open service: the fragment needs no token


def test_page_assets_and_unknown_paths(server):
    js = get(server, "/ui/static/ui.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert "sessionStorage" in js.text and "Authorization" in js.text
    missing = get(server, "/ui/static/app.py")
    assert missing.status_code == 404 and "no such page asset" in missing.json()["error"]["message"]
    assert get(server, "/ui/static/..%2f..%2fapp.py").status_code == 404
    assert httpx.post(f"{server.url}/", timeout=10).status_code == 405


def test_token_mode_shows_nothing_before_the_token(auth_server, gtafl_pkg):
    pkg = load_package(gtafl_pkg)
    shell = get(auth_server, "/")
    assert shell.status_code == 200 and 'id="token-form"' in shell.text and 'label for="token-input"' in shell.text
    for secret in (pkg.name, pkg.files["model.onnx"], "sha256", "training mix", "forward50", "try-form", "<svg"):
        assert secret not in shell.text
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        denied = get(auth_server, "/ui/panel", **headers)
        assert denied.status_code == 401, headers
        assert "Authorization: Bearer" in denied.json()["error"]["message"] and pkg.name not in denied.text
    ok = get(auth_server, "/ui/panel", Authorization=f"Bearer {TOKEN}")
    assert ok.status_code == 200 and pkg.name in ok.text and pkg.files["model.onnx"] in ok.text
    assert "<html" not in ok.text  # a fragment for the page's script, not a page
    assert get(auth_server, "/ui/static/ui.css").status_code == 200  # assets hold no model data


@pytest.fixture(scope="session")
def hostile_pkg(gtafl_pkg, tmp_path_factory) -> Path:
    """The GTAFL package renamed, with HTML and script in its class names, metrics source and card
    (checksums rewritten: a package its exporter made hostile still loads)."""
    from tafl.packaging.package import SUMS, write_checksums

    out = tmp_path_factory.mktemp("pkg_hostile") / "hostile"
    shutil.copytree(gtafl_pkg, out)
    meta = json.loads((out / "metadata.json").read_text())
    meta["name"] = "ui-hostile"
    meta["class_names"][0] = HOSTILE_CLASS
    meta["metrics"]["source"] = "<script>window.__pwned=5</script>"
    (out / "metadata.json").write_text(json.dumps(meta))
    (out / "README.md").write_text(HOSTILE_CARD)
    names = [line.split(maxsplit=1)[1] for line in (out / SUMS).read_text().splitlines() if line.strip()]
    write_checksums(out, names)
    return out


@pytest.fixture(scope="session")
def hostile_server(hostile_pkg, tmp_path_factory):
    from tafl.serving.launch import ServerProcess

    home = tmp_path_factory.mktemp("bentoml_home_ui")
    with ServerProcess([str(hostile_pkg)], env={"BENTOML_HOME": str(home)},
                       log_path=tmp_path_factory.mktemp("svc_ui") / "service.log") as srv:
        yield srv


def test_package_text_is_escaped(hostile_server):
    html = get(hostile_server, "/").text
    assert "ui-hostile" in html
    assert "<script>window" not in html and "&lt;script&gt;window.__pwned" in html  # card, metrics source
    assert '<img src=x' not in html and "&lt;img src=x onerror=" in html  # class name (table, chart), card
    assert not re.search(r"href=[\"']?\s*javascript:", html, re.I)  # the card's link is left as text, not linked
    assert '<a href="https://example.org/card">fine</a>' in html  # ordinary Markdown still renders
    assert "<b>bold?</b>" not in html
    assert len(re.findall(r"<script\b", html)) == 1  # the page's own script only


def test_case_mix_estimate_and_its_drift_are_those_of_models(hostile_server):
    """Past the minimum number of served images the page shows the EM estimate and its distance from the
    training mix, the same numbers /models reports."""
    import time

    html = get(hostile_server, "/").text
    assert "No case-mix estimate in use yet" in html and "drift distance" not in html
    files = [("file", (f"{i}.png", digit_png(i % 10 + 10 * (i % 3 == 0)), "image/png")) for i in range(128)]
    for chunk in (files[:64], files[64:]):
        r = httpx.post(f"{hostile_server.url}/predict/batch", files=chunk, timeout=120)
        assert r.status_code == 200, r.text
    deadline = time.monotonic() + 30
    while True:  # the estimate is refreshed in its own thread every 50 images
        est = get(hostile_server, "/models").json()["models"][0]["case_mix"]["estimate"]
        if est and est["images"] >= 100 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert est and est["images"] >= 100
    html = get(hostile_server, "/").text
    shown = re.search(r'drift distance from the training mix\s+\(total variation\) <strong class="drift">([\d.]+)%',
                      html)
    assert shown and shown.group(1) == f"{100 * est['shift_from_source']:.1f}"
    assert f"last {est['images']} served image(s)" in html
    assert "128 image(s) predicted by this version" in html
    for p in est["prior"]:  # each class's estimated share is in the per-class table
        assert f"<td>{100 * p:.1f}%</td>" in html


# ---------------------------------------------------------------- a real browser
ARTIFACTS = Path(os.environ.get("TAFL_TEST_ARTIFACTS") or REPO / "build" / "test-artifacts")


def _browser_paths() -> tuple[str, str] | None:
    chrome = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser"),
                               shutil.which("google-chrome")) if p), None)
    driver = shutil.which("chromedriver") or next((p for p in ("/usr/lib/chromium/chromedriver",)
                                                   if os.path.exists(p)), None)
    return (chrome, driver) if chrome and driver else None


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the dev extra)")
    from selenium.webdriver.chrome.service import Service

    paths = _browser_paths()
    if paths is None:
        pytest.skip("no Chromium and chromedriver on this machine (Debian: apt-get install chromium chromium-driver)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = paths[0]
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,1800", "--disable-extensions", "--no-first-run"):
        opts.add_argument(arg)
    drv = webdriver.Chrome(service=Service(paths[1]), options=opts)
    drv.set_page_load_timeout(30)
    yield drv
    drv.quit()


@pytest.fixture
def page(browser, request):
    """The browser, with a screenshot of what it shows saved when the test ends (passed or failed)."""
    yield browser
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)
    browser.execute_script("window.scrollTo(0, 0)")
    body = browser.execute_script("return document.body ? document.body.scrollHeight : 1800")
    browser.set_window_size(1280, min(max(int(body) + 40, 800), 6000))
    browser.save_screenshot(str(ARTIFACTS / f"ui_{name}.png"))


def _snap(drv, name: str) -> None:
    """A screenshot in the middle of a test (the `page` fixture takes the last one)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    drv.save_screenshot(str(ARTIFACTS / f"ui_{name}.png"))


def _wait(drv, fn, timeout: float = 30.0):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(drv, timeout).until(lambda d: fn(d))


def _upload(drv, path: Path, model: str | None = None) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    drv.execute_script("document.getElementById('try-result').hidden = true;"
                       "document.getElementById('try-error').hidden = true;")
    if model:
        Select(drv.find_element(By.ID, "try-model")).select_by_value(model)
    drv.find_element(By.ID, "try-file").send_keys(str(path))
    drv.find_element(By.ID, "try-submit").click()
    _wait(drv, lambda d: d.find_element(By.ID, "try-result").is_displayed()
          or d.find_element(By.ID, "try-error").is_displayed())


def _rendered(drv) -> dict:
    return drv.execute_script("""
        const img = document.getElementById('res-heatmap');
        const rows = id => [...document.querySelectorAll('#' + id + ' tbody tr')].map(
            tr => [...tr.cells].map(c => c.textContent.trim()));
        return {label: document.getElementById('res-label').textContent,
                error: document.getElementById('try-error').hidden ? null
                       : document.getElementById('try-error').textContent,
                experts: rows('res-experts'), probs: rows('res-probs'),
                heatmap: img.complete ? img.naturalWidth : 0, alt: img.alt,
                input: document.getElementById('res-input').textContent,
                text: document.body.innerText};""")


def _check_result(got: dict, want: dict) -> None:
    assert got["error"] is None, got["error"]
    assert got["label"] == f"{want['class_name']} (class {want['label']})"
    assert [e[0] for e in got["experts"]] == [e["name"] for e in want["experts"]]
    assert [e[1] for e in got["experts"]] == [f"{e['class_name']} (class {e['label']})" for e in want["experts"]]
    assert len(got["probs"]) == len(want["probabilities"])
    assert got["heatmap"] > 0 and got["alt"].startswith("Heatmap (")


def test_browser_page_and_png_upload(page, server, gtafl_pkg, tmp_path):
    from selenium.webdriver.common.by import By

    page.get(f"{server.url}/")
    _wait(page, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-panel") == "loaded")
    text = page.find_element(By.TAG_NAME, "body").text
    assert "derm-gtafl 1.0.0" in text and "derm-dafl 1.0.0" in text and "Try an image" in text
    assert page.execute_script("return document.querySelectorAll('svg[role=img] title').length") >= 4
    # every form field has a label the browser associates with it
    assert page.execute_script("return [...document.querySelectorAll('#try-form input:not([type=hidden]), "
                               "#try-form select')].every(e => e.labels.length > 0)")
    png = tmp_path / "digit.png"
    png.write_bytes(digit_png(3))
    want = predict(server, png.read_bytes(), model="derm-gtafl").json()
    _upload(page, png, "derm-gtafl")
    got = _rendered(page)
    _check_result(got, want)
    assert [e[0] for e in got["experts"]] == ["forward", "uniform", "backward"]
    assert got["input"].startswith("png, 64×64")


def test_browser_dicom_upload_renders_no_patient_tags(page, server, tmp_path):
    pydicom = pytest.importorskip("pydicom")
    from selenium.webdriver.common.by import By

    src = pydicom.data.get_testdata_file("CT_small.dcm")
    if not src:
        pytest.skip("pydicom's test data (CT_small.dcm) is not installed")
    ds = pydicom.dcmread(src, stop_before_pixels=True)
    tags = [str(v) for v in (ds.get("PatientName"), ds.get("PatientID"), ds.get("InstitutionName")) if v]
    assert tags
    path = tmp_path / f"{tags[0].replace('^', '_')}.dcm"  # a file name that would be patient data too
    path.write_bytes(Path(src).read_bytes())
    want = predict(server, path.read_bytes(), "application/dicom", model="derm-dafl").json()
    page.get(f"{server.url}/")
    _wait(page, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-panel") == "loaded")
    _upload(page, path, "derm-dafl")
    got = _rendered(page)
    _check_result(got, want)
    assert got["input"].startswith("dicom, ")
    for value in tags + [path.stem]:
        assert value not in got["text"] and value not in page.page_source


def test_browser_bad_file_shows_the_api_message(page, server, tmp_path):
    from selenium.webdriver.common.by import By

    bad = tmp_path / "notes.png"
    bad.write_bytes(b"this is a text file, not an image\n" * 4)
    want = predict(server, bad.read_bytes())
    assert 400 <= want.status_code < 500
    page.get(f"{server.url}/")
    _wait(page, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-panel") == "loaded")
    _upload(page, bad)
    got = _rendered(page)
    assert got["error"] == want.json()["error"]["message"]
    assert "Traceback" not in got["text"] and not page.find_element(By.ID, "try-result").is_displayed()


def test_browser_token_mode(page, auth_server, gtafl_pkg, tmp_path):
    from selenium.webdriver.common.by import By

    name = load_package(gtafl_pkg).name
    page.get(f"{auth_server.url}/")
    _wait(page, lambda d: d.find_element(By.ID, "token-form").is_displayed())
    assert name not in page.page_source and page.find_element(By.ID, "panel").text == ""

    page.find_element(By.ID, "token-input").send_keys("not-the-token")
    page.find_element(By.CSS_SELECTOR, "#token-form button").click()
    _wait(page, lambda d: d.find_element(By.ID, "token-error").is_displayed())
    _snap(page, "test_browser_token_mode_wrong_token")
    assert "Authorization: Bearer" in page.find_element(By.ID, "token-error").text
    assert name not in page.page_source
    assert page.execute_script("return sessionStorage.getItem('tafl.api-token')") is None

    page.find_element(By.ID, "token-input").send_keys(TOKEN)
    page.find_element(By.CSS_SELECTOR, "#token-form button").click()
    _wait(page, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-panel") == "loaded")
    assert f"{name} 1.0.0" in page.find_element(By.ID, "panel").text
    assert not page.find_element(By.ID, "token-section").is_displayed()
    png = tmp_path / "digit.png"
    png.write_bytes(digit_png(7))
    want = predict(auth_server, png.read_bytes(), token=TOKEN).json()
    _upload(page, png)  # the form's /predict call carries the bearer header
    _check_result(_rendered(page), want)
    _snap(page, "test_browser_token_mode_after_the_token")

    page.refresh()  # the token is kept for the tab's session
    _wait(page, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-panel") == "loaded")
    assert name in page.find_element(By.ID, "panel").text
    page.find_element(By.ID, "forget-token").click()
    assert name not in page.find_element(By.ID, "panel").text
    assert page.execute_script("return sessionStorage.getItem('tafl.api-token')") is None


def test_browser_hostile_package_runs_no_script(page, hostile_server):
    from selenium.webdriver.common.by import By

    page.get(f"{hostile_server.url}/")
    _wait(page, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-panel") == "loaded")
    assert HOSTILE_CLASS in page.find_element(By.TAG_NAME, "body").text  # shown as text
    assert page.execute_script("return window.__pwned === undefined")
