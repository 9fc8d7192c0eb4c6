"""Batch scoring of an image folder: `tafl score FOLDER --out results.csv|.jsonl (--url URL | --package PKG)`.

The folder is walked recursively; DICOM (by its "DICM" marker or a .dcm name), PNG and JPEG (by
their magic bytes) are scored, anything else is listed as skipped. Remote scoring keeps a
bounded number of requests in flight through the retrying `Client`; in-process scoring decodes
with the service's own decoder and runs the package in ONNX Runtime in batches, so both give
the same labels. Each result is one line appended with a single write and flushed, so the file
is valid at every instant; `--resume` repairs a torn last line, skips every path already in the
file and appends the rest. The summary compares the predicted class mix with the training mix.
"""

from __future__ import annotations

import concurrent.futures
import csv
import io
import json
import logging
import os
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


class ResultsFile:
    """Append-only CSV or JSONL whose every line is complete (one write per row, then flush)."""

    def __init__(self, path: Path, expert_names: list[str], *, resume: bool, force: bool):
        self.path, self.expert_names = path, expert_names
        self.jsonl = path.suffix.lower() == ".jsonl"
        if path.suffix.lower() not in (".csv", ".jsonl"):
            raise ConfigError(f"--out {path}: use a .csv or .jsonl file")
        self.columns = (["path", "label", "class_name", "probability"] + [f"expert_{e}" for e in expert_names]
                        + ["model", "model_version", "error"])
        self.done: set[str] = set()
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
                    self.done.add(json.loads(line)["path"])
        else:
            reader = csv.DictReader(io.StringIO(text))
            if reader.fieldnames and reader.fieldnames != self.columns:
                raise ConfigError(f"{self.path} has columns {reader.fieldnames}; this model writes {self.columns} "
                                  "(a different model?); use another --out")
            self.done = {r["path"] for r in reader}

    @staticmethod
    def _csv_line(values: list[Any]) -> str:
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerow(values)
        return buf.getvalue()

    def _write_line(self, line: str) -> None:
        os.write(self.fd, line.encode("utf-8"))  # one write of a whole line: O_APPEND keeps it intact

    def write(self, row: Row) -> None:
        experts = {f"expert_{e}": row.experts.get(e, "") for e in self.expert_names}
        rec = {"path": row.path, "label": row.label, "class_name": row.class_name, "probability": row.probability,
               **experts, "model": row.model, "model_version": row.model_version, "error": row.error}
        if self.jsonl:
            self._write_line(json.dumps(rec) + "\n")
        else:
            self._write_line(self._csv_line(["" if rec[c] is None else rec[c] for c in self.columns]))
        self.done.add(row.path)

    def close(self) -> None:
        os.fsync(self.fd)
        os.close(self.fd)


# ------------------------------------------------------------------ scorers
class RemoteScorer:
    """Through the service: batches of images per request, a bounded number of requests in flight."""

    def __init__(self, url: str, token: str | None, model: str | None, concurrency: int, batch_size: int = 16):
        from tafl.clients.client import Client

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
                answers = self.client.predict_batch([d for _, d in readable], model=self.model)
            except ServiceCallError as exc:
                if exc.status == 0 or exc.status >= 500 or exc.status in (401, 404):
                    raise  # the service, not the files, failed: stop the job (the file stays resumable)
                answers = [exc] * len(readable)
            for (p, _), a in zip(readable, answers):
                if isinstance(a, ServiceCallError):
                    rows[p] = Row(rel(p), error=f"{a.status} {a.code}: {a.detail}")
                else:
                    rows[p] = Row(rel(p), a.label, a.class_name, a.probability,
                                  {e.name: e.class_name for e in a.experts}, a.model["name"], a.model["version"])
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

    def __init__(self, package: str, batch_size: int, threads: int | None = None):
        from tafl.packaging import load_package

        self.pkg = load_package(package)
        self.session = self.pkg.session(["CPUExecutionProvider"], threads)
        self.meta, self.batch_size = self.pkg.metadata, batch_size

    def score(self, paths: list[Path], rel: Callable[[Path], str]) -> Iterator[Row]:
        from tafl.serving.decode import decode_image

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
                out = self.pkg.run(self.session, pre.normalize(np.stack(arrays)))
                for i, p in enumerate(ok):
                    label = int(out["label"][i])
                    ex = {}
                    if "expert_labels" in out:
                        ex = {e: names[int(out["expert_labels"][i, j])] for j, e in enumerate(experts)}
                    rows[p] = Row(rel(p), label, names[label], float(out["probs"][i, label]), ex, self.pkg.name,
                                  self.pkg.version)
            for p in chunk:
                yield rows[p]

    def close(self) -> None:
        pass


# ------------------------------------------------------------------ the job
def score_folder(folder: str | Path, out: str | Path, *, url: str | None = None, package: str | None = None,
                 token: str | None = None, model: str | None = None, concurrency: int = 4, batch_size: int = 16,
                 resume: bool = False, force: bool = False, progress: bool | None = None,
                 on_row: Callable[[Row], None] | None = None) -> dict[str, Any]:
    folder, out = Path(folder), Path(out)
    if (url is None) == (package is None):
        raise ConfigError("give exactly one of --url URL (remote scoring) or --package PKG_DIR (in-process)")
    if not folder.is_dir():
        raise DataError(f"{folder} is not a folder")
    images, skipped = walk(folder)
    if not images:
        raise DataError(f"{folder} holds no DICOM, PNG or JPEG files ({len(skipped)} other file(s) skipped)")
    scorer: RemoteScorer | LocalScorer = (RemoteScorer(url, token, model, concurrency, min(batch_size, 64)) if url
                                          else LocalScorer(package, batch_size))
    experts = [e["name"] for e in scorer.meta.get("experts", [])]
    results = ResultsFile(out, experts, resume=resume, force=force)

    def rel(p: Path) -> str:
        return p.relative_to(folder).as_posix()

    todo = [p for p in images if rel(p) not in results.done]
    counts: dict[str, int] = {}
    failed: list[tuple[str, str]] = []
    from tqdm.auto import tqdm

    try:
        with tqdm(total=len(images), initial=len(images) - len(todo), unit="img", desc="scoring",
                  disable=(not progress) if progress is not None else None, dynamic_ncols=True) as bar:
            for row in scorer.score(todo, rel):
                results.write(row)
                if row.error:
                    failed.append((row.path, row.error))
                else:
                    counts[row.class_name] = counts.get(row.class_name, 0) + 1
                if on_row:
                    on_row(row)
                bar.update(1)
    finally:
        results.close()
        scorer.close()
    names = scorer.meta["class_names"]
    train = scorer.meta.get("training", {}).get("train_class_counts") or [0] * len(names)
    total_train = sum(train) or 1
    scored = sum(counts.values())
    mix = [{"class_name": n, "predicted": counts.get(n, 0),
            "predicted_share": counts.get(n, 0) / scored if scored else 0.0,
            "training_share": t / total_train} for n, t in zip(names, train)]
    return {"images": len(images), "scored_now": len(todo), "already_done": len(images) - len(todo),
            "predicted": scored, "failed": failed, "skipped": [rel(p) for p in skipped], "class_mix": mix,
            "out": str(out)}


def print_summary(s: dict[str, Any]) -> None:
    print(f"\n{s['images']} image(s): {s['scored_now']} scored now, {s['already_done']} already in {s['out']}; "
          f"{len(s['failed'])} failed, {len(s['skipped'])} other file(s) skipped")
    print(f"{'class':40} {'predicted':>9} {'share':>7} {'training share':>15}")
    for m in s["class_mix"]:
        print(f"{m['class_name'][:40]:40} {m['predicted']:9d} {100 * m['predicted_share']:6.1f}% "
              f"{100 * m['training_share']:14.1f}%")
    for path, why in s["failed"][:20]:
        print(f"  failed: {path}: {why}")
    if len(s["failed"]) > 20:
        print(f"  ... and {len(s['failed']) - 20} more (see the error column)")
    for path in s["skipped"][:10]:
        print(f"  skipped (not DICOM, PNG or JPEG): {path}")
