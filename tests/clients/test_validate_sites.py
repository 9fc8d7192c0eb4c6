"""`tafl validate` on HAM10000's four real sites (issue 55's target): a package trained across the Fed-ISIC2019
sites (small and short: 16 px, one round; the method is not what is checked) is validated by each site on its own
test fold, and every number of each site's report equals scikit-learn's, statsmodels' and the calibration curve's
on the same images to 1e-9. Needs ../shared/data (skipped without it) and torch to train."""

from __future__ import annotations

import csv

import numpy as np
import pytest

pytest.importorskip("torch", reason="needs torch: the train extra (pip install -e '.[train]')")
pytest.importorskip("statsmodels")

from tests.clients.test_validate import check_independently  # noqa: E402
from tests.conftest import CONFIGS, shared  # noqa: E402

pytestmark = pytest.mark.slow


def test_each_site_validates_the_package_on_its_own_test_fold(tmp_path):
    from tafl.clients.validate import validate
    from tafl.imaging import decode_image
    from tafl.packaging.export import export_checkpoint
    from tafl.training.config import load_config
    from tafl.training.simulator import train

    root = shared("ham10000")
    split = shared("ham10000", "fed-isic2019", "split.csv")
    over = {"dataset": "folder", "data_root": str(root), "labels": "fed-isic2019/split.csv",
            "image_column": "image_id", "label_column": "dx", "group_column": "lesion_id",
            "client_column": "center_name", "split_column": "fold", "img_size": 16, "rounds": 1, "local_epochs": 1,
            "frac": 1.0, "imbalance_factor": None, "ood_dicom_dir": None}
    train(load_config(CONFIGS / "smoke.yaml", over), tmp_path / "run", progress=False)
    pkg = export_checkpoint(tmp_path / "run" / "final.pt", tmp_path / "pkg", domain=("detector=off",))
    with open(split, newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r["fold"] == "test"]
    names = list(pkg.class_names)
    sites = sorted({r["center_name"] for r in rows})
    assert len(sites) == 4
    session = pkg.session(["CPUExecutionProvider"])
    for site in sites:
        mine = [r for r in rows if r["center_name"] == site]
        labels = tmp_path / f"{site}.csv"
        with open(labels, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["path", "label"])
            w.writerows([(r["image_id"], r["dx"]) for r in mine])
        report = validate(tmp_path / "pkg", root / "images", labels, criteria=["balanced_accuracy>=0.0"])
        assert report["data"]["images"] == len(mine) == report["data"]["answered"]
        out = pkg.run(session, [decode_image((root / "images" / f"{r['image_id']}.jpg").read_bytes()).frames[0]
                                for r in mine])
        y = np.array([names.index(r["dx"]) for r in mine])
        check_independently(report, out, y, names)
        assert report["passed"] and report["package"]["model_sha256"] == pkg.files["model.onnx"]
