"""A DICOM Storage SCP that classifies what a PACS or router sends it: `tafl dicom-listen`.

    sender --C-STORE--> listener: spool file (fsync) --ack 0x0000--> worker: decode, ONNX Runtime,
        SR (+ heatmap SC) --C-STORE SCU (retried)--> destination AE   (or: files in a folder)

Durable acknowledgment: an instance is written to the spool folder and fsynced before the C-STORE is
answered with Success, and its spool file is removed only after its SR reached the destination. A
listener killed mid-burst therefore loses nothing: what it acknowledged is in the spool and is processed
when it starts again; what it did not acknowledge the sender still holds and retries. SR and SC UIDs are
derived from the source instance and the model (tafl.imaging.dicom_sr), so an SR delivered just before a
crash and delivered again after the restart replaces itself at the destination instead of doubling.

Back-pressure: at most `max_queue` instances (default 1000) wait in the spool; past that a C-STORE is answered
0xA700 (Refused: out of resources) and a warning is logged. A sender may retry later or may not: Orthanc's store
job logs the refusal and goes on, the instance stays unclassified. The spool is on disk, so the default is sized
for a large study sent at once (about 0.5 GB of CT slices), not for memory. Non-image objects (SR, presentation
states, ...) are acknowledged and not classified.

Size: pynetdicom gathers a message's P-DATA in memory before the C-STORE handler sees it, so the
listener counts each association's bytes as they arrive (EVT_DATA_RECV, one PDU at a time) and aborts
the association (A-ABORT) once a message in flight passes TAFL_MAX_UPLOAD_MB plus 1 MiB of headers:
memory stays bounded by the cap per association (at most 16), whatever a sender streams.

The same code path as the service: the upload decoder with the service's limits (TAFL_MAX_UPLOAD_MB,
TAFL_MAX_PIXELS, TAFL_MAX_FRAMES; compressed DICOM in decoder processes, tafl.serving.decoding), the
package's preprocessing, its ONNX graph, and the service's per-frame result (frame 0 is reported, as in
the JSON answer). An instance that the service would refuse (4xx) is moved to spool/failed/, and the
service's reason (the 422 body's message) is logged and written beside it, as `failed/NAME.dcm.reason.json`:
{"status": 422, "error": "UnprocessableImage", "reason": "the DICOM pixel data ... could not be decoded, ...",
"instance": "<uid hash>", "time": "2025-01-31T12:00:00Z"} (UTC), one key a line. An image the package's in-domain
detector puts outside the model's domain gets no finding: it goes to failed/ with the reason (status 422,
OutsideDomain), or, with `not_assessed_sr`, an SR that says "Not assessed: outside the model's domain" is delivered.

Spool: `incoming/` (a C-STORE being written), `queue/` (acknowledged, waiting), `outgoing/` (an SR or SC
being sent: removed once the destination answered Success, or when its C-STORE gave up; the spool file it
came from stays until then), `failed/` (refused instances and their reasons).

Stopping: SIGTERM or SIGINT stops accepting associations and drains the queue for up to DRAIN_SECONDS, a
second signal stops at once; the log says how many instances it is draining, then what this run classified,
delivered, failed and skipped, and how many stay in the spool for the next start (nothing is lost: a
supervisor's SIGKILL during the drain is a crash, recovered as above).

Logs carry no patient data: per instance only the first 12 hex digits of the sha256 of its SOP Instance
UID (`tafl.imaging.dicom_sr.uid_hash`), the predicted class and timings; per association the calling AE
title and address. pydicom's, highdicom's and pynetdicom's own messages (which can quote tag values) are
kept at WARNING or above and never include datasets.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import itertools
import json
import logging
import os
import queue
import socket
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tafl.errors import ConfigError, OutsideDomain, TaflError
from tafl.imaging import dicom_sr
from tafl.serving.results import frame_result, overlay_frame

log = logging.getLogger("tafl.dicom")

SUCCESS, OUT_OF_RESOURCES, CANNOT_UNDERSTAND = 0x0000, 0xA700, 0xC000
# how long SIGTERM waits for the queue: under a supervisor's grace (Kubernetes 30 s, systemd 90 s); a SIGKILL
# after it is harmless, what was acknowledged is in the spool
DRAIN_SECONDS = 25.0


@dataclass
class Destination:
    """Where SRs go: a storage SCP (`AE@host:port`) or a folder."""

    ae_title: str | None = None
    host: str | None = None
    port: int | None = None
    folder: Path | None = None

    @classmethod
    def parse(cls, dest: str | None, folder: str | Path | None) -> Destination:
        if (dest is None) == (folder is None):
            raise ConfigError("give exactly one of --dest AE@HOST:PORT (a storage SCP) or --out-dir DIR")
        if folder is not None:
            return cls(folder=Path(folder))
        ae, at, addr = str(dest).rpartition("@")
        host, colon, port = addr.rpartition(":")
        if not at or not colon or not ae or not port.isdigit():
            raise ConfigError(f"--dest {dest!r}: write it as AE_TITLE@HOST:PORT, e.g. PACS@10.0.0.5:104")
        return cls(ae_title=ae, host=host, port=int(port))


class Deliverer:
    """Stores SR and SC files: a C-STORE SCU over one kept association (re-opened on failure), or a folder.

    An object given as Part 10 bytes is sent as it is, from a file in `scratch` (pynetdicom's chunked send:
    neither decoded nor encoded again here); a pydicom Dataset is encoded by pynetdicom."""

    def __init__(self, dest: Destination, calling_ae: str, retries: int = 5, backoff: float = 0.5,
                 scratch: Path | None = None, halt: threading.Event | None = None):
        self.dest, self.calling_ae, self.retries, self.backoff = dest, calling_ae, retries, backoff
        self.halt = halt or threading.Event()  # set: the listener is stopping, no further retries
        self._assoc = None
        if dest.folder is not None:
            dest.folder.mkdir(parents=True, exist_ok=True)
        self.scratch = scratch
        if scratch is not None:
            scratch.mkdir(parents=True, exist_ok=True)

    def _open(self):
        from pynetdicom import AE, _config
        from pydicom.uid import ExplicitVRLittleEndian, ImplicitVRLittleEndian

        _config.STORE_SEND_CHUNKED_DATASET = True  # a file path is sent as stored (Datasets are not affected)
        ae = AE(ae_title=self.calling_ae)
        for sop in (dicom_sr.SR_STORAGE, dicom_sr.SC_STORAGE):  # one context per syntax: a peer may accept both
            ae.add_requested_context(sop, ExplicitVRLittleEndian)
            ae.add_requested_context(sop, ImplicitVRLittleEndian)
        ae.acse_timeout = ae.dimse_timeout = ae.network_timeout = 30
        from pynetdicom import evt

        assoc = ae.associate(self.dest.host, self.dest.port, ae_title=self.dest.ae_title,
                             evt_handlers=[(evt.EVT_CONN_OPEN, no_delay)])
        if not assoc.is_established:
            raise ConnectionError("the destination refused or did not answer the association")
        return assoc

    def _files(self, objects: list[Any]) -> list[Any]:
        """What send_c_store takes: a Dataset as it is, Part 10 bytes as a file in the scratch folder."""
        if not any(isinstance(x, bytes) for x in objects):
            return objects
        if self.scratch is None:
            import tempfile

            self.scratch = Path(tempfile.mkdtemp(prefix="tafl-deliver-"))
        out = []
        for i, x in enumerate(objects):
            if isinstance(x, bytes):
                path = self.scratch / f"{threading.get_ident()}-{i}.dcm"
                path.write_bytes(x)
                x = path
            out.append(x)
        return out

    def _as_accepted(self, obj: Any) -> Any:
        """A file whose syntax (explicit VR little endian, as tafl writes them) the peer accepted is sent as it
        is; for a peer that took only implicit VR, the file is read back so that pynetdicom converts it."""
        if not isinstance(obj, Path):
            return obj
        import pydicom
        from pydicom.filereader import read_file_meta_info

        meta = read_file_meta_info(obj)
        if any(c.abstract_syntax == meta.MediaStorageSOPClassUID and c.transfer_syntax[0] == meta.TransferSyntaxUID
               for c in self._assoc.accepted_contexts):
            return obj
        return pydicom.dcmread(obj)

    def deliver(self, objects: list[Any]) -> None:
        """Each object (pydicom Datasets or Part 10 bytes, the SC before the SR that references it), or raise
        after retries."""
        if self.dest.folder is not None:
            for ds in objects:
                data = ds if isinstance(ds, bytes) else dicom_sr.to_bytes(ds)
                uid = ds.SOPInstanceUID if not isinstance(ds, bytes) else dicom_sr.read_header(data).SOPInstanceUID
                path = self.dest.folder / f"{uid}.dcm"
                tmp = path.with_suffix(".part")
                tmp.write_bytes(data)
                os.replace(tmp, path)
            return
        # (what is sent, the scratch file written for it or None): an object the peer acknowledged is not sent
        # again on a retry, and its scratch file goes at once, the peer holds it now
        todo = [(x, x if isinstance(o, bytes) else None) for o, x in zip(objects, self._files(objects))]
        last = ""
        try:
            for attempt in range(self.retries + 1):
                try:
                    if self._assoc is None or not self._assoc.is_established:
                        self._assoc = self._open()
                    while todo:
                        status = self._assoc.send_c_store(self._as_accepted(todo[0][0]))
                        code = getattr(status, "Status", None)
                        if code != SUCCESS:
                            raise ConnectionError(f"the destination answered C-STORE with status "
                                                  f"{'none' if code is None else hex(code)}")
                        _, scratch = todo.pop(0)
                        if scratch is not None:
                            scratch.unlink(missing_ok=True)
                    return
                except (ConnectionError, OSError, RuntimeError, ValueError) as exc:
                    last = str(exc)[:120]
                    self.close()
                    if self.halt.wait(min(self.backoff * 2 ** attempt, 10.0)):
                        break
            raise ConnectionError(f"SR not delivered after {attempt + 1} attempts: {last}")
        finally:
            # given up (or stopping): the caller still holds the bytes and writes them again for its next try,
            # and the spool file they were built from stays, so no copy is needed here
            for _, scratch in todo:
                if scratch is not None:
                    scratch.unlink(missing_ok=True)

    def close(self) -> None:
        if self._assoc is not None:
            try:
                self._assoc.release()
            except Exception:  # noqa: BLE001 - already gone
                pass
            self._assoc = None


class Listener:
    """The Storage SCP, its spool and its worker thread(s)."""

    def __init__(self, package: str | Path, destination: Destination, *, ae_title: str = "TAFL",
                 host: str = "127.0.0.1", port: int = 11112, spool: str | Path = "tafl-dicom-spool",
                 heatmap: bool = False, max_queue: int = 1000, workers: int = 2, threads: int | None = None,
                 settings: Any = None, deliver_retries: int = 5, retry_pause: float = 5.0,
                 not_assessed_sr: bool = False):
        from tafl.packaging import load_package
        from tafl.serving.settings import Settings
        from tafl.serving.decoding import DecodePool

        self.settings = settings or Settings.from_env(workers=1)  # TAFL_WORKERS is the service's, not ours
        self.pkg = load_package(package)
        # one image per run, between pydicom, pynetdicom and the SR processes: ONNX Runtime's threads spinning after
        # each run took 24 ms of CPU an instance on 2 cores, a third of the listener's (docs/results.md, "Spinning threads in the listener")
        self.session = self.pkg.session(["CPUExecutionProvider"], threads, spin=False)
        self.algo = dicom_sr.Algorithm.from_metadata(self.pkg.meta, self.pkg.files.get("model.onnx", ""))
        self.destination, self.ae_title, self.host, self.port = destination, ae_title, host, port
        self.heatmap, self.max_queue, self.workers = heatmap, max(1, max_queue), max(1, workers)
        self.not_assessed_sr = not_assessed_sr  # an image outside the model's domain: an SR saying "not assessed"
        from tafl.settings import env_str

        site = env_str("TAFL_SITE")  # the training site whose own prediction-set thresholds it files
        self.site = site if site and self.pkg.meta.sets.fitted and site in self.pkg.meta.sets.sites else None
        self.spool = Path(spool)
        self.deliver_retries, self.retry_pause = deliver_retries, retry_pause
        self.incoming, self.queue_dir, self.failed, self.outgoing = (self.spool / n for n in
                                                                     ("incoming", "queue", "failed", "outgoing"))
        for d in (self.incoming, self.queue_dir, self.failed, self.outgoing):
            d.mkdir(parents=True, exist_ok=True)
        s = self.settings
        self.limits = {"max_bytes": s.max_upload_bytes, "max_pixels": min(s.max_pixels, s.max_request_pixels),
                       "max_frames": min(s.max_frames, s.max_request_frames)}
        self.pool = DecodePool(s.decode_processes, deadline=max(1.0, s.timeout_s / 2))
        self._q: queue.Queue[Path | None] = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0
        self._seq = itertools.count()
        self._threads: list[threading.Thread] = []
        self._server = None
        self._halt = threading.Event()  # stop now: workers take no further instance, deliveries stop retrying
        self.stats = {"received": 0, "refused_busy": 0, "refused_too_large": 0, "classified": 0, "delivered": 0,
                      "skipped": 0, "failed": 0}
        self.max_message_bytes = s.max_upload_bytes + (1 << 20)  # the dataset, and its command set and PDU headers
        self._inflight: dict[int, int] = {}  # id(association) -> bytes of the message being received
        _quiet_libraries()

    # ---------------------------------------------------------------- the SCP side
    def _on_store(self, event) -> int:
        with self._lock:
            if self._pending >= self.max_queue:
                self.stats["refused_busy"] += 1
                refused = self.stats["refused_busy"]
            else:
                refused = 0
                self._pending += 1
        if refused:
            a = event.assoc.requestor
            log.warning("C-STORE from %s (%s:%s) refused (0xA700): %d instances already wait in the spool "
                        "(--max-queue); %d refused since the start. Resend what the sender did not retry.",
                        a.ae_title, a.address, a.port, self.max_queue, refused)
            return OUT_OF_RESOURCES
        try:
            name = f"{time.time_ns():020d}-{next(self._seq):08d}.dcm"
            tmp = self.incoming / name
            with open(tmp, "wb") as fh:
                fh.write(event.encoded_dataset())  # the bytes as received, with a file meta header: no re-encoding
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.queue_dir / name)
            _fsync_dir(self.queue_dir)
        except Exception as exc:  # noqa: BLE001 - a full disk, an unreadable dataset: not acknowledged
            with self._lock:
                self._pending -= 1
            log.error("C-STORE not accepted: the instance could not be spooled (%s)", type(exc).__name__)
            return OUT_OF_RESOURCES if isinstance(exc, OSError) else CANNOT_UNDERSTAND
        with self._lock:
            self.stats["received"] += 1
        self._q.put(self.queue_dir / name)
        return SUCCESS

    @staticmethod
    def _on_echo(event) -> int:
        return SUCCESS

    def _on_data(self, event) -> None:
        """Every PDU received: add it to its association's message in flight; past the cap, abort."""
        key = id(event.assoc)
        with self._lock:
            total = self._inflight.get(key, 0) + len(event.data)
            self._inflight[key] = total
            over = total > self.max_message_bytes >= total - len(event.data)  # the PDU that crossed the cap
            if over:
                self.stats["refused_too_large"] += 1
        if over:
            a = event.assoc.requestor
            log.warning("association from %s (%s:%s) aborted: a message passed %d MiB (TAFL_MAX_UPLOAD_MB) before it "
                        "ended", a.ae_title, a.address, a.port, self.max_message_bytes >> 20)
            event.assoc.abort(block=False)

    def _on_message(self, event) -> None:
        """A whole DIMSE message decoded: the next one starts from zero."""
        with self._lock:
            self._inflight[id(event.assoc)] = 0

    def _on_closed(self, event) -> None:
        with self._lock:
            self._inflight.pop(id(event.assoc), None)

    @staticmethod
    def _on_assoc(event) -> None:
        a = event.assoc.requestor
        log.info("association %s from %s (%s:%s)", event.event.name, a.ae_title, a.address, a.port)

    @staticmethod
    def _on_abort(event) -> None:
        a = event.assoc.requestor
        log.warning("association aborted by %s (%s:%s)", a.ae_title, a.address, a.port)

    # ---------------------------------------------------------------- the worker side
    def _work(self) -> None:
        loop = asyncio.new_event_loop()
        deliverer = Deliverer(self.destination, self.ae_title, retries=self.deliver_retries, scratch=self.outgoing,
                              halt=self._halt)
        try:
            while True:
                path = self._q.get()
                if path is None or self._halt.is_set():  # a halted worker leaves the rest in the spool
                    return
                try:
                    self._process(path, loop, deliverer)
                finally:
                    with self._lock:
                        self._pending -= 1
        finally:
            deliverer.close()
            loop.close()

    def _process(self, path: Path, loop: asyncio.AbstractEventLoop, deliverer: Deliverer) -> None:
        from tafl.serving.decoding import decode_upload

        t0 = time.perf_counter()
        data = path.read_bytes()
        try:
            source = dicom_sr.read_header(data)
        except TaflError as exc:
            return self._fail(path, "?", exc)
        uid = dicom_sr.uid_hash(source.SOPInstanceUID)
        try:
            decoded = loop.run_until_complete(decode_upload(self.pool, data, **self.limits))
        except TaflError as exc:
            # what the service classifies is classified (a segmentation with pixels too); a non-image object
            # (SR, presentation state, RT plan, ...) that has nothing to decode is acknowledged and skipped
            if str(source.get("SOPClassUID", "")).startswith(dicom_sr.NOT_IMAGES):
                log.info("instance %s: not an image object; acknowledged, not classified", uid)
                self.stats["skipped"] += 1
                path.unlink(missing_ok=True)
                return None
            return self._fail(path, uid, exc)
        try:
            self.pkg.check_domain(decoded)  # outside the trained domain: kept in failed/ with the reason, no SR
        except TaflError as exc:
            return self._fail(path, uid, exc)
        try:
            out = self.pkg.run(self.session, self.pkg.preprocess(decoded.frames))
            result = frame_result(self.pkg, out, 0, site=self.site)
            if result["abstained"] and not self.not_assessed_sr:  # no finding filed: failed/ with the reason
                return self._fail(path, uid, OutsideDomain(result["reason"]))
            rgb = None
            if self.heatmap and not result["abstained"]:
                from tafl.imaging.heatmap import overlay

                rgb = overlay(overlay_frame(decoded.frames[0]), out["heatmap"][0])
            finding = dicom_sr.Finding.from_result(result, self.algo.class_names,
                                                   1 if len(decoded.frames) > 1 else None)
            # built in a decoder process: highdicom is pure Python that would hold this process's GIL, which the
            # SCP's threads need to receive the next instances
            parts = loop.run_until_complete(self.pool.call(
                functools.partial(dicom_sr.encoded, source, finding, self.algo, rgb),
                late=dicom_sr.BUILD_LATE, crashed=dicom_sr.BUILD_CRASHED))
        except TaflError as exc:
            return self._fail(path, uid, exc)
        self.stats["classified"] += 1
        t1 = time.perf_counter()
        while True:  # the spool file stays until the SR is delivered: a destination that is down is waited for
            try:
                deliverer.deliver(parts[::-1])  # the SC (when there is one) before the SR that references it
                break
            except ConnectionError as exc:
                if self._halt.is_set():
                    log.warning("instance %s: %s; left in the spool for the next start", uid, exc)
                    return None
                log.error("instance %s: %s; retrying in %g s (kept in the spool)", uid, exc, self.retry_pause)
                if self._halt.wait(self.retry_pause):
                    log.warning("instance %s: not delivered; left in the spool for the next start", uid)
                    return None
        path.unlink(missing_ok=True)
        self.stats["delivered"] += 1
        what = ("not assessed (outside the model's domain)" if result["abstained"] else
                f"{result['class_name']} (p={result['probability']:.3f})")
        log.info("instance %s: %s, SR delivered; %.0f ms classify, %.0f ms deliver", uid, what, 1000 * (t1 - t0),
                 1000 * (time.perf_counter() - t1))

    def _fail(self, path: Path, uid: str, exc: TaflError) -> None:
        """Keep a refused instance in spool/failed with the reason the service would have answered: the message
        is meant for a person (tafl.errors) and quotes no tag values, so it goes in the log too."""
        self.stats["failed"] += 1
        status = getattr(exc, "status", 400)
        reason = {"status": status, "error": type(exc).__name__, "reason": exc.message, "instance": uid,
                  "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
                  .replace("+00:00", "Z")}
        note = self.failed / f"{path.name}.reason.json"
        tmp = note.with_suffix(".part")
        tmp.write_text(json.dumps(reason, indent=1) + "\n")
        os.replace(tmp, note)  # before the instance: a kept file always has its reason beside it
        os.replace(path, self.failed / path.name)
        log.warning("instance %s: not classified (%s %s: %s); kept as %s/%s", uid, status, type(exc).__name__,
                    exc.message, self.failed.name, path.name)

    # ---------------------------------------------------------------- lifecycle
    def recover(self) -> int:
        """Queue what an earlier run acknowledged but did not finish; drop half-written files it never acked."""
        for part in [*self.incoming.iterdir(), *self.outgoing.iterdir()]:  # outgoing: SRs being sent, rebuilt
            part.unlink(missing_ok=True)
        left = sorted(self.queue_dir.glob("*.dcm"))
        with self._lock:
            self._pending += len(left)
        for p in left:
            self._q.put(p)
        if left:
            log.info("%d instance(s) acknowledged before the last stop are queued again", len(left))
        return len(left)

    def start(self) -> None:
        from pynetdicom import ALL_TRANSFER_SYNTAXES, AE, evt
        from pynetdicom.sop_class import Verification

        self.pool.warm()
        self.pool.warm_with(dicom_sr.warm)
        self.recover()
        for _ in range(self.workers):
            t = threading.Thread(target=self._work, name="tafl-dicom-worker", daemon=True)
            t.start()
            self._threads.append(t)
        ae = AE(ae_title=self.ae_title)
        for sop in storage_classes():
            ae.add_supported_context(sop, ALL_TRANSFER_SYNTAXES)
        ae.add_supported_context(Verification)
        ae.maximum_associations = 16
        handlers = [(evt.EVT_C_STORE, self._on_store), (evt.EVT_C_ECHO, self._on_echo),
                    (evt.EVT_ACCEPTED, self._on_assoc), (evt.EVT_REJECTED, self._on_assoc),
                    (evt.EVT_ABORTED, self._on_abort), (evt.EVT_DATA_RECV, self._on_data),
                    (evt.EVT_DIMSE_RECV, self._on_message), (evt.EVT_CONN_CLOSE, self._on_closed),
                    (evt.EVT_CONN_OPEN, no_delay)]
        try:
            self._server = ae.start_server((self.host, self.port), block=False, evt_handlers=handlers)
        except OSError as exc:
            self.stop()
            raise ConfigError(f"cannot listen on {self.host}:{self.port} ({exc.strerror or exc}); is another "
                              "listener running? choose another --port") from None
        log.info("DICOM listener %s on %s:%d, model %s %s, spool %s", self.ae_title, self.host, self.port,
                 self.pkg.name, self.pkg.version, self.spool)

    def pending(self) -> int:
        with self._lock:
            return self._pending

    def halt(self) -> None:
        """Stop after the instances in hand (a second SIGTERM): what waits stays in the spool. Signal-safe."""
        self._halt.set()

    def stop(self, drain: bool = False, timeout: float = 30.0) -> dict[str, int]:
        """Stop accepting; with `drain`, finish the queue first (for up to `timeout` s, or until `halt()`), else
        only the instances in hand. What is left stays in the spool for next time. Logs and returns what this
        run did."""
        running = bool(self._threads)
        if self._server is not None:
            self._server.shutdown()
            self._server = None
        waiting = self.pending()
        if drain and running:
            log.info("stopping: no new associations; draining %d instance(s) waiting in the spool (up to %g s)",
                     waiting, timeout)
            end = time.monotonic() + timeout
            while self.pending() and time.monotonic() < end and not self._halt.is_set():
                time.sleep(0.05)
        elif running:
            log.info("stopping: no new associations; %d instance(s) waiting stay in the spool", waiting)
        self._halt.set()  # the drain is over: a worker finishes the instance in hand and takes no other
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            t.join(timeout)
        self._threads.clear()
        self.pool.close()
        left = sum(1 for _ in self.queue_dir.glob("*.dcm"))
        summary = {k: self.stats[k] for k in ("received", "classified", "delivered", "failed", "skipped")}
        summary["left"] = left
        if running:
            log.info("stopped: this run %(received)d received, %(classified)d classified, %(delivered)d delivered, "
                     "%(failed)d failed (kept in failed/), %(skipped)d skipped (not images); %(left)d left in the "
                     "spool for the next start", summary)
        return summary


def storage_classes() -> list[str]:
    """Every storage SOP class the listener accepts: pynetdicom's list and the retired image storage classes
    pydicom knows (old modalities still send US Image Storage 1.2.840.10008.5.1.4.1.1.6 and the like)."""
    from pydicom._uid_dict import UID_dictionary
    from pynetdicom import AllStoragePresentationContexts

    from pynetdicom.service_class import StorageServiceClass
    from pynetdicom.sop_class import register_uid, uid_to_service_class

    current = [cx.abstract_syntax for cx in AllStoragePresentationContexts]
    retired = sorted(uid for uid, v in UID_dictionary.items() if v[1] == "SOP Class" and "Storage" in v[0]
                     and "Commitment" not in v[0] and uid.startswith("1.2.840.10008.5.1.4.1.1.")
                     and uid not in current)
    for uid in retired:  # pynetdicom routes a C-STORE only for a class it maps to the storage service
        if uid_to_service_class(uid) is not StorageServiceClass:
            register_uid(uid, "TaflRetired" + uid.replace(".", "_"), StorageServiceClass)
    return current + retired


def no_delay(event) -> None:
    """TCP_NODELAY on an association's socket (pynetdicom leaves Nagle's algorithm on). A DIMSE message goes out
    as several writes (the command, then the data set's PDUs), and with Nagle the last of them waits for the
    peer's delayed ACK: about 40 ms per C-STORE on Linux (pynetdicom to pynetdicom: 52 ms a C-STORE, 12 ms
    with this on both ends). Without it things only run slower, so a socket that refuses is left as it is."""
    try:
        event.assoc.dul.socket.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (AttributeError, OSError):
        pass


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _quiet_libraries() -> None:
    """pydicom's and pynetdicom's messages can quote tag values or dump datasets: WARNING and above only."""
    logging.getLogger("pydicom").setLevel(logging.ERROR)
    logging.getLogger("pynetdicom").setLevel(logging.WARNING)
    logging.getLogger("highdicom").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="highdicom")
    warnings.filterwarnings("ignore", module="pydicom")


def serve(listener: Listener, drain_seconds: float = DRAIN_SECONDS) -> None:
    """Run until SIGINT or SIGTERM (the CLI's loop), then drain the queue; a second signal stops at once."""
    import signal

    received: list[str] = []

    def on_signal(signum, _frame) -> None:
        # no logging and no lock this thread may hold: the handler runs between two bytecodes of the main thread
        # (an Event's set() here could wait on the lock that the interrupted Event.wait holds, for ever)
        received.append(signal.Signals(signum).name)
        if len(received) > 1:
            listener.halt()  # only worker threads ever hold this event's lock, and briefly

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    listener.start()
    print(f"listening as {listener.ae_title} on {listener.host}:{listener.port}", flush=True)
    try:
        while not received:
            time.sleep(0.5)
    finally:
        if received:
            log.info("%s received; a second one stops at once, without waiting for the queue", received[0])
        listener.stop(drain=True, timeout=drain_seconds)
