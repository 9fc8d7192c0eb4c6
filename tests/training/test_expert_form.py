"""GTAFL's experts specialise by construction (`expert_form: shifted`, docs/decisions.md, "Shifted experts"), and GTAFL's vote can
take a validation-chosen move of every expert (`decision: validation`)."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: the train extra (pip install -e '.[train]')")

from tafl.training import gff  # noqa: E402
from tafl.training.decision import SIGNED_GRID, offset_for  # noqa: E402


def _separable_banks(counts, dim=8, spread=0.05, seed=0):
    """Banks whose classes sit far apart (what gradient matching tends to make): plain CE can then drive its loss
    down by growing W and never has to encode the bank's class mix in the bias."""
    gen = torch.Generator().manual_seed(seed)
    counts = np.asarray(counts)
    E, C = counts.shape
    M = int(counts.max())
    centres = torch.eye(C, dim) * 3.0
    feats = centres[None, :, None, :] + spread * torch.randn(E, C, M, dim, generator=gen)
    return gff.GFFBanks(feats, torch.as_tensor(counts))


def _head_share(W, b, feats, head):
    """Per expert, the share of `feats` it assigns to class `head`."""
    z = torch.einsum("nd,ecd->enc", feats, W) + b[:, None, :]
    return (z.argmax(-1) == head).float().mean(1)


def test_shifted_experts_lean_in_their_banks_order_where_trained_ones_do_not():
    counts = np.array([[400, 100, 40, 10], [100, 100, 100, 100], [10, 40, 100, 400]])  # forward, uniform, backward
    banks = _separable_banks(counts)
    E, C, D = 3, 4, 8
    gen = torch.Generator().manual_seed(1)
    W0, b0 = gff.init_heads(E, C, D, gen)
    Wt, bt, _ = gff.retrain(banks, W0, b0, 30, 0.05, 32, torch.Generator().manual_seed(2))
    Ws, bs, _ = gff.balanced_experts(banks, W0, b0, 30, 0.05, 32, torch.Generator().manual_seed(2))
    # ambiguous features (between every class centre): where the prior has to decide
    amb = torch.full((500, D), 0.0) + 0.3 * torch.randn(500, D, generator=torch.Generator().manual_seed(3))
    shared = _head_share(Ws, bs, amb, head=0)
    assert shared[0] > shared[1] > shared[2]  # forward calls the head class most, backward least
    assert shared[0] - shared[2] > 0.5
    trained = _head_share(Wt, bt, amb, head=0)
    assert abs(float(trained[0] - trained[2])) < float(shared[0] - shared[2]) - 0.3
    # the shifted experts are one head plus each bank's centred log mix
    assert torch.allclose(Ws[0], Ws[1]) and torch.allclose(Ws[1], Ws[2])
    lq = gff.bank_log_mix(banks)
    assert torch.allclose(bs - bs.mean(0, keepdim=True), lq - lq.mean(0, keepdim=True), atol=1e-5)


def test_the_shared_head_is_balanced_whatever_the_banks_mix():
    """Overlapping classes: the logit-adjusted loss makes every bank estimate the same balanced scorer, so the
    shared head's decisions on a balanced sample are near balanced, while plain CE on the forward bank is not."""
    gen = torch.Generator().manual_seed(4)
    counts = np.array([[600, 60], [200, 200], [60, 600]])
    M, D = 600, 2
    means = torch.tensor([[0.5, 0.0], [-0.5, 0.0]])
    feats = means[None, :, None, :] + torch.randn(3, 2, M, D, generator=gen)
    banks = gff.GFFBanks(feats, torch.as_tensor(counts))
    W0, b0 = gff.init_heads(3, 2, D, gen)
    Ws, bs, _ = gff.balanced_experts(banks, W0, b0, 20, 0.05, 64, torch.Generator().manual_seed(5))
    Wt, bt, _ = gff.retrain(banks, W0, b0, 20, 0.05, 64, torch.Generator().manual_seed(5))
    test = torch.cat([means[0] + torch.randn(2000, D, generator=gen), means[1] + torch.randn(2000, D, generator=gen)])
    head_bal = (test @ Ws[0].T + (bs.mean(0))).argmax(1)  # the shared head without any expert's shift
    assert abs(float((head_bal == 0).float().mean()) - 0.5) < 0.08
    forward_plain = (test @ Wt[0].T + bt[0]).argmax(1)
    assert float((forward_plain == 0).float().mean()) > 0.6


def test_the_signed_grid_starts_at_zero_and_is_symmetric():
    assert SIGNED_GRID[0] == 0.0 and len(SIGNED_GRID) == 21
    assert sorted(SIGNED_GRID) == sorted(-t for t in SIGNED_GRID)
    assert np.allclose(offset_for(-0.5, [0.7, 0.3]), -offset_for(0.5, [0.7, 0.3]))


@pytest.fixture(scope="module")
def gtafl_op_run(tmp_path_factory):
    from tafl.training.config import load_config
    from tafl.training.simulator import train

    from tests.conftest import CONFIGS, SMOKE_GTAFL

    out = tmp_path_factory.mktemp("gtafl_op") / "run"
    train(load_config(CONFIGS / "smoke.yaml", {**SMOKE_GTAFL, "decision": "validation", "imbalance_factor": 50}),
          out, progress=False)
    return out


@pytest.mark.slow
def test_gtafls_vote_moves_on_validation_and_the_package_carries_it(gtafl_op_run, tmp_path):
    """The chosen τ is the best on validation; the experts' biases carry its offset (the vote on the final state
    scores what the record says); the package's graph decides as the report did and describes the move."""
    from tafl.packaging.export import export_checkpoint
    from tafl.training.checkpoint import load_checkpoint
    from tafl.training.config import RunConfig
    from tafl.training.models import ModelConfig
    from tafl.training.data import load_dataset
    from tafl.training.decision import uniform_macro_f1
    from tafl.training.evaluate import predict
    from tafl.training.simulator import make_method
    from tafl.training.contract import GlobalState
    from tafl.imaging import Preprocess

    report = json.loads((gtafl_op_run / "report.json").read_text())
    rec = report["decision"]
    assert rec["kind"] == "expert_shift" and rec["tau"] in SIGNED_GRID
    assert rec["scores"][f"{rec['tau']:.1f}"] == max(rec["scores"].values())
    ck = load_checkpoint(gtafl_op_run / "final.pt")
    cfg = RunConfig.from_dict(ck["run_config"])
    cfg.img_size, cfg.channels = ck["preprocess"]["size"], ck["preprocess"]["channels"]
    ds = load_dataset(cfg.validate())
    method = make_method(cfg, ModelConfig.from_dict(ck["model_config"]), Preprocess.from_dict(ck["preprocess"]))
    state = GlobalState.from_dict(ck["state"])
    out = predict(method.inference_model(state), ds.val.images, method.normalize, 256, keys=method.output_keys)
    assert rec["criterion_key"] == "macro_f1"  # the default criterion
    assert uniform_macro_f1(out["label"], ds.val.labels, len(rec["offset"])) == pytest.approx(
        rec["scores"][f"{rec['tau']:.1f}"], abs=1e-9)
    # the experts still differ by their banks' log mix only (expert_form: shifted is the default)
    W, b = state.extras["expert.weight"], state.extras["expert.bias"]
    assert torch.allclose(W[0], W[2])
    lq = gff.bank_log_mix(gff.GFFBanks(state.extras["gff.features"], state.extras["gff.counts"]))
    assert torch.allclose(b[0] - b[2], lq[0] - lq[2], atol=1e-4)
    pkg = export_checkpoint(gtafl_op_run / "final.pt", tmp_path / "pkg", name="op-gtafl")
    spec = pkg.metadata["decision"]
    assert spec["tau"] == rec["tau"] and "experts" in spec["rule"]
    want = predict(method.inference_model(state), ds.test.images[:64], method.normalize, 64, keys=("label",))["label"]
    got = pkg.run(pkg.session(), list(ds.test.images[:64]))["label"]
    assert (np.asarray(got).reshape(-1) == want).mean() >= 0.95
