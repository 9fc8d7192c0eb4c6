"""FedAvg aggregation against a hand computation, and rejection of broken client updates."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch", reason="needs torch: the train extra (pip install -e '.[train]')")

from tafl.training.aggregate import check_results, weighted_average  # noqa: E402
from tafl.training.contract import ClientResult  # noqa: E402


def test_weighted_average_matches_hand_computation():
    a = {"w": torch.tensor([1.0, 2.0]), "bn.running_mean": torch.tensor([0.0]), "bn.num_batches_tracked": torch.tensor(3)}
    b = {"w": torch.tensor([3.0, 6.0]), "bn.running_mean": torch.tensor([4.0]), "bn.num_batches_tracked": torch.tensor(5)}
    avg = weighted_average([a, b], [100, 300])
    # (100·1 + 300·3)/400 = 2.5 ; (100·2 + 300·6)/400 = 5.0
    assert torch.allclose(avg["w"], torch.tensor([2.5, 5.0]))
    assert torch.allclose(avg["bn.running_mean"], torch.tensor([3.0]))  # BatchNorm buffers are averaged too
    assert int(avg["bn.num_batches_tracked"]) == 5
    assert avg["w"].dtype == torch.float32


def test_check_results_drops_nan_and_wrong_shapes(caplog):
    ref = {"w": torch.zeros(2, 2)}
    ok = ClientResult(1, 10, {"w": torch.ones(2, 2)})
    nan = ClientResult(2, 10, {"w": torch.tensor([[1.0, float("nan")], [0.0, 0.0]])})
    inf = ClientResult(3, 10, {"w": torch.full((2, 2), float("inf"))})
    shape = ClientResult(4, 10, {"w": torch.ones(3, 2)})
    missing = ClientResult(5, 10, {})
    with caplog.at_level(logging.WARNING):
        good = check_results(ref, [ok, nan, inf, shape, missing])
    assert [r.client_id for r in good] == [1]
    text = caplog.text
    assert "client 2" in text and "NaN" in text and "client 4" in text and "shape" in text and "client 5" in text
