"""Packaging: the preprocessing spec shared by training and serving, ONNX model packages."""

from tafl.packaging.preprocess import Preprocess

__all__ = ["Preprocess"]
