"""The bytes `tafl score --dicomweb` sends and reads: WADO-RS answers split into their parts, STOW-RS requests built
from Part 10 files as written, and the refusals a STOW-RS answer lists (DICOM JSON or PS3.19 XML). Checked against
the standard library's MIME parser, which shares no code with tafl's; a server that answers a WADO-RS with
something that is not DICOM gets a row with a 4xx reason, not a crash (a small HTTP server of the test's own: no
real PACS sends that). Orthanc itself is in test_dicomweb.py."""

from __future__ import annotations

import email.parser
import email.policy
import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pydicom
import pytest
import requests
from hypothesis import given, settings
from hypothesis import strategies as st
from pydicom.data import get_testdata_file

from tafl.clients.dicomweb import multipart_body, multipart_parts, refused_in, score_dicomweb
from tafl.imaging import dicom_sr


def _stdlib_parts(content_type: str, body: bytes) -> list[bytes]:
    msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body)
    return [part.get_payload(decode=True) for part in msg.iter_parts()]


def test_a_wado_answer_is_split_into_its_parts_as_the_rfc_says():
    """Preamble, transport padding after a delimiter, part headers, a CRLF and a near-delimiter inside a part's
    bytes, the close delimiter and an epilogue: only the parts' bodies come back, byte for byte."""
    one = b"DICM\x00\x01\r\n--not-the-boundary\r\n\r\n"
    two = b"\r\n" + bytes(range(256)) + b"\r\n"
    body = (b"a preamble to ignore\r\n"
            b"--abc123 \t\r\nContent-Type: application/dicom\r\nContent-Length: 34\r\n\r\n" + one + b"\r\n"
            b"--abc123\r\nContent-Type: application/dicom\r\n\r\n" + two + b"\r\n"
            b"--abc123--\r\nan epilogue\r\n--abc123\r\n\r\nnot a part\r\n")
    ct = 'multipart/related; type="application/dicom"; boundary="abc123"'
    assert multipart_parts(ct, body) == [one, two]
    assert _stdlib_parts(ct, body) == [one, two]
    assert multipart_parts("application/dicom", b"DICM") == [b"DICM"]  # one instance answered without multipart
    assert multipart_parts("multipart/related; type=application/dicom", b"x") == [b"x"]  # no boundary given


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(max_size=3000), min_size=1, max_size=6))
def test_a_stow_body_reads_back_as_the_files_it_was_built_from(parts):
    ct, body = multipart_body(parts)
    assert ct.startswith('multipart/related; type="application/dicom"; boundary=')
    assert multipart_parts(ct, body) == parts
    assert _stdlib_parts(ct, body) == parts


def test_a_stow_body_never_uses_a_boundary_that_occurs_in_a_file(monkeypatch):
    import uuid

    import tafl.clients.dicomweb as dw

    drawn = iter([uuid.UUID(int=1), uuid.UUID(int=2)])
    monkeypatch.setattr(dw.uuid, "uuid4", lambda: next(drawn))
    clash = b"xx" + uuid.UUID(int=1).hex.encode() + b"xx"  # the first boundary drawn is inside the file
    ct, body = multipart_body([clash])
    assert uuid.UUID(int=2).hex in ct and multipart_parts(ct, body) == [clash]


def _answer(content_type: str, content: bytes) -> requests.Response:
    r = requests.Response()
    r.status_code, r._content = 200, content
    r.headers["Content-Type"] = content_type
    return r


def test_the_refusals_of_a_stow_answer_are_read_in_json_and_xml():
    failed = {"00081198": {"vr": "SQ", "Value": [
        {"00081150": {"vr": "UI", "Value": ["1.2.840.10008.5.1.4.1.1.88.34"]},
         "00081155": {"vr": "UI", "Value": ["1.2.3.4"]}, "00081197": {"vr": "US", "Value": [272]}},
        {"00081155": {"vr": "UI", "Value": ["1.2.3.5"]}}]},
        "00081199": {"vr": "SQ", "Value": [{"00081155": {"vr": "UI", "Value": ["1.2.3.6"]}}]}}
    assert refused_in(_answer("application/dicom+json", json.dumps(failed).encode())) == {"1.2.3.4", "1.2.3.5"}
    assert refused_in(_answer("application/dicom+json", json.dumps([failed]).encode())) == {"1.2.3.4", "1.2.3.5"}
    xml = b"""<?xml version="1.0" encoding="UTF-8"?><NativeDicomModel>
      <DicomAttribute tag="00081198" vr="SQ" keyword="FailedSOPSequence"><Item number="1">
        <DicomAttribute tag="00081155" vr="UI" keyword="ReferencedSOPInstanceUID"><Value number="1">1.2.3.4</Value>
        </DicomAttribute></Item></DicomAttribute>
      <DicomAttribute tag="00081199" vr="SQ" keyword="ReferencedSOPSequence"><Item number="1">
        <DicomAttribute tag="00081155" vr="UI" keyword="ReferencedSOPInstanceUID"><Value number="1">1.2.3.6</Value>
        </DicomAttribute></Item></DicomAttribute></NativeDicomModel>"""
    assert refused_in(_answer("application/dicom+xml", xml)) == {"1.2.3.4"}
    stored = {"00081199": failed["00081199"]}
    assert refused_in(_answer("application/dicom+json", json.dumps(stored).encode())) == set()
    assert refused_in(_answer("application/dicom+json", b"")) == set()
    assert refused_in(_answer("application/dicom+xml", b"<NativeDicomModel><DicomAttr")) == set()  # unreadable


def test_an_srs_uid_is_read_from_its_first_elements():
    src = pydicom.dcmread(get_testdata_file("CT_small.dcm"))
    sr = dicom_sr.encoded(src, dicom_sr.Finding(1, 0.8), dicom_sr.Algorithm("m", "1", "0" * 64, ["a", "b"]))[0]
    assert dicom_sr.sop_instance_uid(sr) == str(pydicom.dcmread(io.BytesIO(sr)).SOPInstanceUID)


class _OddPacs(BaseHTTPRequestHandler):
    """QIDO finds three instances, the third with a UID that is a path; WADO-RS answers with a proxy's error page in
    the part, or with two parts for the second."""

    study, series = "1.2.826.0.1.3680043.8.498.1", "1.2.826.0.1.3680043.8.498.2"

    def log_message(self, *args):
        pass

    def _send(self, code: int, ct: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ct)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.server.paths.append(self.path)
        if "/instances/" in self.path:
            page = b"<html><body>502 Bad Gateway: the archive did not answer the proxy</body></html>"
            ct, body = multipart_body([page] * (2 if self.path.endswith(".2") else 1))
            return self._send(200, ct, body)
        if self.path.split("?")[0].endswith("/instances"):
            recs = [{"0020000E": {"vr": "UI", "Value": [self.series]},
                     "00080018": {"vr": "UI", "Value": [f"{self.series}.{i}"]},
                     "00080016": {"vr": "UI", "Value": ["1.2.840.10008.5.1.4.1.1.7"]}} for i in (1, 2, "3/../../evil")]
            return self._send(200, "application/dicom+json", json.dumps(recs).encode())
        return self._send(200, "application/dicom+json", b"[]")


@pytest.fixture
def odd_pacs():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OddPacs)
    server.paths = []  # what was asked for
    threading.Thread(target=server.serve_forever, daemon=True).start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}/dicom-web"
    yield server
    server.shutdown()


def test_a_wado_answer_that_is_not_one_dicom_instance_is_a_row_with_its_reason(odd_pacs, gtafl_pkg, tmp_path):
    summary = score_dicomweb(odd_pacs.url, tmp_path / "r.csv", package=str(gtafl_pkg), studies=[_OddPacs.study],
                             progress=False, retries=0)
    reasons = dict(summary["failed"])
    key = f"{_OddPacs.study}/{_OddPacs.series}/{_OddPacs.series}"
    assert reasons[key + ".1"].startswith("422 UnprocessableImage: the WADO-RS answer is not a DICOM instance")
    assert "2 parts for one instance" in reasons[key + ".2"]
    assert summary["predicted"] == 0 and len(summary["failed"]) == 3
    assert "422" in reasons[key + ".3/../../evil"]  # asked for with the UID quoted, and spooled under a hash
    assert any(p.endswith("/instances/" + _OddPacs.series + ".3%2F..%2F..%2Fevil") for p in odd_pacs.paths)
    assert not list(tmp_path.rglob("evil*")) and not list(tmp_path.parent.rglob("evil*"))


class _EndlessPacs(BaseHTTPRequestHandler):
    """QIDO finds two CT instances; WADO-RS answers the first with a body that has no end (no Content-Length: it
    ends only when the client hangs up, or at CEILING, so that a client that reads everything fails this test
    instead of filling the machine's memory), and the second with a real instance."""

    study, series = "1.2.826.0.1.3680043.8.498.11", "1.2.826.0.1.3680043.8.498.12"
    CEILING = 64 * 2**20  # 64 times the limit the test sets: "endless" to a client that stops at the limit

    def log_message(self, *args):
        pass

    def _send(self, code: int, ct: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ct)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path.endswith("/instances/" + self.series + ".1"):
            self.send_response(200)
            self.send_header("Content-Type", 'multipart/related; type="application/dicom"; boundary=b0undary')
            self.end_headers()
            chunk = b"\xa5" * 2**16
            try:
                self.wfile.write(b"--b0undary\r\nContent-Type: application/dicom\r\n\r\n")
                while self.server.sent < self.CEILING:
                    self.wfile.write(chunk)
                    self.server.sent += len(chunk)
            except OSError:  # the client hung up: what the limit is for
                self.server.hung_up = True
            return
        if "/instances/" in self.path:
            ct, body = multipart_body([open(get_testdata_file("CT_small.dcm"), "rb").read()])
            return self._send(200, ct, body)
        if self.path.split("?")[0].endswith("/instances"):
            recs = [{"0020000E": {"vr": "UI", "Value": [self.series]},
                     "00080018": {"vr": "UI", "Value": [f"{self.series}.{i}"]},
                     "00080016": {"vr": "UI", "Value": ["1.2.840.10008.5.1.4.1.1.2"]}} for i in (1, 2)]
            return self._send(200, "application/dicom+json", json.dumps(recs).encode())
        return self._send(200, "application/dicom+json", b"[]")


@pytest.fixture
def endless_pacs():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _EndlessPacs)
    server.daemon_threads = True
    server.sent, server.hung_up = 0, False
    threading.Thread(target=server.serve_forever, daemon=True).start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}/dicom-web"
    yield server
    server.shutdown()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("through", ["url", "package"])
def test_an_endless_wado_answer_is_a_413_row_and_is_read_no_further_than_the_upload_limit(
        through, endless_pacs, gtafl_pkg, tmp_path, monkeypatch, request):
    """Through the service (--url, whose decoder never sees the answer) and in-process alike: the answer is streamed
    into the spool and dropped once past TAFL_MAX_UPLOAD_MB (1 MiB here), its partial file removed; the row is a
    413 and the next instance is scored. The job's memory stays within a few times the limit, and the server sent
    a few MiB (the limit and the sockets' buffers), not its 64 MiB ceiling."""
    import hashlib
    import tempfile
    import time
    import tracemalloc

    monkeypatch.setenv("TAFL_MAX_UPLOAD_MB", "1")
    spool_root = tmp_path / "tmp"
    spool_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spool_root))  # where the job's spool lies, to look into it
    where = {"package": str(gtafl_pkg)}
    if through == "url":
        from tafl.packaging import load_package

        where = {"url": request.getfixturevalue("server").url, "model": load_package(gtafl_pkg).name}
    key = f"{_EndlessPacs.study}/{_EndlessPacs.series}/{_EndlessPacs.series}"
    spooled_at_row: dict[str, list] = {}

    def on_row(row) -> None:  # the endless answer's spool file, once its row is written
        spooled_at_row[row.path] = list(spool_root.rglob(hashlib.sha256(row.path.encode()).hexdigest() + "*"))

    tracemalloc.start()
    started = time.monotonic()
    try:
        summary = score_dicomweb(endless_pacs.url, tmp_path / "r.csv", studies=[_EndlessPacs.study], progress=False,
                                 retries=0, batch_size=1, on_row=on_row, **where)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    took = time.monotonic() - started
    reasons = dict(summary["failed"])
    assert reasons == {key + ".1": "413 PayloadTooLarge: the WADO-RS answer ran past the 1 MiB upload limit "
                                   "(TAFL_MAX_UPLOAD_MB); not read further"}, reasons
    assert summary["predicted"] == 1  # the job went on: the next instance was fetched and scored
    assert spooled_at_row[key + ".1"] == []  # the partial answer is not left in the spool
    assert endless_pacs.sent < 16 * 2**20 and endless_pacs.hung_up, endless_pacs.sent
    assert peak < 16 * 2**20, f"{peak / 2**20:.1f} MiB"
    assert took < 60, took
