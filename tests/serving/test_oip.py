"""The Open Inference Protocol (KServe v2) routes against a real `bentoml serve`, driven by `tritonclient.http`, the
client Triton and KServe users already run (issue 36): health, metadata, and infer in JSON and with the binary-data
extension giving the same label and probabilities as /predict for the same image (to 1e-6), an explicit prior as
the optional log_prior_ratio input, and the protocol's {"error": ...} answers for bad requests."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

tc = pytest.importorskip("tritonclient.http", reason="needs tritonclient[http]: the dev extra")
from tritonclient.utils import InferenceServerException  # noqa: E402

from tafl.imaging.decode import decode_image  # noqa: E402
from tafl.packaging.package import load_package  # noqa: E402
from tests.conftest import TOKEN, digit_png  # noqa: E402

OUTPUTS = ("label", "probs", "expert_labels", "expert_probs", "votes", "calibrated_probs")


def client(srv) -> tc.InferenceServerClient:
    return tc.InferenceServerClient(srv.url.removeprefix("http://"), network_timeout=60)


def tensor(pkg, pngs: list[bytes]) -> np.ndarray:
    """The package's preprocessed input for these images, decoded as the service decodes an upload."""
    return pkg.preprocess([decode_image(b).frames[0] for b in pngs])


def infer(cli, pkg, x: np.ndarray, binary: bool, names=None, ratio: np.ndarray | None = None, **kw):
    inp = tc.InferInput(pkg.metadata["input"]["name"], list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    inputs = [inp]
    if ratio is not None:
        r = tc.InferInput("log_prior_ratio", list(ratio.shape), "FP32")
        r.set_data_from_numpy(ratio, binary_data=binary)
        inputs.append(r)
    outs = [tc.InferRequestedOutput(n, binary_data=binary) for n in names] if names else None
    return cli.infer(pkg.name, inputs, outputs=outs, **kw)


def test_health_and_metadata(server, gtafl_pkg, dafl_pkg):
    cli = client(server)
    assert cli.is_server_live() and cli.is_server_ready()
    meta = cli.get_server_metadata()
    assert meta["name"] == "tafl" and "binary_tensor_data" in meta["extensions"]
    for path in (gtafl_pkg, dafl_pkg):
        pkg = load_package(path)
        assert cli.is_model_ready(pkg.name) and cli.is_model_ready(pkg.name, pkg.version)
        m = cli.get_model_metadata(pkg.name)
        size, ch = pkg.preprocess.size, pkg.preprocess.channels
        assert m["versions"] == [pkg.version] and m["platform"] == "onnxruntime_onnx"
        assert m["inputs"][0] == {"name": pkg.metadata["input"]["name"], "datatype": "FP32",
                                  "shape": [-1, ch, size, size]}
        assert m["inputs"][1]["name"] == "log_prior_ratio"
        assert [o["name"] for o in m["outputs"]] == [o["name"] for o in pkg.metadata["outputs"]]
        assert {o["name"]: o["datatype"] for o in m["outputs"]}["label"] == "INT64"
        assert m["parameters"]["class_names"] == pkg.class_names
    assert not cli.is_model_ready("no-such-model")
    assert not cli.is_model_ready(load_package(gtafl_pkg).name, "9.9.9")


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("kind", ["gtafl", "dafl"])
def test_infer_equals_predict(server, gtafl_pkg, dafl_pkg, kind, binary):
    pkg = load_package(gtafl_pkg if kind == "gtafl" else dafl_pkg)
    pngs = [digit_png(i) for i in (0, 3, 5, 8)]
    names = [n for n in OUTPUTS if n in {o["name"] for o in pkg.metadata["outputs"]}]
    res = infer(client(server), pkg, tensor(pkg, pngs), binary, names)
    assert res.get_response()["model_name"] == pkg.name and res.get_response()["model_version"] == pkg.version
    for i, png in enumerate(pngs):
        r = httpx.post(f"{server.url}/predict", params={"model": pkg.name, "posteriors": "true"},
                       files={"file": ("x.png", png, "image/png")}, timeout=60)
        assert r.status_code == 200, r.text
        b = r.json()
        assert int(res.as_numpy("label")[i]) == b["label"]
        want = np.array([b["probabilities"][c] for c in pkg.class_names])
        assert np.max(np.abs(res.as_numpy("probs")[i] - want)) <= 1e-6
        cal = np.array([b["calibrated_probabilities"][c] for c in pkg.class_names])
        assert np.max(np.abs(res.as_numpy("calibrated_probs")[i] - cal)) <= 1e-6
        if "expert_labels" in names:
            assert res.as_numpy("expert_labels")[i].tolist() == [e["label"] for e in b["experts"]]
            assert np.allclose(res.as_numpy("votes")[i], [b["votes"][c] for c in pkg.class_names], atol=1e-6)
    assert res.as_numpy("heatmap") is None  # only when asked for


def test_default_outputs_heatmap_on_request_and_versions_path(server, gtafl_pkg):
    pkg = load_package(gtafl_pkg)
    cli = client(server)
    x = tensor(pkg, [digit_png(1), digit_png(2)])
    res = infer(cli, pkg, x, True)  # no outputs named: every output but the heatmap, in binary
    assert [o["name"] for o in res.get_response()["outputs"]] == [n for n in
                                                                  (o["name"] for o in pkg.metadata["outputs"])
                                                                  if n != "heatmap"]
    heat = infer(cli, pkg, x, True, ["heatmap"], model_version=pkg.version).as_numpy("heatmap")
    assert heat.shape == (2, pkg.preprocess.size, pkg.preprocess.size) and 0 <= heat.min() <= heat.max() <= 1


def test_an_explicit_prior_as_log_prior_ratio_equals_predict_s_prior(server, gtafl_pkg):
    from tafl.prior import log_prior_ratio

    pkg = load_package(gtafl_pkg)
    k = len(pkg.class_names)
    q = np.full(k, 0.5 / (k - 1))
    q[0] = 0.5  # an outbreak of class 0
    source = np.asarray(pkg.metadata["prior"]["source_prior"], np.float64)
    ratio = log_prior_ratio(q, source).astype(np.float32)
    pngs = [digit_png(i) for i in (0, 6, 9)]
    x = tensor(pkg, pngs)
    cli = client(server)
    one = infer(cli, pkg, x, True, ["label", "probs", "calibrated_probs"], ratio=ratio)
    rows = infer(cli, pkg, x, False, ["label", "calibrated_probs"], ratio=np.tile(ratio, (3, 1)))
    assert one.as_numpy("label").tolist() == rows.as_numpy("label").tolist()
    for i, png in enumerate(pngs):
        b = httpx.post(f"{server.url}/predict", params={"prior": ",".join(map(str, q)), "posteriors": "true"},
                       files={"file": ("x.png", png, "image/png")}, timeout=60).json()
        assert b["prior"]["used"] == "explicit" and int(one.as_numpy("label")[i]) == b["label"]
        cal = np.array([b["calibrated_probabilities"][c] for c in pkg.class_names])
        assert np.max(np.abs(one.as_numpy("calibrated_probs")[i] - cal)) <= 1e-6


def _raw(server, name, body, headers=None, token=None):
    h = dict(headers or {})
    if token:
        h["Authorization"] = f"Bearer {token}"
    return httpx.post(f"{server.url}/v2/models/{name}/infer", content=body, headers=h, timeout=60)


def test_bad_requests_answer_the_protocol_s_error(server, gtafl_pkg):
    pkg = load_package(gtafl_pkg)
    cli = client(server)
    size, ch = pkg.preprocess.size, pkg.preprocess.channels
    good = np.zeros((1, ch, size, size), np.float32)
    with pytest.raises(InferenceServerException, match="no model named"):
        cli.infer("nope", [_inp(pkg, good)])
    with pytest.raises(InferenceServerException, match="shape"):
        infer(cli, pkg, np.zeros((1, ch, size + 1, size), np.float32), True)
    nan = good.copy()
    nan[0, 0, 0, 0] = np.nan
    with pytest.raises(InferenceServerException, match="NaN"):
        infer(cli, pkg, nan, False)
    with pytest.raises(InferenceServerException, match="unknown output"):
        infer(cli, pkg, good, True, ["logits_of_nothing"])
    with pytest.raises(InferenceServerException, match="version"):
        cli.infer(pkg.name, [_inp(pkg, good)], model_version="9.9.9")
    name = pkg.metadata["input"]["name"]
    cases = [
        (b"not json", {}, 400, "not JSON"),
        (json.dumps({"inputs": []}).encode(), {}, 400, "inputs"),
        (json.dumps({"inputs": [{"name": name, "shape": [1, ch, size, size], "datatype": "BYTES",
                                 "data": ["a"]}]}).encode(), {}, 400, "datatype"),
        (json.dumps({"inputs": [{"name": name, "shape": [1, ch, size, size], "datatype": "FP32",
                                 "data": [0.0] * 3}]}).encode(), {}, 400, "values for shape"),
        (json.dumps({"inputs": [{"name": name, "shape": [0, ch, size, size], "datatype": "FP32",
                                 "data": []}]}).encode(), {}, 400, "no rows"),
        (json.dumps({"inputs": [{"name": name, "shape": [1, ch, size, size], "datatype": "FP32",
                                 "parameters": {"binary_data_size": 999}}]}).encode() + b"\0" * 8,
         {"Inference-Header-Content-Length": None}, 400, "binary_data_size"),
        (json.dumps({"inputs": [{"name": "other", "shape": [1], "datatype": "FP32", "data": [1.0]}]}).encode(),
         {}, 400, "unknown input"),
    ]
    for body, headers, status, text in cases:
        if "Inference-Header-Content-Length" in headers:
            headers = {"Inference-Header-Content-Length": str(body.index(b"\0"))}
        r = _raw(server, pkg.name, body, headers)
        assert r.status_code == status and text in r.json()["error"], (text, r.status_code, r.text)
        assert set(r.json()) == {"error"}
    body = json.dumps({"inputs": [{"name": name, "shape": [300, ch, size, size], "datatype": "FP32",
                                   "parameters": {"binary_data_size": 300 * ch * size * size * 4}}]}).encode()
    r = _raw(server, pkg.name, body + bytes(300 * ch * size * size * 4),
             {"Inference-Header-Content-Length": str(len(body))})
    assert r.status_code == 413 and "rows" in r.json()["error"]  # more rows than a request may hold


def _inp(pkg, x):
    inp = tc.InferInput(pkg.metadata["input"]["name"], list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return inp


def test_the_token_guards_infer_and_metadata_but_not_health(auth_server, gtafl_pkg):
    pkg = load_package(gtafl_pkg)
    cli = client(auth_server)
    assert cli.is_server_live() and cli.is_server_ready()
    x = tensor(pkg, [digit_png(4)])
    with pytest.raises(InferenceServerException, match="Bearer"):
        cli.get_model_metadata(pkg.name)
    with pytest.raises(InferenceServerException, match="Bearer"):
        cli.infer(pkg.name, [_inp(pkg, x)])
    res = cli.infer(pkg.name, [_inp(pkg, x)], headers={"Authorization": f"Bearer {TOKEN}"})
    assert res.as_numpy("label").shape == (1,)


def test_openapi_documents_the_protocol(server):
    paths = httpx.get(f"{server.url}/openapi.json", timeout=30).json()["paths"]
    for p in ("/v2", "/v2/health/ready", "/v2/models/{name}", "/v2/models/{name}/ready", "/v2/models/{name}/infer",
              "/v2/models/{name}/versions/{version}/infer"):
        assert p in paths
    assert "requestBody" in paths["/v2/models/{name}/infer"]["post"]


def test_a_control_character_in_the_path_answers_json_400_not_bentoml_s_plain_404(server):
    # BentoML's mount pattern does not match a newline: without the guard this was a text/plain 404 (CI's fuzz find)
    for path in ("/v2/models/a%0Ab/versions/%3C/ready", "/v2/models/x%0A/infer", "/v2/models/%7F"):
        r = httpx.request("POST" if path.endswith("infer") else "GET", f"{server.url}{path}", timeout=30)
        assert r.status_code == 400, (path, r.status_code, r.text)
        assert r.headers["content-type"].startswith("application/json")
        assert "control character" in r.json()["error"]
    r = httpx.post(f"{server.url}/predict%0A", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "BadRequest" and r.json()["request_id"]
    assert httpx.get(f"{server.url}/v2/models/no-such-model", timeout=30).status_code == 404  # still a 404 answer
