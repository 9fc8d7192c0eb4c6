"""The baselines of issue 33 beside the product's methods: each site training with its own logit adjustment
(`local_adjust`, FedLC-style label-skew calibration) and the pooled (centralised) ceiling (`centralised`)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: the train extra (pip install -e '.[train]')")

from tafl.errors import ConfigError  # noqa: E402
from tafl.training.config import load_config  # noqa: E402
from tests.conftest import CONFIGS  # noqa: E402


def test_a_site_without_a_class_does_not_push_that_class_down():
    import torch.nn.functional as F

    from tafl.training.local import logit_adjusted_loss

    counts = torch.tensor([30, 0, 10])  # this site never saw class 1
    z = torch.zeros(4, 3, requires_grad=True)
    y = torch.tensor([0, 0, 2, 0])
    logit_adjusted_loss(counts, 1.0)(z, y).backward()
    assert z.grad[:, 1].abs().max() < 1e-5  # no gradient on the absent class
    z2 = torch.zeros(4, 3, requires_grad=True)
    F.cross_entropy(z2, y).backward()
    assert (z2.grad[:, 1] > 0.05).all()  # plain cross-entropy lowers it on every image
    # τ = 0 is plain cross-entropy; at τ = 1 the optimum of a constant score is the uniform mix, not the site's
    assert logit_adjusted_loss(counts, 0.0)(z2.detach(), y) == pytest.approx(float(F.cross_entropy(z2.detach(), y)))
    w = torch.zeros(3, requires_grad=True)
    opt = torch.optim.SGD([w], lr=1.0)
    labels = torch.tensor([0] * 30 + [2] * 10)
    for _ in range(300):
        opt.zero_grad()
        logit_adjusted_loss(torch.tensor([30, 0, 10]), 1.0)(w.expand(40, 3), labels).backward()
        opt.step()
    assert abs(float((w[0] - w[2]).detach())) < 0.05  # 3:1 counts, yet equal scores: the local mix is left out


def test_the_model_describes_a_flattened_mix_and_the_option_is_checked():
    from tafl.imaging import Preprocess
    from tafl.training.contract import GlobalState
    from tafl.training.methods.fedavg import FedAvg
    from tafl.training.models import ModelConfig

    state = GlobalState({}, {"global_counts": torch.tensor([80.0, 15.0, 5.0])}, {})

    def prior(tau: float) -> np.ndarray:
        cfg = load_config(CONFIGS / "smoke.yaml", {"method": "fedavg", "local_adjust": tau})
        m = FedAvg(cfg, ModelConfig(backbone="resnet8", num_classes=3, in_chans=1, img_size=8, width=0.125),
                   Preprocess(size=8, channels=1, mean=(0.0,), std=(1.0,)))
        return m.default_source_prior(state)

    assert prior(0.0) == pytest.approx([0.80, 0.15, 0.05])
    assert prior(1.0) == pytest.approx([1 / 3] * 3)  # balanced scores: the uniform mix
    half = np.sqrt([80.0, 15.0, 5.0])
    assert prior(0.5) == pytest.approx(half / half.sum())
    with pytest.raises(ConfigError, match="local_adjust.*applies to fedavg and fedprox, not gtafl"):
        load_config(CONFIGS / "smoke.yaml", {"method": "gtafl", "local_adjust": 1.0})
    with pytest.raises(ConfigError, match="local_adjust.*must be >= 0"):
        load_config(CONFIGS / "smoke.yaml", {"method": "fedavg", "local_adjust": -1.0})


def test_centralised_pools_every_site_into_one_client_and_keeps_the_sites(tmp_path):
    from tafl.training.simulator import prepare
    from tests.training.test_sites import make_sites, site_cfg

    root = make_sites(tmp_path / "d")
    cfg = site_cfg(root, centralised=True)
    prep = prepare(cfg)
    assert cfg.clients == 1 and cfg.frac == 1.0 and len(prep.parts) == 1
    assert sorted(prep.parts[0]) == list(range(len(prep.train)))  # every site's training rows, once
    assert prep.dataset.site_names == ["east", "north", "south"]  # still evaluated site by site
