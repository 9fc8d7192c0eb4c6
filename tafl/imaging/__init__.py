"""The one image path from file bytes to model input, shared by training, export, serving and scoring.

    bytes --decode_image--> uint8 frames --Preprocess.to_uint8--> (side, side, channels) uint8
          --Preprocess.normalize--> float32 (N, C, H, W) network input

`decoded_nbytes` tells, from headers only, how many bytes a `decode_image` will allocate (the
service's on-loop / off-loop choice). `decode_image` reads DICOM, PNG and JPEG (and, for training folders, BMP and TIFF) with the same
limits, EXIF orientation, alpha compositing, 16-bit and DICOM display pipeline wherever it is
called; `Preprocess` is the resize/normalise spec a model package records. NumPy, Pillow and
pydicom only (no torch): serving and in-process scoring run without it. Below training, packaging,
serving and clients; it imports nothing of tafl but `tafl.errors`.
"""

from tafl.imaging.decode import (UNKNOWN_NBYTES, DecodedImage, decode_file, decode_image, decoded_nbytes,
                                 dicom_transfer_syntax, is_dicom)
from tafl.imaging.pixels import minmax_u8, pil_to_uint8
from tafl.imaging.preprocess import Preprocess

__all__ = ["UNKNOWN_NBYTES", "DecodedImage", "Preprocess", "decode_file", "decode_image", "decoded_nbytes",
           "dicom_transfer_syntax", "is_dicom", "minmax_u8", "pil_to_uint8"]
