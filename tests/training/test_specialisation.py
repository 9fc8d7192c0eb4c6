"""The GTAFL experts specialise as designed on real data (issue 12).

A small federated run on DermaMNIST (../shared/data/medmnist; skipped where it is absent) with the
product's GTAFL defaults, scaled down to finish in a few minutes on 2 cores, and the property read
from the validation split: the forward expert beats the backward expert on forward50, and the
backward expert beats the forward expert on backward50. (The synthetic version of the property
is `test_gtafl.py::test_experts_specialise_the_backward_expert_wins_backward50`.)
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="needs torch: the train extra (pip install -e '.[train]')")

from tafl.training.config import load_config  # noqa: E402
from tafl.training.simulator import train  # noqa: E402
from tests.conftest import CONFIGS, shared  # noqa: E402

pytestmark = pytest.mark.slow

# the benchmark protocol (natural long tail, CReFF's equal-size Dirichlet split) at a CI scale:
# native 28 px, half-width ResNet-8, 10 clients (5 a round), 1 local epoch, 6 rounds, no SimCLR
CI_SCALE = {"method": "gtafl", "dataset": "dermamnist", "img_size": 28, "width": 0.5, "clients": 10, "frac": 0.5,
            "rounds": 6, "local_epochs": 1, "cl": False, "eval_every": 6}


def test_experts_specialise_the_right_way_round_on_dermamnist(tmp_path):
    root = shared("medmnist", "dermamnist.npz").parent
    cfg = load_config(CONFIGS / "benchmark.yaml", {**CI_SCALE, "data_root": str(root)})
    report = train(cfg, tmp_path / "run", progress=False)
    val = report["validation"]["experts"]
    assert set(val) == {"forward", "uniform", "backward"}
    assert val["forward"]["forward50"] > val["backward"]["forward50"], val
    assert val["backward"]["backward50"] > val["forward"]["backward50"], val
    # the same experts on the test split, and the vote rules the report compares
    test = report["experts"]
    assert test["forward"]["forward50"]["accuracy"] > test["backward"]["forward50"]["accuracy"]
    assert set(report["validation"]["vote_rules"]) >= {"hard", "soft", "confidence", "learned"}
