"""DICOM network helpers for the listener tests and benchmarks/dicom_listener.py: a destination storage SCP
that keeps what it receives, a sender (C-STORE SCU) that retries what was not acknowledged, and test
instances with marker patient data (to prove none of it reaches a log)."""

from __future__ import annotations

import copy
import io
import socket
import threading
import time
from pathlib import Path

import pydicom
from pydicom.uid import generate_uid

PHI_NAME, PHI_ID, PHI_BIRTH = "Phimarker^Jane^Q", "PHI-ID-778899", "19230417"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Sink:
    """A storage SCP for SR and SC objects: `received` maps SOP Instance UID -> Part 10 bytes."""

    def __init__(self, port: int | None = None, ae_title: str = "DEST", syntaxes: list[str] | None = None):
        from pynetdicom import AE, evt
        from pydicom.uid import ExplicitVRLittleEndian, ImplicitVRLittleEndian

        self.port = port or free_port()
        self.ae_title = ae_title
        self.received: dict[str, bytes] = {}
        self.stores = 0
        self._lock = threading.Lock()
        ae = AE(ae_title=ae_title)
        for sop in ("1.2.840.10008.5.1.4.1.1.88.33", "1.2.840.10008.5.1.4.1.1.7"):
            ae.add_supported_context(sop, syntaxes or [ExplicitVRLittleEndian, ImplicitVRLittleEndian])
        self._server = ae.start_server(("127.0.0.1", self.port), block=False,
                                       evt_handlers=[(evt.EVT_C_STORE, self._store)])

    def _store(self, event) -> int:
        data = event.encoded_dataset()
        ds = pydicom.dcmread(io.BytesIO(data), stop_before_pixels=True)
        with self._lock:
            self.received[str(ds.SOPInstanceUID)] = data
            self.stores += 1
        return 0x0000

    def datasets(self, sop_class: str | None = None) -> list[pydicom.Dataset]:
        with self._lock:
            items = list(self.received.values())
        out = [pydicom.dcmread(io.BytesIO(b)) for b in items]
        return [d for d in out if sop_class is None or str(d.SOPClassUID) == sop_class]

    def close(self) -> None:
        self._server.shutdown()


def instances(sources: list[Path], n: int, seed: str = "burst") -> list[pydicom.Dataset]:
    """`n` instances cycled from `sources`, each with its own SOP Instance UID and marker patient data."""
    base = [pydicom.dcmread(p, force=True) for p in sources]
    # a sender needs the transfer syntax: a bare dataset without a file meta header cannot be sent as it is
    base = [d for d in base if "TransferSyntaxUID" in getattr(d, "file_meta", {})
            and all(k in d for k in ("SOPClassUID", "SOPInstanceUID"))]
    out = []
    for i in range(n):
        ds = copy.deepcopy(base[i % len(base)])  # Dataset.copy shares the elements: a new value would show in all
        ds.SOPInstanceUID = generate_uid(entropy_srcs=[seed, str(i)])
        ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID
        ds.PatientName, ds.PatientID, ds.PatientBirthDate = PHI_NAME, PHI_ID, PHI_BIRTH
        if "StudyInstanceUID" not in ds:
            ds.StudyInstanceUID = generate_uid(entropy_srcs=[seed, "study"])
        out.append(ds)
    return out


def echo(port: int, ae_title: str = "TAFL", timeout: float = 30.0) -> bool:
    """Wait until a C-ECHO to 127.0.0.1:port succeeds."""
    from pynetdicom import AE
    from pynetdicom.sop_class import Verification

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        ae = AE(ae_title="PROBE")
        ae.add_requested_context(Verification)
        assoc = ae.associate("127.0.0.1", port, ae_title=ae_title)
        if assoc.is_established:
            st = assoc.send_c_echo()
            assoc.release()
            if getattr(st, "Status", None) == 0:
                return True
        time.sleep(0.2)
    return False


def send(port: int, datasets: list[pydicom.Dataset], *, ae_title: str = "TAFL", deadline: float = 300.0,
         on_ack=None) -> dict[str, int]:
    """C-STORE every dataset to 127.0.0.1:port, retrying (with a fresh association after a failure) each one
    that was not acknowledged with Success, until all are or `deadline` seconds pass. `on_ack(i)` is called
    after the i-th acknowledgment (a test stops the listener from it)."""
    from pynetdicom import AE

    todo = list(range(len(datasets)))
    stats: dict = {"acked": 0, "refused": 0, "failed_attempts": 0, "associations": 0, "unsendable": 0, "errors": {}}
    errors: dict[int, int] = {}
    end = time.monotonic() + deadline
    contexts = sorted({(str(d.SOPClassUID), str(d.file_meta.TransferSyntaxUID)) for d in datasets})
    while todo and time.monotonic() < end:
        ae = AE(ae_title="SENDER")
        for sop, ts in contexts:
            ae.add_requested_context(sop, [ts])
        ae.acse_timeout = ae.dimse_timeout = ae.network_timeout = 20
        assoc = ae.associate("127.0.0.1", port, ae_title=ae_title)
        stats["associations"] += 1
        if not assoc.is_established:
            stats["failed_attempts"] += 1
            time.sleep(0.3)
            continue
        left = []
        try:
            for k, i in enumerate(todo):
                if not assoc.is_established:
                    left.extend(todo[k:])
                    break
                try:
                    st = assoc.send_c_store(datasets[i])
                except Exception as exc:  # noqa: BLE001 - the peer went away mid-send, or this dataset cannot go
                    errors[i] = errors.get(i, 0) + 1
                    stats["errors"][type(exc).__name__] = stats["errors"].get(type(exc).__name__, 0) + 1
                    if errors[i] >= 5:  # not the peer: this one cannot be sent (counted, not retried forever)
                        stats["unsendable"] += 1
                        left.extend(todo[k + 1:])
                    else:
                        left.extend(todo[k:])
                    break
                code = getattr(st, "Status", None)
                if code == 0x0000:
                    stats["acked"] += 1
                    if on_ack:
                        on_ack(stats["acked"])
                else:
                    stats["refused" if code == 0xA700 else "failed_attempts"] += 1
                    left.append(i)
                    if code == 0xA700:
                        time.sleep(0.05)  # back-pressure: give the listener a moment
        finally:
            if assoc.is_established:
                assoc.release()
        todo = left
        if todo:
            time.sleep(0.2)
    stats["unsent"] = len(todo)
    return stats
