"""`tafl score --dicom-out DIR`: a DICOM SR (and, with --dicom-heatmap, the heatmap as a secondary capture)
for every DICOM input of a scored folder, beside the CSV.

Files: DIR/<the input's path in the folder>.sr.dcm and .heatmap.dcm. Each is written to a temporary name and
renamed, before the input's row is appended to the results file, so `--resume` (which skips the rows
already in the file) never leaves an input without its SR, and a kill leaves no half-written object.

In-process (--package) the SR is built from the row's own facts (class, probability, each expert's vote)
and the package's identity; a heatmap runs the package once more on that file. Building one SR with highdicom
is tens of milliseconds of pure Python, several times the scoring of a small image, so a job of many inputs
builds them in min(2, cores) processes (tafl.imaging.pool.DecodePool: a deadline; a process that dies is
replaced) while this one scores the next inputs; rows still reach the results file in order, each after its SR.
Through a service (--url) each DICOM input is sent once more with format=sr, and the service's SR (and SC)
are stored as they come.
An input whose SR cannot be made (a DICOM without the UIDs an SR must reference) keeps its row and is listed
in the summary's `dicom_failed`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import threading
from pathlib import Path
from typing import Any

from tafl.errors import ConfigError, TaflError
from tafl.imaging import dicom_sr


def _atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class DicomWriter:
    """Builds each DICOM input's SR (and SC) and, with an `out_dir`, writes them there (`start`, then `finish`);
    without one (`tafl score --dicomweb --store-sr`) `submit` only builds them, for the caller to file."""

    def __init__(self, out_dir: str | Path | None, folder: Path | None, scorer: Any, heatmap: bool = False,
                 processes: int = 0, not_assessed: bool = False):
        self.out = None if out_dir is None else Path(out_dir)
        self.folder, self.scorer, self.heatmap = folder, scorer, heatmap
        # a row outside the model's domain: no SR (default), or one that says "not assessed"
        self.not_assessed = not_assessed
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
        self.written = 0
        self.failed: list[tuple[str, str]] = []
        pkg = getattr(scorer, "pkg", None)
        if pkg is None and getattr(scorer, "client", None) is None:
            raise ConfigError("--dicom-out works with in-process (--package) or service (--url) scoring")
        self.algo = (dicom_sr.Algorithm.from_metadata(pkg.meta, pkg.files.get("model.onnx", ""))
                     if pkg is not None else None)
        self.pool = None
        if processes > 0 and self.algo is not None:  # through --url the service builds them
            from tafl.imaging.pool import DecodePool

            self.pool = DecodePool(processes, deadline=60.0)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.window = 4 * max(1, processes)  # SRs in the making at once, before the oldest is waited for
        # at most `window` queued in the processes: the pool's deadline counts from the submission, so a long
        # queue (a DICOMweb batch of hundreds) must not eat it; a caller past the window waits here
        self._slots = threading.BoundedSemaphore(self.window)

    def targets(self, rel: str) -> tuple[Path, Path]:
        base = self.out / rel
        return base.with_name(base.name + ".sr.dcm"), base.with_name(base.name + ".heatmap.dcm")

    def start(self, row: Any) -> concurrent.futures.Future | None:
        """Start making the SR of one scored row (None: not a DICOM input, or not scored); `finish` writes it."""
        from tafl.clients.results import sniff

        src = self.folder / row.path
        if not self.wants(row) or sniff(src) != "dicom":
            return None
        try:
            data = src.read_bytes()
        except OSError as exc:
            return _failed(exc)
        return self.submit(data, row)

    def wants(self, row: Any) -> bool:
        """Whether a scored row gets an SR: not a failed row, and outside the model's domain only when the site asked
        for a "not assessed" SR (a finding is never filed for it)."""
        return not row.error and (not row.abstained or self.not_assessed)

    def finish(self, row: Any, made: concurrent.futures.Future | None) -> None:
        """Wait for the row's SR (and SC) and write them, the SC first (the SR references it); a failure is listed."""
        if made is None:
            return
        try:
            parts = made.result()
        except (TaflError, OSError) as exc:
            self.failed.append((row.path, getattr(exc, "message", None) or str(exc)[:200]))
            return
        sr_path, sc_path = self.targets(row.path)
        if len(parts) > 1:
            _atomic(sc_path, parts[1])
        _atomic(sr_path, parts[0])
        self.written += 1

    def submit(self, data: bytes, row: Any) -> concurrent.futures.Future:
        """The SR's Part 10 bytes, then the heatmap SC's when asked, as a future (it raises TaflError when none can
        be made). In-process the heatmap runs here and the SR is built in the writer's processes, when it has
        them; through the service the call is made here."""
        try:
            if self.algo is None:
                return _done(self._remote(data, row))
            build = self._local(data, row)
        except (TaflError, OSError) as exc:
            return _failed(exc)
        if self.pool is None:
            try:
                return _done(build())
            except TaflError as exc:
                return _failed(exc)
        self._slots.acquire()
        made = asyncio.run_coroutine_threadsafe(
            self.pool.call(build, late=dicom_sr.BUILD_LATE, crashed=dicom_sr.BUILD_CRASHED), self._running_loop())
        made.add_done_callback(lambda _: self._slots.release())
        return made

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:  # the pool's calls are coroutines: one loop in a thread of its own runs them all
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="tafl-sr-builds", daemon=True)
            self._thread.start()
        return self._loop

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()
            self._loop = None

    def _local(self, data: bytes, row: Any) -> functools.partial:
        """What builds the SR (and SC): a picklable call, with the heatmap (an ONNX run) already made here."""
        names = self.algo.class_names
        idx = {n: i for i, n in enumerate(names)}
        if row.abstained:
            return functools.partial(dicom_sr.encoded, dicom_sr.read_header(data),
                                     dicom_sr.Finding(None, None, [], None, dicom_sr.NOT_ASSESSED), self.algo, None)
        finding = dicom_sr.Finding(int(row.label), float(row.probability),
                                   [(e, idx[c], None) for e, c in row.experts.items() if c in idx],
                                   plausible=None if row.prediction_set is None else
                                   [idx[c] for c in row.prediction_set if c in idx], coverage=row.set_coverage)
        rgb = None
        if self.heatmap:
            from tafl.imaging import decode_image
            from tafl.imaging.heatmap import overlay

            decoded = decode_image(data)
            pkg = self.scorer.pkg
            out = pkg.run(self.scorer.session, pkg.preprocess(decoded.frames[:1]), self.scorer.ratio)
            frame = decoded.frames[0]
            rgb = overlay(frame, out["heatmap"][0])
            if len(decoded.frames) > 1:
                finding.frame = 1
        return functools.partial(dicom_sr.encoded, dicom_sr.read_header(data), finding, self.algo, rgb)

    def _remote(self, data: bytes, row: Any) -> list[bytes]:
        client = self.scorer.client
        fields = {"format": "sr", "heatmap": "true" if self.heatmap and not row.abstained else "false"}
        if row.abstained:
            fields["not_assessed"] = "true"
        if self.scorer.model:
            fields["model"] = self.scorer.model
        # a refusal (ServiceCallError, a TaflError) is this file's failure, listed in the summary
        r = client._call("POST", "/predict", files={"file": ("upload", data, "application/dicom")}, data=fields)
        ctype = r.headers.get("content-type", "")
        if ctype.startswith("multipart/related"):
            return _split(r.content, ctype)
        return [r.content]


def processes_for(n: int) -> int:
    """SR-building processes for a job of `n` inputs: min(2, cores) from 16 inputs on (fewer do not repay the
    seconds a process takes to start and load highdicom), none on one core."""
    cores = os.cpu_count() or 1
    return min(2, cores) if n >= 16 and cores >= 2 else 0


def _done(value: Any) -> concurrent.futures.Future:
    f: concurrent.futures.Future = concurrent.futures.Future()
    f.set_result(value)
    return f


def _failed(exc: BaseException) -> concurrent.futures.Future:
    f: concurrent.futures.Future = concurrent.futures.Future()
    f.set_exception(exc)
    return f


def _split(body: bytes, content_type: str) -> list[bytes]:
    boundary = content_type.split("boundary=")[1].split(";")[0].strip().strip('"').encode()
    out = []
    for chunk in body.split(b"--" + boundary)[1:]:
        if chunk.startswith(b"--"):
            break
        _, _, payload = chunk.partition(b"\r\n\r\n")
        out.append(payload[:-2] if payload.endswith(b"\r\n") else payload)
    return out
