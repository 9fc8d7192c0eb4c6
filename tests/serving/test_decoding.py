"""The DICOM decoder processes (tafl.imaging.pool.DecodePool, used by tafl.serving.decoding): the same frames as decoding
in-process, pools retired after their quota without a hang, and a decoder process killed mid-decode is
replaced and its files decoded again (the service answers, nobody gets a 500)."""

from __future__ import annotations

import asyncio
import functools
import io
import os
import signal

import numpy as np
import pydicom
import pytest

from tafl.errors import UnprocessableImage, UnsupportedMedia
from tafl.imaging import decode_image
from tafl.imaging import pool as pool_module
from tafl.serving.decoding import DecodePool, decode_upload
from tests.conftest import digit_png, shared

CT = open(pydicom.data.get_testdata_file("CT_small.dcm"), "rb").read()


@pytest.fixture
def pool():
    p = DecodePool(2)
    p.warm()
    yield p
    p.close()


def test_decoder_processes_give_the_frames_of_an_in_process_decode(pool):
    j2k = shared("dicom", "MR2_J2KR.dcm").read_bytes()

    async def go():
        return await asyncio.gather(decode_upload(pool, CT), decode_upload(pool, j2k), decode_upload(pool, digit_png(1)))

    ct, mr, png = asyncio.run(go())
    for got, data in ((ct, CT), (mr, j2k), (png, digit_png(1))):
        want = decode_image(data)
        assert got.kind == want.kind and got.info == want.info
        assert all(np.array_equal(a, b) for a, b in zip(got.frames, want.frames))
    with pytest.raises(UnsupportedMedia):  # errors come back as themselves, with their status
        asyncio.run(pool.decode(b"%PDF-1.4 not an image"))


def test_a_pool_is_retired_after_its_quota_without_hanging(pool, monkeypatch):
    monkeypatch.setattr(pool_module, "TASKS_PER_POOL", 5)

    async def go():
        return await asyncio.wait_for(asyncio.gather(*(pool.decode(CT) for _ in range(40))), 120)

    out = asyncio.run(go())
    assert len(out) == 40 and all(d.kind == "dicom" for d in out)
    assert pool.recycled >= 5


def test_a_killed_decoder_process_is_replaced_and_its_files_decoded_again(pool):
    big = shared("dicom", "RG3_J2KR.dcm").read_bytes()  # a J2K decode of 0.15-0.3 s
    pids = pool.warm()

    async def go():
        # eight decodes on two processes take at least four decode times: the kill lands while the pool holds
        # work (after 0.3 s four fast decodes could all be done, and nothing would be replaced)
        tasks = [asyncio.ensure_future(pool.decode(big)) for _ in range(8)]
        await asyncio.sleep(0.05)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        return await asyncio.wait_for(asyncio.gather(*tasks), 120)

    out = asyncio.run(go())
    assert len(out) == 8 and all(d.kind == "dicom" and d.frames for d in out)
    assert pool.replaced >= 1
    assert asyncio.run(pool.decode(CT)).kind == "dicom"  # the new pool serves the next request


def test_without_processes_dicom_decodes_in_a_thread():
    p = DecodePool(0)
    assert p.warm() == [] and asyncio.run(decode_upload(p, CT)).kind == "dicom"


def test_a_decode_past_its_deadline_is_a_422_and_the_pool_is_replaced():
    slow = shared("dicom", "RG3_J2KR.dcm").read_bytes()
    p = DecodePool(2, deadline=0.01)
    p.warm()
    try:
        with pytest.raises(UnprocessableImage, match="longer than"):
            asyncio.run(p.decode(slow))
        assert p.replaced == 1
        p.deadline = 60
        assert asyncio.run(p.decode(CT)).kind == "dicom"
    finally:
        p.close()


def test_call_runs_work_in_a_decoder_process_and_hands_back_its_errors(pool):
    """`call` is how the listener and the service build SRs off the GIL: the work runs in another process,
    its answer comes back, and an error it raises reaches the caller as it is (a 4xx stays a 4xx)."""
    from tafl.imaging import dicom_sr

    pids = asyncio.run(pool.call(os.getpid, late="late", crashed="crashed"))
    assert pids != os.getpid()
    src = pydicom.dcmread(pydicom.data.get_testdata_file("CT_small.dcm"), stop_before_pixels=True)
    algo = dicom_sr.Algorithm("m", "1", "ab" * 32, ["a", "b"])
    parts = asyncio.run(pool.call(functools.partial(dicom_sr.encoded, src, dicom_sr.Finding(1, 0.8), algo),
                                  late="late", crashed="crashed"))
    sr = pydicom.dcmread(io.BytesIO(parts[0]))
    assert len(parts) == 1 and sr.SOPClassUID == dicom_sr.SR_STORAGE and sr.StudyInstanceUID == src.StudyInstanceUID
    del src.SOPInstanceUID  # an SR must reference its source: the builder's own 422, not a crash of the pool
    with pytest.raises(UnprocessableImage, match="lacks SOPInstanceUID"):
        asyncio.run(pool.call(functools.partial(dicom_sr.encoded, src, dicom_sr.Finding(1, 0.8), algo),
                              late="late", crashed="crashed"))
    assert pool.replaced == 0


def test_call_past_the_deadline_raises_its_message_and_warm_with_reaches_the_processes():
    import time

    p = DecodePool(2, deadline=0.2)
    try:
        p.warm_with(os.getpid)
        with pytest.raises(UnprocessableImage, match="took too long"):
            asyncio.run(p.call(functools.partial(time.sleep, 5), late="it took too long", crashed="crashed"))
        assert p.replaced == 1
        assert asyncio.run(p.call(functools.partial(max, 1, 2), late="late", crashed="crashed")) == 2
    finally:
        p.close()
    p0 = DecodePool(0)  # no processes: in a thread of this process
    assert asyncio.run(p0.call(os.getpid, late="late", crashed="crashed")) == os.getpid()


def test_a_call_past_its_deadline_on_a_pool_closed_meanwhile_is_its_422_not_an_attribute_error():
    """The service's shutdown closes the pool while a request still waits on it: that request's deadline must end in
    its own 422 (the processes already gone), not in an AttributeError from the shut-down executor's table."""
    import time

    p = DecodePool(1, deadline=0.5)
    p.warm()

    async def close_while_waiting():
        task = asyncio.ensure_future(p.call(functools.partial(time.sleep, 3), late="too long", crashed="crashed"))
        await asyncio.sleep(0.1)
        p.close()  # shutdown(wait=False): the executor's process table becomes None
        return await task

    try:
        with pytest.raises(UnprocessableImage, match="too long"):
            asyncio.run(close_while_waiting())
    finally:
        p.close()
