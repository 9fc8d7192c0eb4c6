"""The Python client of the tafl service: `Client(url)` and `AsyncClient(url)`.

Both wrap an httpx client (connection pooling), retry with exponential backoff on connection
errors, 502-504 and 429 (the service at its max_concurrency), never on other 4xx, and turn every service error into `ServiceCallError` carrying the
HTTP status, the service's error code and message, and the request id. Results are typed.

    with Client("http://127.0.0.1:3000", token=None) as c:
        p = c.predict("scan.dcm", heatmap=True)
        print(p.class_name, [e.class_name for e in p.experts])
"""

from __future__ import annotations

import asyncio
import base64
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import httpx

from tafl.errors import ConfigError, DataError, ServiceCallError  # the one exception tree; re-exported here

RETRY_STATUS = {429, 502, 503, 504}  # 429: the service is at its max_concurrency
# connection failures worth another attempt (a restarting or briefly overloaded service)
RETRY_ERRORS = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError,
                httpx.ConnectTimeout, httpx.PoolTimeout)


@dataclass(frozen=True)
class ExpertVote:
    name: str
    label: int
    class_name: str
    probability: float


@dataclass(frozen=True)
class Heatmap:
    png: bytes  # the overlay image
    shape: tuple[int, int]  # the raw map's shape
    kind: str


@dataclass(frozen=True)
class DomainVerdict:
    """The package's in-domain detector on one image: its distance, the package's threshold, in or out, and why."""

    in_domain: bool
    distance: float
    threshold: float
    reason: str

    @classmethod
    def from_json(cls, d: dict[str, Any] | None) -> DomainVerdict | None:
        return None if not d else cls(bool(d["in_domain"]), float(d["distance"]), float(d["threshold"]),
                                      str(d.get("reason", "")))


@dataclass(frozen=True)
class PredictionSet:
    """The classes the model cannot rule out at `coverage` (conformal, class-conditional: the true class is in the
    set for at least that share of each class's images like the calibration images, whatever the case mix)."""

    coverage: float
    classes: list[str]
    labels: list[int]
    kind: str = "class-conditional"
    calibrated_for: str = "the federation"  # or the training site whose own thresholds made it

    @classmethod
    def from_json(cls, d: dict[str, Any] | None) -> PredictionSet | None:
        return None if not d else cls(float(d["coverage"]), list(d["classes"]), [int(x) for x in d["labels"]],
                                      str(d.get("kind", "class-conditional")),
                                      str(d.get("calibrated_for", "the federation")))


@dataclass(frozen=True)
class FrameResult:
    frame: int
    label: int | None  # None: the model abstained (the frame lies outside its domain)
    class_name: str | None
    probability: float | None
    probabilities: dict[str, float] | None
    experts: list[ExpertVote]
    abstained: bool = False
    domain: DomainVerdict | None = None
    prediction_set: PredictionSet | None = None


@dataclass(frozen=True)
class Prediction:
    """One image's answer. With a package that has an in-domain detector, `domain` is its verdict; an image outside
    the model's domain is `abstained` (no label, class or probability; `reason` says why) unless the request asked
    for the label anyway (`abstain=False`: the label comes back with `domain.in_domain` False). With a package that
    has prediction sets, `prediction_set` holds the classes it cannot rule out (None outside the domain)."""

    label: int | None
    class_name: str | None
    probability: float | None
    probabilities: dict[str, float] | None
    experts: list[ExpertVote]
    model: dict[str, str]
    request_id: str
    timing_ms: dict[str, float]
    input: dict[str, Any] = field(default_factory=dict)
    heatmap: Heatmap | None = None
    frames: list[FrameResult] | None = None
    prior: dict[str, Any] | None = None  # which prior decided (train, adaptive, explicit) and the estimate behind it
    calibrated_probabilities: dict[str, float] | None = None  # asked for with posteriors=True
    abstained: bool = False
    domain: DomainVerdict | None = None
    reason: str = ""  # why the model abstained
    prediction_set: PredictionSet | None = None

    @property
    def in_domain(self) -> bool:
        """False when the package's detector put the image outside the model's domain (True without a detector)."""
        return self.domain is None or self.domain.in_domain

    @property
    def model_version(self) -> str:
        return self.model.get("version", "")

    @classmethod
    def from_json(cls, b: dict[str, Any]) -> Prediction:
        def votes(items):
            return [ExpertVote(e["name"], e["label"], e["class_name"], e["probability"]) for e in items]

        hm = b.get("heatmap")
        frames = b.get("frames")
        return cls(label=b["label"], class_name=b["class_name"], probability=b["probability"],
                   probabilities=b["probabilities"], experts=votes(b.get("experts", [])), model=b["model"],
                   request_id=b.get("request_id", ""), timing_ms=b.get("timing_ms", {}), input=b.get("input", {}),
                   heatmap=Heatmap(base64.b64decode(hm["png_base64"]), tuple(hm["shape"]), hm["kind"]) if hm else None,
                   frames=[FrameResult(f["frame"], f["label"], f["class_name"], f["probability"], f["probabilities"],
                                       votes(f.get("experts", [])), bool(f.get("abstained")),
                                       DomainVerdict.from_json(f.get("domain")),
                                       PredictionSet.from_json(f.get("prediction_set"))) for f in frames]
                   if frames else None,
                   prior=b.get("prior"), calibrated_probabilities=b.get("calibrated_probabilities"),
                   abstained=bool(b.get("abstained")), domain=DomainVerdict.from_json(b.get("domain")),
                   reason=b.get("reason", ""), prediction_set=PredictionSet.from_json(b.get("prediction_set")))


def _payload(image: str | Path | bytes) -> tuple[str, bytes]:
    if isinstance(image, (bytes, bytearray)):
        return "upload", bytes(image)
    p = Path(image)
    try:
        return p.name, p.read_bytes()
    except OSError as exc:  # the caller's file, not the service: a DataError, never status 0 ("no answer")
        why = "it is a folder" if p.is_dir() else (exc.strerror or str(exc))
        raise DataError(f"cannot read {p}: {why}") from exc


def service_url(url: str) -> str:
    """The service's base URL, or a ConfigError that says how to write it (httpx's own error is a traceback)."""
    text = str(url).strip()
    scheme = text.split("://", 1)[0].lower() if "://" in text else ""
    if scheme not in ("http", "https"):
        hint = f"http://{text.split('://', 1)[-1]}" if text else "http://127.0.0.1:3000"
        raise ConfigError(f"service URL {text!r} needs http:// or https:// in front, e.g. {hint}")
    if not text.split("://", 1)[1].strip("/"):
        raise ConfigError(f"service URL {text!r} names no host, e.g. http://127.0.0.1:3000")
    text = text.rstrip("/")
    url = httpx.URL(text)
    path = url.path.rstrip("/")
    for route in SERVICE_ROUTES:  # a proxy may put the service under a path of its own; a route is never its root
        at = path.find("/v2/") if route == "v2" else -1  # the inference protocol's routes run on under /v2/
        if path.endswith("/" + route):
            at = len(path) - len(route) - 1
        if at >= 0:
            root = str(url.copy_with(path=path[:at] or "/", query=None, fragment=None)).rstrip("/")
            raise ConfigError(f"service URL {text!r} names the route {path[at:]}: give the service's root, {root} "
                              "(the client adds /predict and the other routes itself)")
    return text


# the service's own routes (tafl/serving/service.py, oip.py): what a root URL never ends in
SERVICE_ROUTES = ("predict/batch", "predict", "heatmap", "models", "healthz", "livez", "readyz", "metrics",
                  "openapi.json", "admin/reload", "docs", "v2")


def _raise_for(r: httpx.Response) -> None:
    if r.status_code < 400:
        return
    try:
        err = r.json()["error"]
        msg, code = err.get("message", r.text[:200]), err.get("code", "")
    except (ValueError, KeyError, TypeError):
        msg, code = r.text[:200] or r.reason_phrase, ""
        if r.status_code in (404, 405, 501):  # not the service's own answer: the URL is not a tafl service's root
            msg = (f"{r.request.url} answered {r.status_code} {r.reason_phrase}, not as a tafl service would: the "
                   "service URL must be the service's root (the address `tafl serve` printed, e.g. "
                   "http://127.0.0.1:3000, where GET /readyz answers), not one of its routes")
    raise ServiceCallError(r.status_code, msg, code, r.headers.get("X-Request-ID"))


class _Base:
    def __init__(self, url: str, *, token: str | None = None, timeout: float = 60.0, retries: int = 3,
                 backoff: float = 0.5, max_connections: int = 32):
        self.url = service_url(url)
        self.retries, self.backoff = retries, backoff
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout = httpx.Timeout(timeout, connect=min(10.0, timeout))
        self.limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)

    def _delay(self, attempt: int) -> float:
        return self.backoff * (2 ** attempt)

    @staticmethod
    def _outcome(r: httpx.Response) -> httpx.Response | ServiceCallError:
        """The response when it is final (raising for a 4xx or other error), or the retryable error."""
        if r.status_code not in RETRY_STATUS:
            _raise_for(r)
            return r
        return ServiceCallError(r.status_code, r.text[:200])

    def _give_up(self, last: Exception | None) -> NoReturn:
        if isinstance(last, ServiceCallError):
            raise last
        raise ServiceCallError(0, f"cannot reach {self.url} after {self.retries + 1} attempts "
                                  f"({type(last).__name__}: {last})") from last

    def _form(self, image, model, heatmap, prior: str | None = None, posteriors: bool = False,
              abstain: bool = True, coverage: float | None = None, site: str | None = None) -> tuple[dict, dict]:
        name, data = _payload(image)
        fields = {"heatmap": "true" if heatmap else "false"}
        if site:
            fields["site"] = site
        if coverage is not None:
            fields["coverage"] = f"{coverage:g}"
        if not abstain:
            fields["abstain"] = "false"
        if model:
            fields["model"] = model
        if prior:
            fields["prior"] = prior
        if posteriors:
            fields["posteriors"] = "true"
        return {"file": (name, data, "application/octet-stream")}, fields

    @staticmethod
    def _batch_form(images: list[str | Path | bytes], model: str | None, prior: str | None,
                    posteriors: bool, abstain: bool = True,
                    coverage: float | None = None) -> tuple[list, dict[str, str] | None]:
        files = [("file", (name, data, "application/octet-stream")) for name, data in map(_payload, images)]
        data = {k: v for k, v in (("model", model), ("prior", prior),
                                  ("posteriors", "true" if posteriors else None),
                                  ("abstain", None if abstain else "false"),
                                  ("coverage", None if coverage is None else f"{coverage:g}")) if v}
        return files, data or None

    @staticmethod
    def _batch_results(body: dict[str, Any]) -> list[Prediction | ServiceCallError]:
        out: list[Prediction | ServiceCallError] = []
        for item in body["results"]:
            if "error" in item:
                e = item["error"]
                out.append(ServiceCallError(e["status"], e["message"], e.get("code", ""), body.get("request_id")))
            else:
                out.append(Prediction.from_json({**item, "model": body["model"], "request_id": body["request_id"],
                                                 "prior": body.get("prior")}))
        return out

    @staticmethod
    def _reload_args(package: str, admin_token: str | None) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        return {"json": {"package": package}, "headers": headers}


class Client(_Base):
    def __init__(self, url: str, **kw: Any):
        super().__init__(url, **kw)
        self.http = httpx.Client(headers=self.headers, timeout=self.timeout, limits=self.limits)

    def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            try:
                outcome = self._outcome(self.http.request(method, self.url + path, **kw))
            except RETRY_ERRORS as exc:
                last = exc
            else:
                if isinstance(outcome, httpx.Response):
                    return outcome
                last = outcome
            if attempt < self.retries:
                time.sleep(self._delay(attempt))
        self._give_up(last)

    def predict(self, image: str | Path | bytes, *, model: str | None = None, heatmap: bool = False,
                prior: str | None = None, posteriors: bool = False, abstain: bool = True,
                coverage: float | None = None, site: str | None = None) -> Prediction:
        """`prior`: train (default), site (the service's own site mix, from its --site-mix), adaptive (the service's
        estimate of its served case mix) or comma-separated class probabilities; the answer's `prior` says which
        one decided. `abstain=False`: the label even for an image outside the model's domain (marked, in
        `domain`); by default such an image comes back `abstained`, with no label. `coverage`: the prediction
        set's level, one the package keeps (None: the one chosen at export); `site`: a training site whose own
        thresholds make the set (None: the service's TAFL_SITE, else the federation's)."""
        files, data = self._form(image, model, heatmap, prior, posteriors, abstain, coverage, site)
        return Prediction.from_json(self._call("POST", "/predict", files=files, data=data).json())

    def predict_batch(self, images: list[str | Path | bytes], *, model: str | None = None, prior: str | None = None,
                      posteriors: bool = False, abstain: bool = True,
                      coverage: float | None = None) -> list[Prediction | ServiceCallError]:
        """One request for several images; each comes back as a Prediction or the error for that image.
        `prior`: train (default), site, adaptive, or comma-separated class probabilities; `posteriors`: also return
        each image's calibrated probabilities; `abstain`, `coverage`: as in `predict`."""
        files, data = self._batch_form(images, model, prior, posteriors, abstain, coverage)
        return self._batch_results(self._call("POST", "/predict/batch", files=files, data=data).json())

    def heatmap(self, image: str | Path | bytes, *, model: str | None = None) -> bytes:
        files, data = self._form(image, model, False)
        return self._call("POST", "/heatmap", files=files, data=data).content

    def models(self) -> list[dict[str, Any]]:
        return self._call("GET", "/models").json()["models"]

    def health(self) -> bool:
        """True when the service answers /readyz with 200 (no retries)."""
        try:
            return self.http.get(self.url + "/readyz", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def reload(self, package: str, *, admin_token: str | None = None) -> dict[str, Any]:
        """Swap in a new package version on the service (POST /admin/reload with the admin token)."""
        return self._call("POST", "/admin/reload", **self._reload_args(package, admin_token)).json()

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncClient(_Base):
    def __init__(self, url: str, **kw: Any):
        super().__init__(url, **kw)
        self.http = httpx.AsyncClient(headers=self.headers, timeout=self.timeout, limits=self.limits)

    async def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            try:
                outcome = self._outcome(await self.http.request(method, self.url + path, **kw))
            except RETRY_ERRORS as exc:
                last = exc
            else:
                if isinstance(outcome, httpx.Response):
                    return outcome
                last = outcome
            if attempt < self.retries:
                await asyncio.sleep(self._delay(attempt))
        self._give_up(last)

    async def predict(self, image: str | Path | bytes, *, model: str | None = None, heatmap: bool = False,
                      prior: str | None = None, posteriors: bool = False, abstain: bool = True,
                      coverage: float | None = None, site: str | None = None) -> Prediction:
        """As `Client.predict`."""
        files, data = self._form(image, model, heatmap, prior, posteriors, abstain, coverage, site)
        return Prediction.from_json((await self._call("POST", "/predict", files=files, data=data)).json())

    async def predict_batch(self, images: list[str | Path | bytes], *, model: str | None = None,
                            prior: str | None = None, posteriors: bool = False,
                            abstain: bool = True, coverage: float | None = None) -> list[Prediction | ServiceCallError]:
        """As `Client.predict_batch`: one request, each image's Prediction or its error, in order."""
        files, data = self._batch_form(images, model, prior, posteriors, abstain, coverage)
        return self._batch_results((await self._call("POST", "/predict/batch", files=files, data=data)).json())

    async def heatmap(self, image: str | Path | bytes, *, model: str | None = None) -> bytes:
        files, data = self._form(image, model, False)
        return (await self._call("POST", "/heatmap", files=files, data=data)).content

    async def models(self) -> list[dict[str, Any]]:
        return (await self._call("GET", "/models")).json()["models"]

    async def health(self) -> bool:
        """True when the service answers /readyz with 200 (no retries)."""
        try:
            return (await self.http.get(self.url + "/readyz", timeout=5)).status_code == 200
        except httpx.HTTPError:
            return False

    async def reload(self, package: str, *, admin_token: str | None = None) -> dict[str, Any]:
        """As `Client.reload`."""
        return (await self._call("POST", "/admin/reload", **self._reload_args(package, admin_token))).json()

    async def aclose(self) -> None:
        await self.http.aclose()

    async def close(self) -> None:
        """The same as `aclose` (httpx's name), under `Client`'s name."""
        await self.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()
