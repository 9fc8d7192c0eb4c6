"""The service's JSON answer (tafl.serving.http.JSONResponse, written by orjson): what it writes equals what the
standard library reads back, a NaN or infinity becomes null, and what orjson refuses still gets an answer."""

from __future__ import annotations

import json
import math

import numpy as np

from tafl.serving.http import JSONResponse


def test_the_json_answer_reads_back_as_the_body_it_was_given():
    body = {"request_id": "0f3c", "label": 3, "class_name": "naevus (mélanocytaire) 母斑", "probabilities": [0.1, 1 / 3],
            "experts": [{"name": "forward", "label": 3}], "input": {"size": (28, 28)}, "ok": True, "none": None}
    out = JSONResponse(body).body
    assert json.loads(out) == {**body, "input": {"size": [28, 28]}}
    assert b'": ' not in out and b', "' not in out  # compact, as Starlette's own


def test_nan_infinity_numpy_and_odd_values_never_fail_the_answer():
    got = json.loads(JSONResponse({"auc": math.nan, "loss": -math.inf, "p": np.float32(0.25),
                                   "v": np.arange(3, dtype=np.int64), 7: "seven"}).body)
    assert got == {"auc": None, "loss": None, "p": 0.25, "v": [0, 1, 2], "7": "seven"}
    big = {"count": 2**70, "mean": math.nan}  # past orjson's 64 bits: the standard library writes it
    assert json.loads(JSONResponse(big).body) == {"count": 2**70, "mean": None}
