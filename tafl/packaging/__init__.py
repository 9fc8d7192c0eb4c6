"""Packaging: ONNX model packages (graph, metadata, model card, checksums) and the preprocessing
spec that training, export and serving share. The loader needs no torch; export does."""

from tafl.packaging.metadata import PackageMetadata
from tafl.packaging.package import ModelPackage, list_packages, load_package
from tafl.imaging import Preprocess

__all__ = ["ModelPackage", "PackageMetadata", "Preprocess", "list_packages", "load_package"]
