"""Batch scoring of an image folder: `tafl score FOLDER --out results.csv|.jsonl (--url URL | --package PKG)`.

The folder is walked recursively; DICOM (by its "DICM" marker or a .dcm name), PNG and JPEG (by
their magic bytes) are scored, anything else is listed as skipped. Remote scoring keeps a
bounded number of requests in flight through the retrying `Client`; in-process scoring decodes
with the service's own decoder and runs the package in ONNX Runtime in batches, so both give
the same labels. Each result is one line appended with a single write and flushed, so the file
is valid at every instant; `--resume` repairs a torn last line, skips every path already in the
file and appends the rest. The summary compares the predicted class mix with the training mix.

A CSV cell a spreadsheet would run as a formula (a string starting with =, +, -, @, tab or
carriage return: OWASP's CSV injection; a file in a hospital folder can be named
`=HYPERLINK(...).png`) is written with a leading `'`, and so is one already starting with `'`, so
that `csv_uncell` restores every value exactly and `--resume` still recognises the paths; a
string that is a plain number (-1.5) and numeric cells stay as they are. JSONL keeps raw values.
"""

from __future__ import annotations

import collections
import concurrent.futures
import csv
import io
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from tafl.errors import ConfigError, DataError, TaflError

log = logging.getLogger(__name__)


def sniff(path: Path) -> str | None:
    """'dicom', 'png', 'jpeg' or None (skip)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(132)
    except OSError:
        return "unreadable"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if head[128:132] == b"DICM" or path.suffix.lower() in (".dcm", ".dicom"):
        return "dicom"
    return None


def walk(folder: Path) -> tuple[list[Path], list[Path]]:
    """(images, skipped), both sorted, recursively."""
    images, skipped = [], []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            p = Path(root) / name
            (images if sniff(p) else skipped).append(p)
    return images, skipped


@dataclass
class Row:
    path: str
    label: int | None = None
    class_name: str = ""
    probability: float | None = None
    experts: dict[str, str] = field(default_factory=dict)  # expert name -> class name
    model: str = ""
    model_version: str = ""
    error: str = ""
    posteriors: list[float] | None = None  # calibrated, under the source prior (--prior adaptive)


ADAPTIVE_COLUMNS = ["adaptive_label", "adaptive_class_name"]

FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")


def csv_cell(value: Any) -> Any:
    """`value` as the results CSV stores it: a string that a spreadsheet would run as a formula gets a
    leading `'` (also one that starts with `'` already, so that the escape can be undone exactly);
    plain numbers, written as strings or not, and every other value stay as they are."""
    if isinstance(value, str) and value[:1] in (*FORMULA_START, "'") and not _PLAIN_NUMBER.fullmatch(value):
        return "'" + value
    return value


def csv_uncell(text: str) -> str:
    """The value `csv_cell` escaped (the CSV's text when it did not)."""
    return text[1:] if text.startswith("'") else text


class ResultsFile:
    """Append-only CSV or JSONL whose every line is complete (one write per row, then flush)."""

    def __init__(self, path: Path, expert_names: list[str], *, resume: bool, force: bool, num_posteriors: int = 0):
        self.path, self.expert_names = path, expert_names
        self.jsonl = path.suffix.lower() == ".jsonl"
        if path.suffix.lower() not in (".csv", ".jsonl"):
            raise ConfigError(f"--out {path}: use a .csv or .jsonl file")
        self.post_cols = [f"p{c}" for c in range(num_posteriors)]
        self.columns = (["path", "label", "class_name", "probability"] + [f"expert_{e}" for e in expert_names]
                        + ["model", "model_version", "error"] + self.post_cols)
        self.done: set[str] = set()
        self.done_counts: dict[str, int] = {}  # resume: the class names already predicted in the file
        if path.exists() and path.stat().st_size > 0:
            if not resume and not force:
                raise ConfigError(f"{path} exists; pass --resume to continue it or --force to replace it")
            if resume:
                self._repair_and_read()
            else:
                path.unlink()
        path.parent.mkdir(parents=True, exist_ok=True)
        new = not path.exists() or path.stat().st_size == 0
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if new and not self.jsonl:
            self._write_line(self._csv_line(self.columns))

    def _repair_and_read(self) -> None:
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):  # a kill tore the last line: drop it, it will be scored again
            cut = data.rfind(b"\n") + 1
            with open(self.path, "r+b") as fh:
                fh.truncate(cut)
            data = data[:cut]
        text = data.decode("utf-8")
        if self.jsonl:
            for line in text.splitlines():
                if line.strip():
                    rec = json.loads(line)
                    self.done.add(rec["path"])
                    self._count(rec)
        else:
            reader = csv.DictReader(io.StringIO(text))
            if reader.fieldnames and reader.fieldnames not in (self.columns, self.columns + ADAPTIVE_COLUMNS):
                raise ConfigError(f"{self.path} has columns {reader.fieldnames}; this model writes {self.columns} "
                                  "(a different model?); use another --out")
            for r in reader:
                self.done.add(csv_uncell(r["path"]))
                self._count({**r, "class_name": csv_uncell(r.get("class_name") or "")})

    def _count(self, rec: dict[str, Any]) -> None:
        if not rec.get("error") and rec.get("class_name"):
            self.done_counts[rec["class_name"]] = self.done_counts.get(rec["class_name"], 0) + 1

    @staticmethod
    def _csv_line(values: list[Any]) -> str:
        buf = io.StringIO()
        # "\r\n" so that the csv module quotes a \r inside a value too (with "\n" it quotes only \n, and
        # a file name holding a \r split its row in two); the line itself ends in "\n" as before
        csv.writer(buf, lineterminator="\r\n").writerow(values)
        return buf.getvalue()[:-2] + "\n"

    def _write_line(self, line: str) -> None:
        os.write(self.fd, line.encode("utf-8"))  # one write of a whole line: O_APPEND keeps it intact

    def write(self, row: Row) -> None:
        experts = {f"expert_{e}": row.experts.get(e, "") for e in self.expert_names}
        rec = {"path": row.path, "label": row.label, "class_name": row.class_name, "probability": row.probability,
               **experts, "model": row.model, "model_version": row.model_version, "error": row.error,
               **{c: (row.posteriors[i] if row.posteriors else None) for i, c in enumerate(self.post_cols)}}
        if self.jsonl:
            self._write_line(json.dumps(rec) + "\n")
        else:
            self._write_line(self._csv_line(["" if rec[c] is None else csv_cell(rec[c]) for c in self.columns]))
        self.done.add(row.path)

    def close(self) -> None:
        os.fsync(self.fd)
        os.close(self.fd)


# ------------------------------------------------------------------ scorers
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
        meta = next((m["metadata"] for m in models if m["name"] == model), models[0]["metadata"]) if models else None
        if meta is None:
            raise DataError(f"{url} serves no model")
        self.meta = meta

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
                                                    posteriors=self.posteriors)
            except ServiceCallError as exc:
                if exc.status == 0 or exc.status >= 500 or exc.status in (401, 404):
                    raise  # the service, not the files, failed: stop the job (the file stays resumable)
                answers = [exc] * len(readable)
            for (p, _), a in zip(readable, answers):
                if isinstance(a, ServiceCallError):
                    rows[p] = Row(rel(p), error=f"{a.status} {a.code}: {a.detail}")
                else:
                    cal = a.calibrated_probabilities
                    rows[p] = Row(rel(p), a.label, a.class_name, a.probability,
                                  {e.name: e.class_name for e in a.experts}, a.model["name"], a.model["version"],
                                  posteriors=[cal[n] for n in self.meta["class_names"]] if cal else None)
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
        self.meta, self.batch_size = self.pkg.metadata, batch_size

    def score(self, paths: list[Path], rel: Callable[[Path], str]) -> Iterator[Row]:
        from tafl.imaging import decode_image

        names, experts = self.pkg.class_names, self.pkg.expert_names
        pre = self.pkg.preprocess
        for start in range(0, len(paths), self.batch_size):
            chunk = paths[start:start + self.batch_size]
            arrays, ok, rows = [], [], {}
            for p in chunk:
                try:
                    frame = decode_image(p.read_bytes()).frames[0]
                    arrays.append(pre.to_uint8(frame))
                    ok.append(p)
                except TaflError as exc:
                    rows[p] = Row(rel(p), error=f"{getattr(exc, 'status', 400)} {type(exc).__name__}: {exc.message}")
                except OSError as exc:
                    rows[p] = Row(rel(p), error=f"unreadable: {exc.strerror or exc}")
            if ok:
                out = self.pkg.run(self.session, pre.normalize(np.stack(arrays)), self.ratio)
                for i, p in enumerate(ok):
                    label = int(out["label"][i])
                    ex = {}
                    if "expert_labels" in out:
                        ex = {e: names[int(out["expert_labels"][i, j])] for j, e in enumerate(experts)}
                    post = None
                    if "calibrated_probs" in out and self.ratio is None:
                        post = [float(v) for v in out["calibrated_probs"][i]]
                    rows[p] = Row(rel(p), label, names[label], float(out["probs"][i, label]), ex, self.pkg.name,
                                  self.pkg.version, posteriors=post)
            for p in chunk:
                yield rows[p]

    def close(self) -> None:
        pass


# ------------------------------------------------------------------ the job
def score_folder(folder: str | Path, out: str | Path, *, url: str | None = None, package: str | None = None,
                 token: str | None = None, model: str | None = None, concurrency: int = 4, batch_size: int = 16,
                 resume: bool = False, force: bool = False, progress: bool | None = None,
                 on_row: Callable[[Row], None] | None = None, prior: str = "train", engine: str = "local",
                 address: str | None = None, workers: int | None = None, gpus_per_worker: float = 0.0,
                 dicom_out: str | Path | None = None, dicom_heatmap: bool = False,
                 sr_processes: int | None = 0, site_mix: str | None = None) -> dict[str, Any]:
    """`engine`: local (this process) or ray (tafl.clients.ray_engine: a pool of `workers` actors on the Ray cluster
    at `address`, or on a local instance started for the job, each with `gpus_per_worker` GPUs; needs --package).
    `prior`: train (the model's own rule); adaptive (each row keeps its calibrated posteriors; at the end the
    folder's class mix is estimated from all of them and every row is re-decided for it, without a second
    inference: the file gains adaptive_label and adaptive_class_name); or comma-separated class probabilities
    (the graph decides for that prior). `site_mix`: with adaptive, this site's own class counts
    (tafl.prior.parse_site_mix), the centre of a model whose estimator is centred on the site's mix.
    `sr_processes`: processes that build the --dicom-out SRs while this one scores (None: min(2, cores) for 16
    inputs or more, as `tafl score` does; 0: built here). They are spawned, so a script that passes one must
    start its work under `if __name__ == "__main__":`."""
    folder, out = Path(folder), Path(out)
    mode = (prior or "train").strip().lower()
    adaptive = mode == "adaptive"
    if (url is None) == (package is None):
        raise ConfigError("give exactly one of --url URL (remote scoring) or --package PKG_DIR (in-process)")
    if adaptive:
        from tafl.prior import adaptive_blocked

        adaptive_blocked(None)  # a bad TAFL_PRIOR_ADAPTIVE fails here, before the folder is scored
    if engine not in ("local", "ray"):
        raise ConfigError(f"--engine must be local or ray, got {engine!r}")
    if engine == "ray" and url:
        raise ConfigError("--engine ray runs the package on the cluster: give --package PKG_DIR, not --url")
    if engine == "local" and (address or workers or gpus_per_worker):
        raise ConfigError("--address, --workers and --gpus-per-worker go with --engine ray")
    if engine == "ray" and dicom_out is not None:
        raise ConfigError("--dicom-out is not supported with --engine ray yet (the SRs are written by the scoring "
                          "process); score with the local engine or --url")
    if not folder.is_dir():
        raise DataError(f"{folder} is not a folder")
    images, skipped = walk(folder)
    if not images:
        raise DataError(f"{folder} holds no DICOM, PNG or JPEG files ({len(skipped)} other file(s) skipped)")
    explicit = explicit_prior(prior)
    if engine == "ray":
        from tafl.clients.ray_engine import RayScorer

        scorer: Any = RayScorer(package, batch_size, address=address, workers=workers,
                                       gpus_per_worker=gpus_per_worker)
        if explicit is not None:
            scorer.ratio = _explicit_ratio(scorer.meta, explicit)
        check_prior_support(scorer.meta, prior, adaptive, explicit)
    else:
        scorer = make_scorer(url, package, token, model, concurrency, batch_size, prior)
    check_site_mix(scorer.meta, site_mix, mode)
    if mode == "site":
        explicit = use_site_prior(scorer, site_mix)
    experts = [e["name"] for e in scorer.meta.get("experts", [])]
    results = ResultsFile(out, experts, resume=resume, force=force,
                          num_posteriors=len(scorer.meta["class_names"]) if adaptive else 0)

    def rel(p: Path) -> str:
        return p.relative_to(folder).as_posix()

    todo = [p for p in images if rel(p) not in results.done]
    dicom = None
    if dicom_out is not None:  # SR (+ heatmap SC) per DICOM input, written before its row: tafl.clients.dicom_out
        from tafl.clients.dicom_out import DicomWriter, processes_for

        procs = processes_for(len(todo)) if sr_processes is None else sr_processes
        dicom = DicomWriter(dicom_out, folder, scorer, heatmap=dicom_heatmap, processes=procs)
    counts: dict[str, int] = dict(results.done_counts)  # the class mix of the whole file, earlier rows too
    failed: list[tuple[str, str]] = []
    predicted_now = 0
    from tqdm.auto import tqdm

    try:
        with tqdm(total=len(images), initial=len(images) - len(todo), unit="img", desc="scoring",
                  disable=(not progress) if progress is not None else None, dynamic_ncols=True) as bar:
            def emit(row: Row) -> None:
                nonlocal predicted_now
                results.write(row)
                if row.error:
                    failed.append((row.path, row.error))
                else:
                    counts[row.class_name] = counts.get(row.class_name, 0) + 1
                    predicted_now += 1
                if on_row:
                    on_row(row)
                bar.update(1)

            # with --dicom-out a row is written after its SR (so --resume never skips an input without one),
            # and in order; the SRs are made while the next inputs are scored
            making: collections.deque = collections.deque()
            for row in scorer.score(todo, rel):
                if dicom is None:
                    emit(row)
                    continue
                making.append((row, dicom.start(row)))
                while making and (len(making) > dicom.window or making[0][1] is None or making[0][1].done()):
                    done, made = making.popleft()
                    dicom.finish(done, made)
                    emit(done)
            while making:
                done, made = making.popleft()
                dicom.finish(done, made)
                emit(done)
    finally:
        results.close()
        scorer.close()
        if dicom is not None:
            dicom.close()
    summary = summarise(scorer.meta, counts, out, images=len(images), todo=len(todo), predicted_now=predicted_now,
                        failed=failed, skipped=[rel(p) for p in skipped], explicit=explicit, adaptive=adaptive,
                        site_mix=site_mix, site_rule=mode == "site")
    if dicom is not None:
        summary.update(dicom_written=dicom.written, dicom_failed=dicom.failed)
    return summary


def make_scorer(url: str | None, package: str | None, token: str | None, model: str | None, concurrency: int,
                batch_size: int, prior: str) -> Any:
    """The in-process (--package) or remote (--url) scorer, with an explicit prior's ratio set and the prior
    mode checked against the model."""
    mode = (prior or "train").strip().lower()
    explicit = explicit_prior(prior)
    if url:
        scorer: Any = RemoteScorer(url, token, model, concurrency, min(batch_size, 64), prior=explicit,
                                   posteriors=mode == "adaptive")
    else:
        scorer = LocalScorer(package, batch_size)
        if explicit is not None:
            scorer.ratio = _explicit_ratio(scorer.meta, explicit)
    check_prior_support(scorer.meta, prior, mode == "adaptive", explicit)
    return scorer


def check_prior_support(meta: dict[str, Any], prior: str, adaptive: bool, explicit: str | None) -> None:
    if (adaptive or explicit is not None) and "prior" not in meta:
        raise ConfigError(f"--prior {prior}: the model {meta.get('name')} {meta.get('version')} was "
                          "exported before prior-aware inference; re-export it with this tafl")


PRIOR_WORDS = ("train", "adaptive", "site")  # the --prior values that are not a list of class probabilities


def explicit_prior(prior: str | None) -> str | None:
    """--prior as class probabilities for the graph, or None for train, adaptive and site (set by the scorer)."""
    return None if (prior or "train").strip().lower() in PRIOR_WORDS else prior


def check_site_mix(meta: dict[str, Any], site_mix: str | None, mode: str) -> None:
    """--site-mix goes with --prior adaptive (the estimate's centre) or --prior site (the fixed prior) and names only
    the model's classes; --prior site needs it. Checked before anything is scored. `mode`: the --prior word."""
    if mode == "site" and not site_mix:
        raise ConfigError("--prior site decides every image for this site's own class mix: give it with --site-mix "
                          "CLASS=COUNT,... (or a JSON file), or set TAFL_SITE_MIX")
    if not site_mix:
        return
    if mode not in ("adaptive", "site"):
        raise ConfigError("--site-mix is this site's class mix: it goes with --prior site (decide for that mix) or "
                          "--prior adaptive (centre the case-mix estimate on it)")
    from tafl.prior import parse_site_mix

    parse_site_mix(site_mix, list(meta["class_names"]), "--site-mix")


def use_site_prior(scorer: Any, site_mix: str | None) -> str:
    """--prior site: the scorer decides every image for this site's own mix (tafl.prior.site_prior, from
    --site-mix), through the graph's prior input in-process or the service's explicit prior over HTTP. Returns
    that prior as the explicit prior's text."""
    from tafl.prior import parse_site_mix, site_prior

    check_prior_support(scorer.meta, "site", False, "site")
    q = site_prior(parse_site_mix(site_mix or "", list(scorer.meta["class_names"]), "--site-mix"))
    text = ",".join(f"{v:.12g}" for v in q)
    if isinstance(scorer, RemoteScorer):
        scorer.prior = text
    else:
        scorer.ratio = _explicit_ratio(scorer.meta, text)
    return text


def summarise(meta: dict[str, Any], counts: dict[str, int], out: Path, *, images: int, todo: int, predicted_now: int,
              failed: list[tuple[str, str]], skipped: list[str], explicit: str | None,
              adaptive: bool, site_mix: str | None = None, site_rule: bool = False) -> dict[str, Any]:
    """The job's summary: counts, failures, skipped inputs and the predicted class mix beside the training mix
    (re-decided for the estimated mix with --prior adaptive)."""
    names = meta["class_names"]
    from tafl.packaging.summary import training_shares  # the page's and the model card's rule too

    train = training_shares(meta)
    scored = sum(counts.values())
    mix = [{"class_name": n, "predicted": counts.get(n, 0),
            "predicted_share": counts.get(n, 0) / scored if scored else 0.0,
            "training_share": train[c] if train else None} for c, n in enumerate(names)]
    summary = {"images": images, "scored_now": todo, "already_done": images - todo,
               "predicted": predicted_now, "predicted_in_file": scored, "failed": failed, "skipped": skipped,
               "class_mix": mix, "out": str(out), "prior": {"used": "explicit" if explicit is not None else "train"}}
    if site_rule and explicit is not None:  # --prior site: the site's own mix, as the graph was given it
        summary["prior"] = {"used": "site", "prior": dict(zip(names, (float(v) for v in explicit.split(","))))}
    if adaptive:
        summary["prior"] = redecide_adaptive(out, meta, site_mix)
        for m in mix:
            m["adaptive_predicted"] = summary["prior"]["adaptive_counts"].get(m["class_name"], 0)
    return summary


MIN_ADAPTIVE_IMAGES = 30


def _explicit_ratio(meta: dict[str, Any], prior: str) -> np.ndarray:
    from tafl.prior import check_prior, log_prior_ratio

    if "prior" not in meta:
        raise ConfigError(f"--prior: the model {meta.get('name')} was exported before prior-aware inference")
    try:
        values = json.loads(prior) if prior.strip().startswith("[") else [float(v) for v in prior.split(",")]
    except ValueError:
        raise ConfigError(f"--prior must be train, adaptive or comma-separated class probabilities, got {prior!r}") \
            from None
    q = check_prior(values, len(meta["class_names"]), "--prior")
    return log_prior_ratio(q, np.asarray(meta["prior"]["source_prior"], np.float64))


def redecide_adaptive(out: Path, meta: dict[str, Any], site_mix: str | None = None) -> dict[str, Any]:
    """Estimate the folder's class mix from every scored row's calibrated posteriors (the package's estimator:
    EM, smoothed as metadata prior.estimator says, centred on `site_mix` where it is centred on the site's mix)
    and rewrite the results file, atomically, with each row's
    decision for that mix beside its plain one."""
    from tafl.prior import PriorEstimator, adapt, adaptive_blocked, parse_site_mix

    names = meta["class_names"]
    C = len(names)
    src = np.asarray(meta["prior"]["source_prior"], np.float64)
    jsonl = out.suffix.lower() == ".jsonl"
    with open(out, encoding="utf-8", newline="") as fh:  # no newline translation: a \r inside a value stays
        text = fh.read()
    if jsonl:
        recs = [json.loads(line) for line in text.splitlines() if line.strip()]
        fields = list(recs[0]) if recs else []
    else:
        reader = csv.DictReader(io.StringIO(text))
        recs, fields = list(reader), list(reader.fieldnames or [])
    cols = [f"p{c}" for c in range(C)]
    scored = [r for r in recs if not r.get("error") and all(r.get(c) not in (None, "") for c in cols)]
    P = np.array([[float(r[c]) for c in cols] for r in scored]).reshape(-1, C)
    info: dict[str, Any] = {"requested": "adaptive", "images": len(scored), "source_prior": dict(zip(names, src))}
    blocked = adaptive_blocked(meta.get("prior"))
    if blocked:
        q = src
        info.update(used="train", fallback=blocked)
    elif len(scored) < MIN_ADAPTIVE_IMAGES:
        q = src
        info.update(used="train", fallback=f"{len(scored)} scored images are too few for an estimate (needs "
                                          f"{MIN_ADAPTIVE_IMAGES}); the adaptive columns repeat the source prior's "
                                          "decision")
    else:
        estimator = PriorEstimator.from_dict(meta["prior"].get("estimator"))
        if site_mix:
            estimator = estimator.for_site(parse_site_mix(site_mix, names, "--site-mix"))
        est = estimator.estimate(P, src)
        q = est.prior
        info.update(used="adaptive", estimate=dict(zip(names, map(float, q))), shift_from_source=est.shift,
                    iterations=est.iterations, converged=est.converged, estimator=estimator.to_dict())
    decided = adapt(P, src, q).argmax(1) if len(P) else np.zeros(0, np.int64)
    by_path = {r["path"]: int(d) for r, d in zip(scored, decided)}
    counts: dict[str, int] = {}
    changed = 0
    for r in recs:
        d = by_path.get(r["path"])
        r["adaptive_label"] = "" if d is None else d
        r["adaptive_class_name"] = "" if d is None else names[d] if jsonl else csv_cell(names[d])  # the rest: as read
        if d is not None:
            counts[names[d]] = counts.get(names[d], 0) + 1
            changed += str(d) != str(r.get("label"))
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w", encoding="utf-8", newline="") as fh:
        if jsonl:
            for r in recs:
                fh.write(json.dumps(r) + "\n")
        else:
            header = [f for f in fields if f not in ADAPTIVE_COLUMNS] + ADAPTIVE_COLUMNS
            fh.write(ResultsFile._csv_line(header))
            for r in recs:  # the cells as read (escaped once already), the same quoting as ResultsFile
                fh.write(ResultsFile._csv_line([r.get(c, "") for c in header]))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, out)
    info.update(adaptive_counts=counts, changed=changed)
    return info


def print_summary(s: dict[str, Any]) -> None:
    print(f"\n{s['images']} image(s): {s['scored_now']} scored now, {s['already_done']} already in {s['out']}; "
          f"{len(s['failed'])} failed, {len(s['skipped'])} other file(s) skipped")
    if not s.get("predicted_in_file", s["predicted"]):
        print("no image has a prediction yet, so there is no class mix to show")
    else:
        _print_class_mix(s)
    _print_problems(s)
    _print_adaptive(s)


def _print_class_mix(s: dict[str, Any]) -> None:
    if s["already_done"]:
        print(f"class mix over all {s['predicted_in_file']} predictions in the file, earlier runs' too:")
    print(f"{'class':40} {'predicted':>9} {'share':>7} {'training share':>15}")
    for m in s["class_mix"]:
        print(f"{m['class_name'][:40]:40} {m['predicted']:9d} {100 * m['predicted_share']:6.1f}% "
              + (f"{100 * m['training_share']:14.1f}%" if m["training_share"] is not None else f"{'unknown':>15}"))


def _print_problems(s: dict[str, Any]) -> None:
    for path, why in s["failed"][:20]:
        print(f"  failed: {path}: {why}")
    if len(s["failed"]) > 20:
        print(f"  ... and {len(s['failed']) - 20} more (see the error column)")
    if "dicom_written" in s:
        print(f"DICOM SR written for {s['dicom_written']} input(s); {len(s['dicom_failed'])} without one")
        for path, why in s["dicom_failed"][:10]:
            print(f"  no SR: {path}: {why}")
    why = s.get("skipped_why") or {}  # DICOMweb: what each instance is (a folder's skipped files are not images)
    for path in s["skipped"][:10]:
        print(f"  skipped: {why[path]}: {path}" if path in why else f"  skipped (not DICOM, PNG or JPEG): {path}")
    if (s.get("undated_studies") or {}).get("count"):
        from tafl.clients.dicomweb import undated_line

        print(undated_line(s["undated_studies"]))


def _print_adaptive(s: dict[str, Any]) -> None:
    pr = s.get("prior") or {}
    if pr.get("used") == "site":  # --prior site: say which mix decided, largest shares first
        top = sorted(pr["prior"].items(), key=lambda kv: -kv[1])[:5]
        print("decided for this site's own class mix (--prior site): "
              + ", ".join(f"{k[:20]} {100 * v:.1f}%" for k, v in top) + (" ..." if len(pr["prior"]) > 5 else ""))
    if pr.get("requested") == "adaptive":
        if pr.get("used") == "adaptive":
            print(f"\nadaptive prior from {pr['images']} images (total variation {pr['shift_from_source']:.3f} from "
                  f"the training prior; {pr['changed']} decisions changed):")
            for m in s["class_mix"]:
                print(f"  {m['class_name'][:40]:40} estimate {100 * pr['estimate'][m['class_name']]:6.1f}%  "
                      f"adaptive predictions {m.get('adaptive_predicted', 0)}")
        else:
            print(f"\nadaptive prior not used: {pr.get('fallback')}")
