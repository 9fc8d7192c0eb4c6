"""Issue 32: an export prints no ONNX Runtime warning about the `log_prior_ratio` initializer (the optional
input's default, not a fault), and other output of ORT is not swallowed."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("torch", reason="export needs torch: the train extra")


def test_an_export_prints_no_warning_about_the_prior_input(gtafl_run, tmp_path, capfd):
    from tafl.packaging.export import export_checkpoint

    pkg = export_checkpoint(gtafl_run / "final.pt", tmp_path / "pkg")
    err = capfd.readouterr().err
    assert "log_prior_ratio" in {i.name for i in pkg.session(["CPUExecutionProvider"]).get_overridable_initializers()}
    assert "appears in graph inputs" not in err and "log_prior_ratio" not in err, err[-2000:]


def test_only_that_notice_is_dropped(capfd):
    from tafl.packaging.export import _without_default_input_notice

    with _without_default_input_notice("log_prior_ratio"):
        os.write(2, b"[W:onnxruntime:, graph.cc:1462 Graph] Initializer log_prior_ratio appears in graph inputs "
                    b"and will not be treated as constant value/weight.\n")
        os.write(2, b"[W:onnxruntime:, graph.cc:9 Graph] Removing initializer stray. It is not used by any node\n")
    print("after", file=sys.stderr)
    err = capfd.readouterr().err
    assert "appears in graph inputs" not in err
    assert "Removing initializer stray" in err and err.rstrip().endswith("after")
