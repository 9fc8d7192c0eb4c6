"""`tafl dicom-listen` over loopback: a pynetdicom sender -> the listener (a real subprocess, killed with
SIGKILL mid-burst and started again) -> a destination storage SCP in the test. Every instance acknowledged
or retried ends as exactly one SR at the destination, each re-reads with highdicom and references its
source; the listener's log holds no patient data. The 200-instance burst is benchmarks/dicom_listener.py."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pydicom
import pytest
from pydicom.data import get_testdata_file

from tafl.imaging import dicom_sr
from tests.dicom_net import PHI_BIRTH, PHI_ID, PHI_NAME, Sink, echo, free_port, instances, send

REPO = Path(__file__).resolve().parents[2]
SOURCES = [Path(get_testdata_file(n)) for n in ("CT_small.dcm", "MR_small.dcm", "MR_small_RLE.dcm")]


def _listener(pkg: Path, port: int, dest_port: int, spool: Path, log: Path, extra: list[str] = ()) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TAFL_DECODE_PROCESSES": "1"}
    fh = open(log, "ab")
    return subprocess.Popen([sys.executable, "-m", "tafl.cli", "dicom-listen", "--package", str(pkg), "--port",
                             str(port), "--dest", f"DEST@127.0.0.1:{dest_port}", "--spool", str(spool), *extra],
                            stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                            start_new_session=True)  # its own group: a crash is cleaned up with the group


def _reap(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _check_srs(sink: Sink, sent: list[pydicom.Dataset], names: list[str]) -> None:
    import highdicom as hd

    srs = {}
    for data in list(sink.received.values()):
        ds = pydicom.dcmread(io.BytesIO(data))
        if ds.SOPClassUID == dicom_sr.SR_STORAGE:
            hd.sr.srread(io.BytesIO(data))
            ref = ds.CurrentRequestedProcedureEvidenceSequence[0].ReferencedSeriesSequence[0].ReferencedSOPSequence
            srs[ref[0].ReferencedSOPInstanceUID] = ds
    assert set(srs) == {str(d.SOPInstanceUID) for d in sent}  # one SR per instance, none lost, none extra
    for d in sent:
        sr = srs[str(d.SOPInstanceUID)]
        assert sr.StudyInstanceUID == d.StudyInstanceUID and sr.VerificationFlag == "UNVERIFIED"
        assert str(sr.PatientName) == PHI_NAME and sr.PatientID == PHI_ID  # the source's, carried over
        finding = [i for i in _items(sr) if i.ConceptNameCodeSequence[0].CodeValue == "121071"][0]
        assert finding.ConceptCodeSequence[0].CodeMeaning in names


def _items(ds):
    for item in ds.get("ContentSequence", []):
        yield item
        yield from _items(item)


@pytest.mark.slow
def test_round_trip_with_a_listener_killed_mid_burst(gtafl_pkg, tmp_path):
    from tafl.packaging import load_package

    names = load_package(gtafl_pkg).class_names
    sink = Sink()
    port, spool, log = free_port(), tmp_path / "spool", tmp_path / "listener.log"
    proc = _listener(gtafl_pkg, port, sink.port, spool, log, ["--heatmap"])
    try:
        assert echo(port, timeout=90), log.read_text()[-2000:]
        sent = instances(SOURCES, 20, seed=str(tmp_path))
        killed = threading.Event()

        def kill_after(n: int) -> None:
            if n == 8 and not killed.is_set():  # mid-burst: acknowledged work is in the spool, some not yet sent
                killed.set()
                proc.send_signal(signal.SIGKILL)

        stats: dict = {}
        sender = threading.Thread(target=lambda: stats.update(send(port, sent, deadline=150, on_ack=kill_after)))
        sender.start()
        assert killed.wait(60)
        proc.wait(10)
        _reap(proc)  # the crashed listener's idle decoder processes (they outlive a SIGKILLed parent)
        left = len(list((spool / "queue").glob("*.dcm")))
        proc = _listener(gtafl_pkg, port, sink.port, spool, log, ["--heatmap"])  # the same spool
        sender.join(160)
        assert stats["unsent"] == 0 and stats["acked"] >= 20, stats
        end = time.monotonic() + 90
        # 20 SRs and 20 heatmap SCs, and an empty queue: an instance spooled just before the kill but not yet
        # acknowledged is sent again by the sender and finished twice (at-least-once), the second may still run
        while time.monotonic() < end and (len(sink.received) < 40 or list((spool / "queue").glob("*.dcm"))):
            time.sleep(0.2)
        _check_srs(sink, sent, names)
        scs = [d for d in sink.datasets(dicom_sr.SC_STORAGE)]
        assert len(scs) == 20 and all(d.StudyInstanceUID in {s.StudyInstanceUID for s in sent} for d in scs)
        assert not list((spool / "queue").glob("*.dcm"))  # everything acknowledged was finished
        print(f"spooled at the kill: {left}; sender: {stats}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        _reap(proc)
        sink.close()
    text = log.read_text()
    assert "SR delivered" in text and ("queued again" in text or left == 0)
    for secret in (PHI_NAME, PHI_NAME.split("^")[0], PHI_ID, PHI_BIRTH):
        assert secret not in text  # zero patient data in the listener's log
    assert not any(str(d.SOPInstanceUID) in text for d in sent)  # only hashes of the instance UIDs


@pytest.mark.slow
def test_back_pressure_and_a_destination_that_comes_back(gtafl_pkg, tmp_path, caplog):
    """With the destination down the spool fills to max_queue; further C-STOREs are refused with 0xA700
    (out of resources), the sender retries them, and once the destination is up everything arrives."""
    import logging

    from tafl.serving.dicom_listener import Destination, Listener

    caplog.set_level(logging.INFO, logger="tafl.dicom")
    dest_port, port = free_port(), free_port()
    lst = Listener(gtafl_pkg, Destination(ae_title="DEST", host="127.0.0.1", port=dest_port), port=port,
                   spool=tmp_path / "spool", max_queue=3, workers=1, deliver_retries=1, retry_pause=0.3)
    lst.start()
    sink = None
    try:
        sent = instances(SOURCES, 8, seed="bp" + str(tmp_path))
        stats: dict = {}
        sender = threading.Thread(target=lambda: stats.update(send(port, sent, deadline=120)))
        sender.start()
        end = time.monotonic() + 30
        while time.monotonic() < end and lst.stats["refused_busy"] == 0:
            time.sleep(0.1)
        assert lst.stats["refused_busy"] > 0 and lst.pending() <= 3  # bounded: refused, not queued without end
        sink = Sink(port=dest_port)
        sender.join(120)
        assert stats["unsent"] == 0 and stats["refused"] > 0, stats
        assert "refused (0xA700)" in caplog.text  # a sender may not retry (Orthanc does not): said in the log
        end = time.monotonic() + 60
        while time.monotonic() < end and len(sink.received) < 8:
            time.sleep(0.1)
        from tafl.packaging import load_package

        _check_srs(sink, sent, load_package(gtafl_pkg).class_names)
    finally:
        lst.stop(drain=False, timeout=10)
        if sink is not None:
            sink.close()
    assert PHI_ID not in caplog.text and PHI_NAME not in caplog.text


@pytest.mark.slow
def test_folder_destination_retired_classes_and_non_images(gtafl_pkg, tmp_path):
    """SRs written into a folder; a retired SOP class (US Image Storage 1.2.840.10008.5.1.4.1.1.6, from the
    shared real DICOMs) is accepted and classified; an SR sent to the listener is acknowledged, not classified."""
    from tafl.serving.dicom_listener import Destination, Listener

    from tests.conftest import shared

    retired = shared("dicom", "color-pl.dcm")
    port = free_port()
    lst = Listener(gtafl_pkg, Destination(folder=tmp_path / "srs"), port=port, spool=tmp_path / "spool")
    lst.start()
    try:
        sent = instances([retired, SOURCES[0]], 2, seed="folder" + str(tmp_path))
        report = pydicom.dcmread(get_testdata_file("reportsi.dcm"))  # a Basic Text SR: not an image
        stats = send(port, sent + [report], deadline=60)
        lst.stop(drain=True)
    finally:
        lst.stop()
    assert stats["acked"] == 3 and stats["unsent"] == 0, stats
    assert lst.stats["classified"] == 2 and lst.stats["skipped"] == 1
    files = sorted((tmp_path / "srs").glob("*.dcm"))
    refs = {pydicom.dcmread(f).CurrentRequestedProcedureEvidenceSequence[0].ReferencedSeriesSequence[0]
            .ReferencedSOPSequence[0].ReferencedSOPClassUID for f in files}
    assert len(files) == 2 and "1.2.840.10008.5.1.4.1.1.6" in refs
    # the listener runs one image at a time beside other work: its ONNX Runtime threads do not spin between runs
    opts = lst.session.get_session_options()
    assert opts.get_session_config_entry("session.intra_op.allow_spinning") == "0"


def test_a_session_that_does_not_spin_answers_as_one_that_does(gtafl_pkg):
    import numpy as np

    from tafl.packaging import load_package

    pkg = load_package(gtafl_pkg)
    x = np.random.default_rng(0).random((3, *pkg.metadata["input"]["shape"][1:]), dtype=np.float32)
    spinning, quiet = pkg.session(["CPUExecutionProvider"]), pkg.session(["CPUExecutionProvider"], spin=False)
    a, b = pkg.run(spinning, x), pkg.run(quiet, x)
    assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)
    assert quiet.get_session_options().get_session_config_entry("session.inter_op.allow_spinning") == "0"
    with pytest.raises(RuntimeError, match="does not have configuration"):  # ONNX Runtime's default: spinning
        spinning.get_session_options().get_session_config_entry("session.intra_op.allow_spinning")


@pytest.mark.slow
def test_a_message_past_the_upload_cap_aborts_its_association_before_it_is_held(gtafl_pkg, tmp_path, monkeypatch):
    """A sender streaming a dataset larger than TAFL_MAX_UPLOAD_MB is cut off (A-ABORT) while the bytes arrive:
    the message is never gathered whole, nothing is spooled, and the listener serves the next sender."""
    from pynetdicom import AE

    from tafl.serving.settings import Settings
    from tafl.serving.dicom_listener import Destination, Listener

    monkeypatch.setenv("TAFL_MAX_UPLOAD_MB", "1")
    port = free_port()
    lst = Listener(gtafl_pkg, Destination(folder=tmp_path / "out"), port=port, spool=tmp_path / "spool",
                   workers=1, settings=Settings.from_env())
    assert lst.max_message_bytes == 2 << 20
    lst.start()
    try:
        big, small = instances(SOURCES[:1], 2, seed="cap" + str(tmp_path))
        big.PixelData = b"\x00\x01" * (3 << 20)  # 6 MiB on the wire
        ae = AE(ae_title="BIG")
        ae.add_requested_context(big.SOPClassUID, big.file_meta.TransferSyntaxUID)
        assoc = ae.associate("127.0.0.1", port, ae_title="TAFL")
        assert assoc.is_established
        status = assoc.send_c_store(big)
        assert not status  # no response: the association was aborted
        end = time.monotonic() + 10
        while assoc.is_established and time.monotonic() < end:  # the A-ABORT arrives on the association's thread
            time.sleep(0.05)
        assert not assoc.is_established
        assert lst.stats["refused_too_large"] == 1 and lst.stats["received"] == 0
        assert not any((tmp_path / "spool" / "queue").iterdir())
        stats = send(port, [small], deadline=60)
        assert stats["acked"] == 1 and lst.stats["received"] == 1
    finally:
        lst.stop(drain=False, timeout=10)


@pytest.mark.slow
def test_both_ends_of_the_listener_turn_nagle_off(gtafl_pkg, tmp_path):
    """TCP_NODELAY on the associations the listener accepts and on the one it files SRs over: with Nagle on, each
    C-STORE waited for the peer's delayed ACK (about 40 ms per end; benchmarks/results/dimse_latency.md)."""
    import socket

    from pynetdicom import AE
    from pynetdicom.sop_class import Verification

    from tafl.packaging import load_package
    from tafl.serving.dicom_listener import Deliverer, Destination, Listener

    def nodelay(assoc) -> int:
        return assoc.dul.socket.socket.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)

    sink = Sink()
    port = free_port()
    lst = Listener(gtafl_pkg, Destination(ae_title="DEST", host="127.0.0.1", port=sink.port), port=port,
                   spool=tmp_path / "spool", workers=1)
    lst.start()
    deliverer = Deliverer(Destination(ae_title="DEST", host="127.0.0.1", port=sink.port), "TAFL")
    try:
        ae = AE(ae_title="SENDER")
        ae.add_requested_context(Verification)
        assoc = ae.associate("127.0.0.1", port, ae_title="TAFL")
        assert assoc.is_established
        accepted = lst._server.active_associations
        assert accepted and all(nodelay(a) for a in accepted)
        assert not nodelay(assoc)  # pynetdicom's own default is Nagle on: the check above can fail
        assoc.release()
        pkg = load_package(gtafl_pkg)
        algo = dicom_sr.Algorithm.from_metadata(pkg.metadata, pkg.files.get("model.onnx", ""))
        src = instances(SOURCES[:1], 1, seed="nodelay")[0]
        sr, _ = dicom_sr.build(src, dicom_sr.Finding(0, 0.9), algo)
        deliverer.deliver([sr])
        assert nodelay(deliverer._assoc) and str(sr.SOPInstanceUID) in sink.received
    finally:
        deliverer.close()
        lst.stop(drain=False, timeout=10)
        sink.close()


@pytest.mark.parametrize("implicit_only", [False, True])
def test_deliverer_sends_part10_bytes_as_stored_or_converted_for_the_peer(tmp_path, implicit_only):
    """The listener builds SRs in a decoder process and hands the Deliverer their Part 10 bytes. A peer that
    accepts explicit VR gets the file as it was written (pynetdicom's chunked send, no second encoding); a peer
    that took only implicit VR gets it converted. Either way the peer holds the same SR."""
    from pydicom.uid import ImplicitVRLittleEndian

    from tafl.serving.dicom_listener import Deliverer, Destination

    sink = Sink(syntaxes=[ImplicitVRLittleEndian] if implicit_only else None)
    deliverer = Deliverer(Destination(ae_title="DEST", host="127.0.0.1", port=sink.port), "TAFL",
                          scratch=tmp_path / "out")
    try:
        algo = dicom_sr.Algorithm("m", "1", "cd" * 32, ["a", "b"])
        srcs = instances(SOURCES[:2], 2, seed="bytes" + str(implicit_only))
        parts = [dicom_sr.encoded(s, dicom_sr.Finding(i % 2, 0.7), algo)[0] for i, s in enumerate(srcs)]
        deliverer.deliver(parts)
        from pynetdicom.dsutils import split_dataset

        def body(data: bytes, name: str) -> tuple[str, bytes]:  # (transfer syntax, the dataset's bytes)
            (tmp_path / name).write_bytes(data)
            meta, offset = split_dataset(tmp_path / name)
            return str(meta.TransferSyntaxUID), data[offset:]

        for i, data in enumerate(parts):
            sent = pydicom.dcmread(io.BytesIO(data))
            got = sink.received[str(sent.SOPInstanceUID)]
            (ts_sent, body_sent), (ts_got, body_got) = body(data, f"s{i}"), body(got, f"g{i}")
            assert pydicom.dcmread(io.BytesIO(got)).ContentSequence == sent.ContentSequence
            if implicit_only:  # converted by pynetdicom
                assert ts_got == ImplicitVRLittleEndian != ts_sent and body_got != body_sent
            else:  # the dataset's bytes exactly as written
                assert ts_got == ts_sent and body_got == body_sent
        assert {str(c.transfer_syntax[0]) for c in deliverer._assoc.accepted_contexts} == (
            {ImplicitVRLittleEndian} if implicit_only else {ImplicitVRLittleEndian, "1.2.840.10008.1.2.1"})
    finally:
        deliverer.close()
        sink.close()
