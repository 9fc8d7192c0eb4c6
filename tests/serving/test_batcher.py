"""The service's adaptive batcher (tafl.serving.runtime.Batcher) on a numpy model: no call grows past
max_batch, an oversized submission is split and joined back in order, and one request whose images make
the model fail does not fail the requests batched with it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tafl.serving.runtime import Batcher


class Model:
    """Doubles its input; refuses any batch holding a NaN (as a runtime refuses a bad tensor)."""

    def __init__(self):
        self.calls: list[int] = []

    def __call__(self, batch: np.ndarray, ratios=None) -> dict[str, np.ndarray]:
        self.calls.append(len(batch))
        if np.isnan(batch).any():
            raise RuntimeError("non-finite input")
        return {"y": batch * 2, "prior": np.zeros((len(batch), 2)) if ratios is None else ratios}


def run(coro):
    return asyncio.run(coro)


def test_an_oversized_submission_is_split_to_max_batch_and_joined_in_order():
    model = Model()
    b = Batcher(model, max_batch=8, max_wait_ms=1)

    async def go():
        x = np.arange(29, dtype=np.float32).reshape(29, 1)
        return await b.submit(x)

    out = run(go())
    assert np.array_equal(out["y"][:, 0], np.arange(29) * 2)
    assert max(model.calls) <= 8 and sum(model.calls) == 29


def test_concurrent_submissions_never_form_a_call_past_max_batch():
    model = Model()
    b = Batcher(model, max_batch=10, max_wait_ms=20)

    async def go():
        xs = [np.full((n, 1), i, np.float32) for i, n in enumerate([6, 6, 3, 9, 1, 10])]
        outs = await asyncio.gather(*(b.submit(x) for x in xs))
        return xs, outs

    xs, outs = run(go())
    for x, o in zip(xs, outs):
        assert np.array_equal(o["y"], x * 2)
    assert max(model.calls) <= 10 and sum(model.calls) == 35


def test_one_failing_request_does_not_fail_the_others_in_its_batch():
    model = Model()
    b = Batcher(model, max_batch=64, max_wait_ms=30)

    async def go():
        good = [np.full((2, 1), i, np.float32) for i in range(4)]
        bad = np.array([[1.0], [np.nan]], np.float32)
        ratio = np.array([0.5, -0.5], np.float32)
        tasks = [b.submit(good[0]), b.submit(bad), b.submit(good[1], ratio), b.submit(good[2]), b.submit(good[3])]
        return good, ratio, await asyncio.gather(*tasks, return_exceptions=True)

    good, ratio, res = run(go())
    assert isinstance(res[1], RuntimeError)
    for g, r in zip(good, [res[0], res[2], res[3], res[4]]):
        assert not isinstance(r, Exception) and np.array_equal(r["y"], g * 2)
    assert np.allclose(res[2]["prior"], ratio)  # the prior a request asked for survives the re-run alone
    assert b.isolated_failures == 1 and model.calls[0] == 10  # first together, then one by one


def test_a_lone_failing_request_gets_its_own_error():
    b = Batcher(Model(), max_batch=4, max_wait_ms=1)
    with pytest.raises(RuntimeError):
        run(b.submit(np.array([[np.nan]], np.float32)))
