"""`tafl dicom-listen` over loopback: a pynetdicom sender -> the listener (a real subprocess, killed with
SIGKILL mid-burst and started again) -> a destination storage SCP in the test. Every instance acknowledged
or retried ends as exactly one SR at the destination, each re-reads with highdicom and references its
source; the listener's log holds no patient data. The 200-instance burst is benchmarks/dicom_listener.py."""

from __future__ import annotations

import io
import json
import os
import re
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


def _listener(pkg: Path, port: int, dest_port: int, spool: Path, log: Path, extra: list[str] = (),
              err: Path | None = None) -> subprocess.Popen:
    """The listener as the CLI runs it; its stderr (the log) into `err` when given, else beside stdout in `log`."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TAFL_DECODE_PROCESSES": "1"}
    fh = open(log, "ab")
    return subprocess.Popen([sys.executable, "-m", "tafl.cli", "dicom-listen", "--package", str(pkg), "--port",
                             str(port), "--dest", f"DEST@127.0.0.1:{dest_port}", "--spool", str(spool), *extra],
                            stdout=fh, stderr=open(err, "ab") if err else subprocess.STDOUT, env=env, cwd=REPO,
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


def _until(cond, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.1)
    return bool(cond())


# what the REST service answers for native pixel data cut short: the reason an operator must read
CUT_REASON = ("the DICOM pixel data (Explicit VR Little Endian) could not be decoded, it is truncated, corrupt or in "
              "an unsupported variant")


def _cut(seed: str) -> pydicom.Dataset:
    """A CT instance whose native pixel data is half missing: the header reads, the pixels do not (422)."""
    ds = instances(SOURCES[:1], 1, seed=seed)[0]
    ds.PixelData = ds.PixelData[: len(ds.PixelData) // 2]
    return ds


def _summary(text: str) -> dict[str, int]:
    """The numbers of the listener's last `stopped: ...` line."""
    line = [ln for ln in text.splitlines() if "stopped: this run" in ln][-1]
    return {k: int(v) for v, k in re.findall(r"(\d+) (received|classified|delivered|failed|skipped|left)", line)}


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
        algo = dicom_sr.Algorithm.from_metadata(pkg.meta, pkg.files.get("model.onnx", ""))
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
        assert not any((tmp_path / "out").iterdir())  # each copy went once the peer acknowledged it
    finally:
        deliverer.close()
        sink.close()


@pytest.mark.slow
def test_a_refused_instance_says_why_in_the_log_and_beside_the_kept_file(gtafl_pkg, tmp_path, caplog):
    """The service's reason for a 422 (the exception's message) is in the log line, which names the instance only
    by its hash, and in failed/NAME.dcm.reason.json beside the kept instance, for an operator and a script."""
    import logging

    from tafl.serving.dicom_listener import Destination, Listener

    caplog.set_level(logging.INFO, logger="tafl.dicom")
    port, spool = free_port(), tmp_path / "spool"
    lst = Listener(gtafl_pkg, Destination(folder=tmp_path / "srs"), port=port, spool=spool, workers=1)
    lst.start()
    try:
        bad = _cut("reason" + str(tmp_path))
        stats = send(port, [bad], deadline=60)
        lst.stop(drain=True)
    finally:
        lst.stop()
    assert stats["acked"] == 1 and lst.stats["failed"] == 1, (stats, lst.stats)
    kept = list((spool / "failed").glob("*.dcm"))
    assert len(kept) == 1 and pydicom.dcmread(kept[0]).SOPInstanceUID == bad.SOPInstanceUID  # kept as received
    note = json.loads((spool / "failed" / f"{kept[0].name}.reason.json").read_text())
    uid = dicom_sr.uid_hash(bad.SOPInstanceUID)
    assert note["status"] == 422 and note["error"] == "UnprocessableImage" and note["instance"] == uid
    assert note["reason"].startswith(CUT_REASON) and note["time"].endswith("Z")
    line = [r.getMessage() for r in caplog.records if "not classified" in r.getMessage()]
    assert len(line) == 1 and uid in line[0] and CUT_REASON in line[0] and kept[0].name in line[0], line
    assert str(bad.SOPInstanceUID) not in caplog.text and PHI_ID not in caplog.text


@pytest.mark.slow
def test_sigterm_drains_the_queue_says_what_it_finished_and_a_second_one_leaves_the_rest(gtafl_pkg, tmp_path):
    """`tafl dicom-listen` as a supervisor stops it: with its destination down, SIGTERM says it is draining the 6
    instances that wait and a second SIGTERM stops it, saying they stay in the spool. Started again on that spool,
    SIGTERM drains them to the destination (up by then) and says so. Read from its stderr, its log."""
    port, dest_port, spool = free_port(), free_port(), tmp_path / "spool"
    log, err = tmp_path / "stdout.log", tmp_path / "stderr.log"
    good = instances(SOURCES, 6, seed="term" + str(tmp_path))
    proc = _listener(gtafl_pkg, port, dest_port, spool, log, err=err)  # nothing listens on dest_port yet
    sink = None
    try:
        assert echo(port, timeout=90), err.read_text()[-2000:]
        # the refused one first: with both workers then stuck on a delivery, all 6 others wait
        stats = send(port, [_cut("term" + str(tmp_path))] + good, deadline=60)
        assert stats["acked"] == 7, stats
        assert _until(lambda: list((spool / "failed").glob("*.dcm")), 30), err.read_text()[-2000:]
        proc.send_signal(signal.SIGTERM)
        assert _until(lambda: re.search(r"draining \d+ instance", err.read_text()), 60), err.read_text()[-2000:]
        assert "SIGTERM received" in err.read_text()
        assert re.search(r"draining (\d+) instance", err.read_text())[1] == "6"  # the 6 that wait, said so
        proc.send_signal(signal.SIGTERM)  # the destination is still down: stop now
        assert proc.wait(60) == 0
        first = _summary(err.read_text())
        assert first["received"] == 7 and first["delivered"] == 0 and first["failed"] == 1 and first["left"] == 6
        assert len(list((spool / "queue").glob("*.dcm"))) == 6  # what it says is what is there

        err.write_bytes(b"")
        proc = _listener(gtafl_pkg, port, dest_port, spool, log, err=err)  # the same spool
        assert echo(port, timeout=90), err.read_text()[-2000:]
        assert "6 instance(s) acknowledged before the last stop are queued again" in err.read_text()
        proc.send_signal(signal.SIGTERM)
        assert _until(lambda: "draining 6 instance" in err.read_text(), 60), err.read_text()[-2000:]
        sink = Sink(port=dest_port)  # the destination comes back during the drain
        assert proc.wait(90) == 0, err.read_text()[-2000:]
        text = err.read_text()
        second = _summary(text)
        assert second["delivered"] == 6 and second["failed"] == 0 and second["left"] == 0, text[-2000:]
        assert len(sink.datasets(dicom_sr.SR_STORAGE)) == 6
        assert not list((spool / "queue").glob("*.dcm")) and not any((spool / "outgoing").iterdir())
    finally:
        _reap(proc)
        if sink is not None:
            sink.close()
    assert PHI_ID not in text and not any(str(d.SOPInstanceUID) in text for d in good)


@pytest.mark.slow
def test_outgoing_is_empty_after_a_clean_run_to_orthanc(gtafl_pkg, tmp_path):
    """The SR and heatmap SC copies the workers send from spool/outgoing go once Orthanc acknowledged them."""
    from tests.orthanc import Orthanc

    from tafl.serving.dicom_listener import Destination, Listener

    if not Orthanc.available():
        pytest.skip("Orthanc (Debian: orthanc, orthanc-dicomweb) is not installed")
    pacs = Orthanc(tmp_path / "orthanc").start()
    port, spool = free_port(), tmp_path / "spool"
    lst = Listener(gtafl_pkg, Destination(ae_title=pacs.aet, host="127.0.0.1", port=pacs.dicom_port), port=port,
                   spool=spool, heatmap=True)
    lst.start()
    try:
        sent = instances(SOURCES, 4, seed="outgoing" + str(tmp_path))
        stats = send(port, sent, deadline=60)
        assert stats["acked"] == 4, stats
        assert _until(lambda: lst.stats["delivered"] == 4, 60), lst.stats
        lst.stop(drain=True)
        assert not list((spool / "outgoing").iterdir()) and not list((spool / "queue").iterdir())
        assert len(pacs.by_modality("SR")) == 4 and len(pacs.instances()) == 8  # and the 4 SCs: all acknowledged
    finally:
        lst.stop()
        pacs.stop()


def test_deliverer_removes_its_scratch_copies_when_it_gives_up(tmp_path):
    """A peer that is not there: after the retries the scratch copies go too (the caller keeps the bytes and its
    spool file, and writes them again for its next try), so outgoing holds only what is being sent."""
    from tafl.serving.dicom_listener import Deliverer, Destination

    deliverer = Deliverer(Destination(ae_title="DEST", host="127.0.0.1", port=free_port()), "TAFL", retries=1,
                          backoff=0.01, scratch=tmp_path / "out")
    src = instances(SOURCES[:1], 1, seed="gone")[0]
    sr = dicom_sr.encoded(src, dicom_sr.Finding(0, 0.7), dicom_sr.Algorithm("m", "1", "cd" * 32, ["a", "b"]))[0]
    with pytest.raises(ConnectionError, match="not delivered after 2 attempts"):
        deliverer.deliver([sr])
    assert not any((tmp_path / "out").iterdir())
