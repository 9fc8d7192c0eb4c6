"""Worker processes for work that holds the GIL: decoding compressed DICOM, building structured reports.

`DecodePool` is a spawned ProcessPoolExecutor (no ONNX Runtime threads or locks are inherited) with a deadline
per task and a replacement for a process that dies. The service and the DICOM listener decode and build their
SRs in it (tafl.serving.decoding says when); `tafl score` builds its SRs in it (tafl.clients.dicom_out).
Standard library, tafl.errors and tafl.imaging.decode only.
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
from tafl.procs import bounded_malloc_for_children
from tafl.imaging.decode import DecodedImage, decode_image

log = logging.getLogger("tafl.serving")

TASKS_PER_POOL = 2000  # files the decoder processes decode before fresh ones replace them


def _warm() -> int:  # imports the decoder (pydicom, codecs) in a fresh worker
    import tafl.imaging.decode  # noqa: F401

    return os.getpid()


class DecodePool:
    """Decoder processes for DICOM uploads (spawned, so no ONNX Runtime threads or locks are inherited)."""

    def __init__(self, processes: int, deadline: float = 15.0):
        self.processes = max(0, processes)
        self.deadline = deadline  # seconds one file may take in a decoder process
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
                bounded_malloc_for_children()
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

    def warm_with(self, fn) -> None:
        """Run `fn` (picklable, no arguments) as many times as there are decoder processes, at once, so that the
        pool spreads it over them: to load what a process's first real task would otherwise pay for. In this
        process when there are none."""
        if not self.processes:
            fn()
            return
        ex = self._executor()
        for f in [ex.submit(fn) for _ in range(self.processes)]:
            f.result()

    def _replace(self, broken: ProcessPoolExecutor, kill: bool = False) -> None:
        with self._lock:
            if self._pool is broken:
                self._pool = None
                self.replaced += 1
        if kill:  # a decode past its deadline: its process is stopped, not left to burn a core
            # the executor's own process table; None once that pool was shut down (a close while this call waited)
            for proc in list((getattr(broken, "_processes", None) or {}).values()):
                proc.kill()
        broken.shutdown(wait=False, cancel_futures=True)

    async def decode(self, data: bytes, **limits) -> DecodedImage:
        if not self.processes:
            return await asyncio.to_thread(decode_image, data, **limits)
        return await self.call(
            functools.partial(decode_image, data, **limits),
            late=f"the DICOM file took longer than {self.deadline:g} s to decode: export it uncompressed, or as "
                 "fewer or smaller frames, and resend it",
            crashed="the DICOM file made the image decoder fail: check that it is a complete, standard image "
                    "object, export it again and resend it")

    async def call(self, fn, *, late: str, crashed: str):
        """`fn()` (picklable) in a decoder process: for work that would hold the GIL, such as a codec or building
        a structured report with highdicom. Past the deadline its processes are replaced and `late` is raised
        (UnprocessableImage); a process that dies is replaced and `fn` tried once more, then `crashed` is raised.
        An exception `fn` raises reaches the caller as it is. Without processes, `fn` runs in a thread."""
        if not self.processes:
            return await asyncio.to_thread(fn)
        for attempt in (1, 2):
            ex = self._executor()
            try:
                return await asyncio.wait_for(asyncio.wrap_future(ex.submit(fn)), self.deadline)
            except asyncio.TimeoutError:
                # bounded time: work still running after the deadline (or a process that stopped answering)
                # costs its processes; the work they held is tried again on new ones
                log.warning("work in a decoder process took longer than %g s; the processes are replaced",
                            self.deadline)
                self._replace(ex, kill=True)
                raise UnprocessableImage(late) from None
            except BrokenProcessPool:
                # a decoder process died (a codec crash or the OOM killer) while this pool had work: a new pool
                # serves the next requests. Every file the dead pool held is tried once more, so only the file
                # that kills a decoder twice is answered as undecodable.
                log.warning("a decoder process died; starting new ones")
                self._replace(ex)
        raise UnprocessableImage(crashed)

    def close(self, wait: bool = False) -> None:
        """Stop the decoder processes. With `wait` (the service's shutdown) also wait until they and the
        pool's queues are gone, and release the queues' semaphores: uvicorn ends its worker by re-raising
        SIGTERM after its shutdown, so no atexit handler runs there, and semaphores still registered then
        are reported by multiprocessing's resource tracker as "leaked" (5 per pool)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is None:
            return
        pool.shutdown(wait=wait, cancel_futures=True)
        if wait:
            del pool  # the last reference to the pool's queues: their semaphores unregister now
            import gc

            gc.collect()
