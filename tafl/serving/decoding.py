"""Where the service decodes an upload: on the event loop, in a thread, or in a decoder process.

DICOM decoding runs in worker processes (`DecodePool`). The JPEG 2000, JPEG-LS and lossless JPEG
codecs behind pydicom (pylibjpeg-openjpeg, pyjpegls, pylibjpeg-libjpeg) hold the GIL for a whole
frame, and pydicom's parsing is pure Python: in a thread, a 0.2 s J2K decode stalls the event loop,
and with it /healthz and every other request, for its whole duration (measured in
docs/results.md §8). A process has its own GIL, so the loop stays free, decoding uses both cores,
and a codec that crashes on a crafted file takes down a decoder process (replaced at once and the
file answered 422), not the service. PNG and JPEG stay in-process: Pillow releases the GIL while it
decodes; small ones run on the loop, larger ones (by `decoded_nbytes`, from the headers) in a thread.

TAFL_DECODE_PROCESSES (default: min(2, cores)) sets the pool's size; 0 decodes DICOM in threads too.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from tafl.errors import UnprocessableImage
from tafl.imaging import DecodedImage, decode_image, decoded_nbytes, is_dicom

log = logging.getLogger("tafl.serving")

INLINE_BYTES = 256 * 1024  # decoded bytes below which a thread hop costs more than the work itself
TASKS_PER_POOL = 2000  # files the decoder processes decode before fresh ones replace them


def default_processes() -> int:
    return min(2, os.cpu_count() or 1)


def _warm() -> int:  # imports the decoder (pydicom, codecs) in a fresh worker
    import tafl.imaging.decode  # noqa: F401

    return os.getpid()


class DecodePool:
    """Decoder processes for DICOM uploads (spawned, so no ONNX Runtime threads or locks are inherited)."""

    def __init__(self, processes: int):
        self.processes = max(0, processes)
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self.replaced = 0  # pools rebuilt after a decoder process died
        self.recycled = 0  # pools retired after TASKS_PER_POOL files
        self._tasks = 0

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                # Memory: a decoder's large arrays are mmapped and so go back to the system when freed (glibc's
                # threshold would otherwise rise and keep them on the heap), and the pool is replaced after
                # TASKS_PER_POOL files, so what fragmentation remains cannot add up over days. (Not with
                # max_tasks_per_child: on Python 3.11 a pool can hang when a worker retires with work queued.)
                os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(256 * 1024))
                self._pool = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"))
                self._tasks = 0
            self._tasks += 1
            if self._tasks > TASKS_PER_POOL:  # retire this pool: it finishes what it holds, a new one takes over
                old, self._pool = self._pool, ProcessPoolExecutor(self.processes,
                                                                  mp_context=multiprocessing.get_context("spawn"))
                self._tasks, self.recycled = 1, self.recycled + 1
                for _ in range(self.processes):  # the new processes start now, not on the next request's time
                    self._pool.submit(_warm)
                old.shutdown(wait=False)
            return self._pool

    def warm(self) -> list[int]:
        """Start every decoder process now (a first request should not pay for the spawn)."""
        if not self.processes:
            return []
        ex = self._executor()
        return sorted({f.result() for f in [ex.submit(_warm) for _ in range(self.processes * 2)]})

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is broken:
                self._pool = None
                self.replaced += 1
        broken.shutdown(wait=False, cancel_futures=True)

    async def decode(self, data: bytes, **limits) -> DecodedImage:
        if not self.processes:
            return await asyncio.to_thread(decode_image, data, **limits)
        for attempt in (1, 2):
            ex = self._executor()
            try:
                return await asyncio.get_running_loop().run_in_executor(ex, functools.partial(decode_image, data,
                                                                                           **limits))
            except BrokenProcessPool:
                # a decoder process died (a codec crash or the OOM killer) while this pool had work: a new pool
                # serves the next requests. Every file the dead pool held is tried once more, so only the file
                # that kills a decoder twice is answered as undecodable.
                log.warning("a DICOM decoder process died; starting new ones")
                self._replace(ex)
        raise UnprocessableImage("the DICOM file made the image decoder fail: check that it is a complete, "
                                 "standard image object, export it again and resend it")

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


async def decode_upload(pool: DecodePool | None, data: bytes, **limits) -> DecodedImage:
    """Decode one upload where it costs the event loop least (see the module's docstring)."""
    if pool is not None and pool.processes and is_dicom(data):
        return await pool.decode(data, **limits)
    if decoded_nbytes(data) <= INLINE_BYTES:
        return decode_image(data, **limits)
    return await asyncio.to_thread(decode_image, data, **limits)
