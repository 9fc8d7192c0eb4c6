"""Where the service decodes an upload: on the event loop, in a thread, or in a decoder process.

Compressed DICOM decodes in worker processes (`DecodePool`). The JPEG 2000, JPEG-LS and JPEG codecs
behind pydicom (pylibjpeg-openjpeg, pyjpegls, pylibjpeg-libjpeg), RLE and deflate hold the GIL for a
whole frame: in a thread, a 0.2 s J2K decode stalls the event loop, and with it /healthz and every
other request, for its whole duration (docs/results.md, "Soak and where a decode runs": /healthz p99 490 ms in a soak with
threads, 34 ms with processes). A process has its own GIL, so the loop stays free, and a codec that
crashes on a crafted file takes down a decoder process (replaced at once, the file tried once more
and then answered 422), not the service. Native (uncompressed) DICOM, PNG and JPEG stay in-process:
their pixel work is numpy or Pillow, which release the GIL, and the process hop would cost a third of
the throughput on a large uncompressed image (measured); small ones run on the loop, larger ones
(by `decoded_nbytes`, from the headers) in a thread.

TAFL_DECODE_PROCESSES (default: min(2, cores)) sets the pool's size; 0 decodes DICOM in threads too.
"""

from __future__ import annotations

import asyncio
import logging
import os

from tafl.imaging import DecodedImage, decode_image, decoded_nbytes, dicom_transfer_syntax, is_dicom
from tafl.imaging.decode import NATIVE_SYNTAXES
from tafl.imaging.pool import DecodePool

__all__ = ["INLINE_BYTES", "DecodePool", "decode_upload", "default_processes", "needs_codec"]

log = logging.getLogger("tafl.serving")

INLINE_BYTES = 256 * 1024  # decoded bytes below which a thread hop costs more than the work itself


def default_processes() -> int:
    return min(2, os.cpu_count() or 1)


def needs_codec(data: bytes) -> bool:
    """Whether a DICOM's pixel data goes through a codec (compressed or deflated, or a syntax it cannot read),
    which holds the GIL: native (uncompressed) pixel data is numpy work and decodes in a thread."""
    ts = dicom_transfer_syntax(data)
    return ts is not None and ts not in NATIVE_SYNTAXES


async def decode_upload(pool: DecodePool | None, data: bytes, **limits) -> DecodedImage:
    """Decode one upload where it costs the event loop least (see the module's docstring)."""
    if pool is not None and pool.processes and is_dicom(data) and needs_codec(data):
        return await pool.decode(data, **limits)
    if decoded_nbytes(data) <= INLINE_BYTES:
        return decode_image(data, **limits)
    return await asyncio.to_thread(decode_image, data, **limits)
