"""A plain BentoML service around the same package, for benchmarks/serving_bentoml_batching.py: BentoML's own
adaptive batching (`@bentoml.api(batchable=True)`) and its own multipart image input, the model run as one
ONNX Runtime call on two threads per batch. None of tafl's checks, limits, audit line, case-mix window, heatmap or
expert votes: what a request costs on BentoML's path with the least around it. Access log and tracing are off, as
in tafl's service. The package folder comes from PLAIN_PKG.

    PLAIN_PKG=PKG bentoml serve bentoml_plain_service:Plain   (from benchmarks/)
"""

from __future__ import annotations

import os

import bentoml
import numpy as np
from PIL.Image import Image as PILImage


@bentoml.service(workers=1, logging={"access": {"enabled": False}},
                 tracing={"sample_rate": 0.0, "excluded_urls": [".*"]})
class Plain:
    def __init__(self) -> None:
        from tafl.packaging import load_package

        self.pkg = load_package(os.environ["PLAIN_PKG"])
        self.session = self.pkg.session(["CPUExecutionProvider"], 2)

    @bentoml.api(batchable=True, max_batch_size=64, max_latency_ms=10000)
    def predict(self, images: list[PILImage]) -> list[dict]:
        x = self.pkg.preprocess([np.asarray(im.convert("RGB")) for im in images])
        out = self.pkg.run(self.session, x)
        return [{"label": int(out["label"][i]), "probs": out["probs"][i].tolist()} for i in range(len(images))]
