"""The scorers of a scoring job (`tafl score`, tafl.clients.score and tafl.clients.dicomweb): each turns input files
into `Row`s, in order. `RemoteScorer` goes through the service (batches of images per request, a bounded number
of requests in flight through the retrying `Client`); `LocalScorer` decodes with the service's own decoder and runs
the package in ONNX Runtime in batches, in this process, so both give the same labels. Each has `meta`, the
model's typed metadata (tafl.packaging.metadata), and `close`. The Ray engine's scorer is tafl.clients.ray_engine.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from tafl.clients.results import Row
from tafl.errors import DataError, TaflError
from tafl.packaging.domain import in_domain_rows
from tafl.packaging.metadata import PackageMetadata
from tafl.packaging.sets import set_answer


class RemoteScorer:
    """Through the service: batches of images per request, a bounded number of requests in flight."""

    def __init__(self, url: str, token: str | None, model: str | None, concurrency: int, batch_size: int = 16,
                 prior: str | None = None, posteriors: bool = False):
        from tafl.clients.client import Client

        self.prior, self.posteriors = prior, posteriors
        # retries with backoff ride out a service restart (about 10 s here) without losing the job
        self.client = Client(url, token=token, max_connections=max(concurrency, 1), retries=6, backoff=0.5)
        self.model, self.concurrency, self.batch_size = model, concurrency, max(1, batch_size)
        models = self.client.models()
        if not models:
            raise DataError(f"{url} serves no model")
        served = next((m for m in models if m["name"] == model), models[0])
        # the service hands on the package's metadata.json as it is: read as a package's is, by a schema that also
        # refuses metadata from a newer tafl than this client's
        self.meta = PackageMetadata.from_json(served["metadata"], f"{url}: model {served['name']!r}")

    def _chunk(self, paths: list[Path], rel: Callable[[Path], str]) -> list[Row]:
        from tafl.clients.client import ServiceCallError

        rows: dict[Path, Row] = {}
        readable = []
        for p in paths:
            try:
                readable.append((p, p.read_bytes()))
            except OSError as exc:
                rows[p] = Row(rel(p), error=f"unreadable: {exc.strerror or exc}")
        if readable:
            try:
                answers = self.client.predict_batch([d for _, d in readable], model=self.model, prior=self.prior,
                                                    posteriors=self.posteriors)  # outside the domain: abstained
            except ServiceCallError as exc:
                if exc.status == 0 or exc.status >= 500 or exc.status in (401, 404):
                    raise  # the service, not the files, failed: stop the job (the file stays resumable)
                answers = [exc] * len(readable)
            for (p, _), a in zip(readable, answers):
                if isinstance(a, ServiceCallError):
                    rows[p] = Row(rel(p), error=f"{a.status} {a.code}: {a.detail}")
                elif a.abstained:  # outside the model's domain: a row without a label, its verdict in the columns
                    rows[p] = Row(rel(p), None, "", None, {}, a.model["name"], a.model["version"],
                                  in_domain=False, domain_distance=a.domain.distance if a.domain else None)
                else:
                    cal, ps = a.calibrated_probabilities, a.prediction_set
                    rows[p] = Row(rel(p), a.label, a.class_name, a.probability,
                                  {e.name: e.class_name for e in a.experts}, a.model["name"], a.model["version"],
                                  posteriors=[cal[n] for n in self.meta.class_names] if cal else None,
                                  in_domain=a.domain.in_domain if a.domain else None,
                                  domain_distance=a.domain.distance if a.domain else None,
                                  prediction_set=ps.classes if ps else None, set_coverage=ps.coverage if ps else None)
        return [rows[p] for p in paths]

    def score(self, paths: list[Path], rel: Callable[[Path], str]) -> Iterator[Row]:
        chunks = [paths[i:i + self.batch_size] for i in range(0, len(paths), self.batch_size)]
        with concurrent.futures.ThreadPoolExecutor(self.concurrency) as pool:
            pending: list[concurrent.futures.Future] = []
            for chunk in chunks:  # at most `concurrency` requests in flight; rows come out in order
                pending.append(pool.submit(self._chunk, chunk, rel))
                while len(pending) >= self.concurrency:
                    yield from pending.pop(0).result()
            for f in pending:
                yield from f.result()

    def close(self) -> None:
        self.client.close()


class LocalScorer:
    """In-process: the service's decoder, the package's preprocessing, ONNX Runtime in batches."""

    def __init__(self, package: str, batch_size: int, threads: int | None = None, ratio: np.ndarray | None = None,
                 providers: list[str] | None = None):
        from tafl.packaging import load_package

        self.ratio = ratio  # an explicit prior's log ratio, fed to the graph
        self.pkg = load_package(package)
        self.session = self.pkg.session(providers or ["CPUExecutionProvider"], threads)
        self.meta, self.batch_size = self.pkg.meta, batch_size

    def score(self, paths: list[Path], rel: Callable[[Path], str]) -> Iterator[Row]:
        from tafl.imaging import decode_image

        names, experts = self.pkg.class_names, self.pkg.expert_names
        pre = self.pkg.preprocess
        for start in range(0, len(paths), self.batch_size):
            chunk = paths[start:start + self.batch_size]
            arrays, ok, rows = [], [], {}
            for p in chunk:
                try:
                    decoded = decode_image(p.read_bytes())
                    self.pkg.check_domain(decoded)  # a header outside the trained domain: a row with the reason
                    frame = decoded.frames[0]
                    arrays.append(pre.to_uint8(frame))
                    ok.append(p)
                except TaflError as exc:
                    rows[p] = Row(rel(p), error=f"{getattr(exc, 'status', 400)} {type(exc).__name__}: {exc.message}")
                except OSError as exc:
                    rows[p] = Row(rel(p), error=f"unreadable: {exc.strerror or exc}")
            if ok:
                out = self.pkg.run(self.session, pre.normalize(np.stack(arrays)), self.ratio)
                keep = in_domain_rows(self.meta, out)
                for i, p in enumerate(ok):
                    dist = None if keep is None else float(out["domain_distance"][i])
                    if keep is not None and not keep[i]:  # outside the model's domain: no label
                        rows[p] = Row(rel(p), None, "", None, {}, self.pkg.name, self.pkg.version, in_domain=False,
                                      domain_distance=dist)
                        continue
                    label = int(out["label"][i])
                    ex = {}
                    if "expert_labels" in out:
                        ex = {e: names[int(out["expert_labels"][i, j])] for j, e in enumerate(experts)}
                    post = None
                    if "calibrated_probs" in out and self.ratio is None:
                        post = [float(v) for v in out["calibrated_probs"][i]]
                    ps = set_answer(self.meta, out, i)
                    rows[p] = Row(rel(p), label, names[label], float(out["probs"][i, label]), ex, self.pkg.name,
                                  self.pkg.version, posteriors=post, in_domain=None if keep is None else True,
                                  domain_distance=dist, prediction_set=ps["classes"] if ps else None,
                                  set_coverage=ps["coverage"] if ps else None)
            for p in chunk:
                yield rows[p]

    def close(self) -> None:
        pass
