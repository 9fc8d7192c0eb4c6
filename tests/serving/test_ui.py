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
    # accuracy and class-mix chart per model and the heatmap's colour legend, each with a title and desc
    assert html.count('role="img"') == 5
    assert len(re.findall(r'<svg [^>]*aria-labelledby="[^"]+-t [^"]+-d"', html)) == 5
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


def _section(html: str, name: str) -> str:
    """One model's section of the page, from its heading to the next model's."""
    return html.split(f'<span class="model-name">{name}</span>', 1)[1].split('<section class="model"', 1)[0]


def test_training_mix_is_the_training_images_shares_as_tafl_score_gives_them(server, gtafl_pkg, dafl_pkg, tmp_path):
    """The training mix column is each class's share of the training images the table counts (it once showed
    the source prior, 10 % a class for a GTAFL ensemble), the training share `tafl score` prints."""
    from tafl.clients.score import score_folder

    html = get(server, "/").text
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(digit_png(1))
    for path in (gtafl_pkg, dafl_pkg):
        pkg = load_package(path)
        section = _section(html, pkg.name)
        counts = [int(v) for v in re.findall(r'<td class="train-images">(\d+)</td>', section)]
        shares = [float(v) / 100 for v in re.findall(r'<td class="train-share">([\d.]+)%</td>', section)]
        assert counts == pkg.metadata["training"]["train_class_counts"] and len(counts) == len(pkg.class_names)
        assert shares == pytest.approx([c / sum(counts) for c in counts], abs=5e-4)
        summary = score_folder(tmp_path / "imgs", tmp_path / f"{pkg.name}.csv", package=str(path), progress=False)
        assert shares == pytest.approx([m["training_share"] for m in summary["class_mix"]], abs=5e-4)
        # the chart's training series carries the same shares (its bars' titles)
        for c, n in zip(pkg.class_names, counts):
            assert f"{c}, training mix: {100 * n / sum(counts):.1f}%" in section
    gtafl = load_package(gtafl_pkg).metadata
    assert len(set(gtafl["prior"]["source_prior"])) == 1  # an ensemble's source prior is uniform: not the mix
    assert 'class="assumed"' in _section(html, "derm-gtafl")  # ... and is shown apart, as what it is


def test_plain_summary_opens_each_model_and_the_card(server, gtafl_pkg, dafl_pkg):
    """Each model's section starts with the summary for a clinician, in plain words and from the metadata;
    the package's model card starts with the same summary (one implementation)."""
    from html import unescape

    from tafl.intervals import with_interval
    from tafl.packaging.summary import MISSED, WELL, summary_markdown

    html = get(server, "/").text
    for path in (gtafl_pkg, dafl_pkg):
        pkg = load_package(path)
        meta, section = pkg.metadata, _section(html, pkg.name)
        start = section.index("</h2>") + len("</h2>")
        assert section[start:].lstrip().startswith('<div class="summary"')  # nothing between heading and summary
        summary = section[start:section.index("<h3>Details</h3>")]
        text = unescape(re.sub(r"<[^>]+>", " ", summary))
        text = re.sub(r"\s+", " ", text)
        acc, counts = meta["metrics"]["accuracy"], meta["metrics"]["test_class_counts"]
        n = sum(counts)  # every number with its 95% interval from the test split's size
        assert f"{with_interval(acc['forward50'], n)} labelled correctly when the case mix is like training" in text
        assert f"{with_interval(acc['backward50'], n)} labelled correctly when rare findings become common" in text
        assert re.search(r"\d+% \(\d+–\d+%\) labelled correctly", text)
        assert f"one of {len(pkg.class_names)} classes: " + ", ".join(pkg.class_names) in text
        groups = dict(re.findall(r'<span class="summary-heading">([^<]+):</span>(.*?)</p>', summary, re.S))
        for c, a, k in zip(pkg.class_names, meta["metrics"]["per_class_accuracy"], counts):
            if a is None:
                continue
            want = "Recognises well" if a >= WELL else "Often misses" if a < MISSED else "Sometimes misses"
            shown = with_interval(a, k, inside=True)
            [where] = [h for h, items in groups.items() if f'"summary-class">{c} ({shown})<' in items]
            assert where.startswith(want), (c, a, where)
        assert "A diagnosis on its own" in text and f"Findings outside its {len(pkg.class_names)} classes" in text
        # what it is, before any number: a person who reads one line learns it is no medical device
        status = text.index("For research and evaluation only: not a certified medical device")
        assert text.index("classes: ") < status < text.index("How often it is right")
        n_train, pre = meta["data_provenance"]["n_train"], meta["input"]["preprocess"]
        kind = {1: "greyscale", 3: "colour"}[pre["channels"]]
        dataset = meta["training"]["run_config"]["dataset"]
        assert (f"from {n_train} {kind} images of the {dataset} collection, shrunk to {pre['size']}×{pre['size']} "
                "pixels") in text
        for word in ("forward", "backward", "Dirichlet", "total variation", "TV", "prior", "ensemble"):
            assert word not in text, word
        card = pkg.card
        assert card.startswith(f"# {pkg.name} {pkg.version}\n\n" + "\n".join(summary_markdown(pkg.meta)) + "\n")
    assert "<h2>In short</h2>" in html  # the card, rendered below, opens with it too


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
    # as if trained with --client-column: two sites, one named with markup
    meta["metrics"]["sites"] = {
        "vienna": {"n_test": 88, "own": {"accuracy": 0.71, "balanced_accuracy": 0.42},
                   "site": {"accuracy": 0.765, "balanced_accuracy": 0.45},
                   "adapted": {"accuracy": 0.74, "balanced_accuracy": 0.44},
                   "oracle": {"accuracy": 0.78, "balanced_accuracy": 0.47}},
        HOSTILE_CLASS: {"n_test": 12, "own": {"accuracy": 0.5, "balanced_accuracy": None}}}
    meta["metrics"]["site_mean"] = {"own": {"accuracy": 0.605, "balanced_accuracy": 0.42}}
    meta["metrics"]["pooled_balanced_accuracy"] = 0.433
    # as if trained with --dp-epsilon 3: the privacy object, its unit carrying markup
    meta["privacy"] = {"mechanism": "DP-SGD", "unit": HOSTILE_CLASS, "epsilon": 2.9991, "epsilon_target": 3.0,
                       "delta": 1e-5, "accountant": "RDP", "secure_aggregation": False}
    (out / "metadata.json").write_text(json.dumps(meta))
    (out / "README.md").write_text(HOSTILE_CARD)
    names = [line.split(maxsplit=1)[1] for line in (out / SUMS).read_text().splitlines() if line.strip()]
    write_checksums(out, names)
    return out


@pytest.fixture(scope="session")
def hostile_server(hostile_pkg, tmp_path_factory):
    from tafl.serving.launch import ServerProcess

    home = tmp_path_factory.mktemp("bentoml_home_ui")
    # one worker: the tests compare the page with /models and count the images it predicted, and with several
    # workers each request answers for the worker that took it (its own case-mix window and counts)
    with ServerProcess([str(hostile_pkg)], env={"BENTOML_HOME": str(home), "TAFL_WORKERS": "1"},
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


def test_the_page_states_each_model_s_privacy_guarantee(server, hostile_server):
    """A model trained with DP shows its (ε, δ) and unit (escaped); one trained without says so."""
    html = get(hostile_server, "/").text
    line = html.split("<dd data-privacy>", 1)[1].split("</dd>", 1)[0]
    assert "ε = 3, δ = 1e-05 per &lt;img src=x" in line and "RDP" in line
    plain = _section(get(server, "/").text, "derm-gtafl").split("<dd data-privacy>", 1)[1].split("</dd>", 1)[0]
    assert plain.startswith("no differential privacy")


def test_a_model_trained_on_sites_shows_each_site_on_its_own_patients(hostile_server):
    """Per site (--client-column runs): each site's own-mix accuracy, balanced accuracy, at the site's own mix,
    adapted and true-mix figures, the mean over sites and the pooled balanced accuracy; a missing number is a dash,
    not a crash."""
    from html import unescape

    html = get(hostile_server, "/").text
    table = html.split('<table class="data sites">', 1)[1].split("</table>", 1)[0]
    rows = [re.sub(r"\s+", " ", unescape(re.sub(r"<[^>]+>", " ", r))).strip() for r in table.split("<tr>")[2:]]
    assert rows[0] == "vienna 88 71.0% 42.0% 76.5% 74.0% 78.0%"  # own, balanced, site's own mix, adapted, true mix
    assert rows[1] == f"{HOSTILE_CLASS} 12 50.0% — — — —"  # escaped in the HTML, shown as text
    assert rows[2] == "mean over sites 60.5% 42.0% — — —"
    assert rows[3] == "all sites pooled 100 — 43.3% — — —"
    assert "Each site on its own patients" in html


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
    # the distance is measured from the mix the probabilities assume (the source prior; uniform for this GTAFL
    # copy), not from the training mix: the page names it and shows it in its own column
    shown = re.search(r"drift distance from the mix the\s+model's probabilities assume \(its source prior, in the "
                      r'table\)\s+\(total variation[^)]*\) <strong class="drift">([\d.]+)%', html)
    assert shown and shown.group(1) == f"{100 * est['shift_from_source']:.1f}"
    source = load_package(hostile_server.packages[0]).metadata["prior"]["source_prior"]
    assumed = [float(v) / 100 for v in re.findall(r'<td class="assumed">([\d.]+)%</td>', html)]
    assert assumed == pytest.approx(source, abs=5e-4)
    tv = 0.5 * sum(abs(a - b) for a, b in zip(est["prior"], source))
    assert float(shown.group(1)) == pytest.approx(100 * tv, abs=0.051)
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
    ps = want["prediction_set"]  # the set, in words, beside the label
    shown = page.find_element(By.ID, "res-set")
    assert shown.is_displayed() and f"({round(100 * ps['coverage'])}% set)" in shown.text
    assert shown.text.split(": ", 1)[1].split(".")[0] == (", ".join(ps["classes"]) or "none at this level")
    # the heatmap's colour legend is shown with it, drawn from the colour map the overlay uses
    import numpy as np

    from tafl.imaging.heatmap import jet

    legend = page.find_element(By.ID, "heatmap-legend")
    assert legend.is_displayed() and legend.size["width"] > 100
    assert "low attention" in legend.text and "high attention" in legend.text
    stops = page.execute_script("return [...document.querySelectorAll('#heatmap-legend stop')].map("
                                "s => [parseFloat(s.getAttribute('offset')), s.getAttribute('stop-color')])")
    assert [o for o, _ in stops] == pytest.approx(np.linspace(0, 1, len(stops)), abs=0.006) and len(stops) >= 5
    want_colours = ["#%02x%02x%02x" % tuple(c) for c in jet(np.array([[o for o, _ in stops]]))[0].tolist()]
    assert [c for _, c in stops] == want_colours
    assert want_colours[0] == "#00007f" and want_colours[-1] == "#7f0000"  # dark blue: low; dark red: high


_BOXES = """
    const box = e => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
    return [...document.querySelectorAll(arguments[0])].map(svg => ({
        mean: [...svg.querySelectorAll('text.mean-label')].map(box),
        bars: [...svg.querySelectorAll('rect')].map(box),
        values: [...svg.querySelectorAll('rect + text')].map(box)}));"""


def _overlap(a, b) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _check_mean_label(charts: list[dict]) -> None:
    assert charts
    for c in charts:
        [mean] = c["mean"]
        assert len(c["bars"]) == 11 and len(c["values"]) == 11
        for b in c["bars"] + c["values"]:
            assert not _overlap(mean, b), (mean, b)
        assert mean[0] >= max(b[2] for b in c["bars"])  # in its own margin, right of every bar


def test_browser_layout_at_1280(page, server, gtafl_pkg):
    """At a 1280 px window: the summary opens each model's section, nothing is wider than the window, the model
    card's tables fit their box, and the accuracy chart's mean label clears the bars, on the page and for bars
    as tall as the mean itself (where the label once sat on them)."""
    from selenium.webdriver.common.by import By

    from tafl.serving.ui import accuracy_chart

    page.set_window_size(1280, 1800)
    page.get(f"{server.url}/")
    _wait(page, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-panel") == "loaded")
    page.execute_script("document.querySelectorAll('details').forEach(d => d.open = true)")  # every table laid out
    assert page.execute_script("return window.innerWidth") == 1280
    assert page.execute_script("return document.documentElement.scrollWidth <= document.documentElement.clientWidth")
    sections = page.find_elements(By.CSS_SELECTOR, "section.model")
    assert len(sections) == 2
    for sec in sections:
        first = page.execute_script("return [...arguments[0].children].slice(0, 2).map(e => e.tagName + '.' + "
                                    "e.className)", sec)
        assert first == ["H2.", "DIV.summary"]
        summary = sec.find_element(By.CSS_SELECTOR, ".summary")
        assert summary.is_displayed() and "How often it is right" in summary.text
        assert summary.location["y"] < sec.find_element(By.CSS_SELECTOR, "dl.facts").location["y"]
    tables = page.execute_script("""return [...document.querySelectorAll('.card-body table')].map(t => {
        const r = t.getBoundingClientRect(), c = t.closest('.card-body').getBoundingClientRect();
        return {right: r.right, left: r.left, box_right: c.right, box_left: c.left, scroll: t.scrollWidth,
                client: t.clientWidth, head: t.rows[0].textContent};})""")
    assert len(tables) >= 4
    for t in tables:
        assert t["box_left"] <= t["left"] and t["right"] <= t["box_right"] + 0.5, t
    metrics = next(t for t in tables if "forward50" in t["head"] and "backward50" in t["head"])
    assert metrics["scroll"] <= metrics["client"]  # the eleven columns fit unscrolled at this width
    for wrap in page.execute_script("return [...document.querySelectorAll('.table-wrap')].map(w => "
                                    "[w.getBoundingClientRect().right, w.parentElement.getBoundingClientRect().right])"):
        assert wrap[0] <= wrap[1] + 0.5
    # the page's own eleven-column accuracy table fits too, unscrolled
    for fits in page.execute_script("return [...document.querySelectorAll('table.accuracy')].map(t => "
                                    "t.closest('.table-wrap').scrollWidth <= t.closest('.table-wrap').clientWidth)"):
        assert fits
    _check_mean_label(page.execute_script(_BOXES, "svg.chart[aria-label^='Accuracy of']"))

    # bars as tall as their mean, the case that put the old label on the last bars, drawn in the same page
    tall = {k: 0.9 for k in ("forward50", "forward25", "forward10", "forward5", "forward2", "uniform", "backward2",
                             "backward5", "backward10", "backward25", "backward50")}
    svg = str(accuracy_chart(tall, 0.9, "t-acc", "a test model"))
    page.execute_script("const d = document.createElement('div'); d.id = 'tall-chart'; d.innerHTML = arguments[0];"
                        "document.getElementById('main').prepend(d);", svg)
    _check_mean_label(page.execute_script(_BOXES, "#tall-chart svg"))
    page.execute_script("document.getElementById('tall-chart').remove(); window.scrollTo(0, 0)")


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


@pytest.fixture(scope="module")
def detector_ui_server(gtafl_run, tmp_path_factory):
    """The smoke GTAFL model exported with its learned in-domain detector (the shared packages have none), served."""
    pytest.importorskip("torch", reason="export needs the train extra")
    from tafl.packaging.export import export_checkpoint
    from tafl.serving.launch import ServerProcess

    base = tmp_path_factory.mktemp("svc_ui_det")
    export_checkpoint(gtafl_run / "final.pt", base / "pkg", name="derm-det", domain=["colour=any"])
    env = {"BENTOML_HOME": str(base / "home"), "TAFL_WORKERS": "1"}
    with ServerProcess([str(base / "pkg")], env=env, log_path=base / "service.log") as srv:
        yield srv


def test_browser_an_image_outside_the_domain_shows_no_finding_and_why(page, detector_ui_server, tmp_path):
    """A CT slice to a digits model: the page says the model abstained and why, shows no label, probabilities or
    heatmap; a digit shows its label with the in-domain verdict; the model's details state the check."""
    from pydicom.data import get_testdata_file
    from selenium.webdriver.common.by import By

    srv = detector_ui_server
    ct = tmp_path / "ct.dcm"
    ct.write_bytes(Path(get_testdata_file("CT_small.dcm")).read_bytes())
    assert predict(srv, ct.read_bytes(), "application/dicom").json()["abstained"] is True
    page.get(f"{srv.url}/")
    _wait(page, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-panel") == "loaded")
    details = page.find_element(By.CSS_SELECTOR, "dd[data-domain]").text
    assert details.startswith("In-domain score: domain_distance") and "validation images" in details
    _upload(page, ct)
    _snap(page, "outside_domain")
    answer = page.find_element(By.ID, "res-answer").text
    dom = page.find_element(By.ID, "res-domain")
    assert answer == "No finding: the model abstained." and dom.is_displayed()
    assert dom.text.startswith("Outside the model's domain: its features lie beyond") and "outside" in \
        dom.get_attribute("class")
    assert not page.find_element(By.ID, "res-probs").is_displayed()
    assert not page.find_element(By.ID, "res-figure").is_displayed()
    png = tmp_path / "digit.png"
    png.write_bytes(digit_png(3))
    want = predict(srv, png.read_bytes()).json()
    _upload(page, png)
    got = _rendered(page)
    if want["abstained"]:  # the smoke model may abstain on a digit too: then the page says so, as above
        assert page.find_element(By.ID, "res-answer").text == "No finding: the model abstained."
        return
    _check_result(got, want)
    assert page.find_element(By.ID, "res-domain").text.startswith("Within the model's domain: its features lie within")
    live = page.find_element(By.CSS_SELECTOR, "span[data-outside]").text
    assert "lay outside its input domain" in live
