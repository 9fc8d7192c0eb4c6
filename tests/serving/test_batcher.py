"""The service's adaptive batcher (tafl.serving.runtime.Batcher) on a numpy model: no call grows past
max_batch, an oversized submission is split and joined back in order, and one request whose images make
the model fail does not fail the requests batched with it. With several lanes, calls run at once, no lane takes more
than its share of the waiting images, and a failed call gives its lane back."""

from __future__ import annotations

import asyncio
import threading

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


def test_two_lanes_run_two_model_calls_at_once():
    """Each call waits at a barrier for a second call: only two calls in flight together get past it."""
    barrier = threading.Barrier(2, timeout=5)

    def model(batch, ratios=None):
        barrier.wait()
        return {"y": batch * 2}

    b = Batcher(model, max_batch=64, max_wait_ms=1, lanes=2)

    async def go():
        xs = [np.full((1, 1), i, np.float32) for i in range(2)]
        return xs, await asyncio.gather(*(b.submit(x) for x in xs))

    xs, outs = run(go())  # one lane: the first call would wait at the barrier alone and break it
    for x, o in zip(xs, outs):
        assert np.array_equal(o["y"], x * 2)


def test_one_lane_runs_one_call_at_a_time():
    barrier = threading.Barrier(2, timeout=0.5)

    def model(batch, ratios=None):
        barrier.wait()
        return {"y": batch}

    b = Batcher(model, max_batch=1, max_wait_ms=1, lanes=1)

    async def go():
        return await asyncio.gather(*(b.submit(np.zeros((1, 1), np.float32)) for _ in range(2)),
                                    return_exceptions=True)

    assert all(isinstance(r, threading.BrokenBarrierError) for r in run(go()))


def test_a_lane_takes_no_more_than_its_share_of_the_waiting_images():
    model = Model()
    b = Batcher(model, max_batch=64, max_wait_ms=20, lanes=2)

    async def go():
        xs = [np.full((1, 1), i, np.float32) for i in range(16)]
        return xs, await asyncio.gather(*(b.submit(x) for x in xs))

    xs, outs = run(go())
    for x, o in zip(xs, outs):
        assert np.array_equal(o["y"], x * 2)
    # 16 images in the house and two lanes: no call takes more than 8 (one lane would take all 16 at once)
    assert sum(model.calls) == 16 and max(model.calls) <= 8 and len(model.calls) >= 2
    assert b.queued == 0 and b.running == 0


def test_failed_calls_give_their_lanes_back():
    model = Model()
    b = Batcher(model, max_batch=4, max_wait_ms=1, lanes=2)

    async def go():
        for _ in range(5):  # more failures than lanes: a leaked lane would leave none for the next request
            with pytest.raises(RuntimeError):
                await b.submit(np.array([[np.nan]], np.float32))
        return await asyncio.wait_for(b.submit(np.ones((3, 1), np.float32)), 5)

    assert np.array_equal(run(go())["y"], np.full((3, 1), 2.0))
    assert b.running == 0


def test_a_cancelled_request_frees_its_lane_for_the_next():
    release = threading.Event()

    def model(batch, ratios=None):
        release.wait(5)
        return {"y": batch}

    b = Batcher(model, max_batch=4, max_wait_ms=1, lanes=1)

    async def go():
        first = asyncio.ensure_future(b.submit(np.zeros((1, 1), np.float32)))
        await asyncio.sleep(0.05)
        first.cancel()  # its call runs on; the lane is free once it ends
        release.set()
        return await asyncio.wait_for(b.submit(np.ones((1, 1), np.float32)), 5)

    assert np.array_equal(run(go())["y"], np.ones((1, 1)))


def test_the_registry_runs_a_package_on_several_lanes_with_the_answers_of_one_call(gtafl_pkg):
    """Concurrent ONNX Runtime calls on one session (a lane each) answer each image as one call on the whole
    batch does; unset, one lane."""
    from tafl.serving.runtime import ModelRegistry

    assert ModelRegistry([str(gtafl_pkg)], providers=["CPUExecutionProvider"]).get(None).batcher.lanes == 1
    model = ModelRegistry([str(gtafl_pkg)], providers=["CPUExecutionProvider"], lanes=3).get(None)
    assert model.batcher.lanes == 3
    _, c, h, w = model.session.get_inputs()[0].shape
    x = np.random.default_rng(0).normal(size=(12, c, h, w)).astype(np.float32)
    whole = model.batcher.run(x)

    async def go():
        return await asyncio.gather(*(model.batcher.submit(x[i:i + 1]) for i in range(len(x))))

    outs = run(go())
    assert len(set(model.batcher.batch_sizes)) >= 1 and max(model.batcher.batch_sizes) <= 4  # 12 images, 3 lanes
    for i, o in enumerate(outs):
        for k, v in whole.items():
            assert np.allclose(o[k], v[i:i + 1], atol=1e-5), k
