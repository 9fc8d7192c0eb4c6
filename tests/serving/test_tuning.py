"""The service's default plan (tafl.serving.tuning): worker processes and model lanes chosen from each package's
measured cost and the machine, stated in /models and the log, with TAFL_WORKERS and TAFL_MODEL_LANES deciding where
they are set; a real `bentoml serve` started with no TAFL_* setting runs what the plan says."""

from __future__ import annotations

import time

import httpx
import numpy as np
import psutil
import pytest

from tafl.packaging import load_package
from tafl.procs import MALLOC_ENV
from tafl.serving import tuning
from tafl.serving.settings import Settings, handed_plan, service_plan, service_workers
from tafl.serving.tuning import CPU_LANES, WORKER_LANES, WORKER_MB, ModelCost, Plan, choose, measure
from tests.conftest import digit_png

CHEAP = ModelCost("a" * 64, "vit", 0.6)  # the ViT-tiny probe: 0.6 core-ms an image
DEAR = ModelCost("b" * 64, "resnet8", 4.2)  # the ResNet-8 probe at paper width: 4.2


def test_a_cheap_model_gets_two_workers_of_two_lanes_and_a_compute_bound_one_one_worker_of_three():
    cheap = choose([CHEAP], cores=2, available_mb=8000)
    assert (cheap.workers, cheap.lanes) == (2, WORKER_LANES) and "cheap" in cheap.workers_from
    dear = choose([DEAR], cores=2, available_mb=8000)
    assert (dear.workers, dear.lanes) == (1, CPU_LANES) and "resnet8 costs 4.20 core-ms" in dear.workers_from
    both = choose([CHEAP, DEAR], cores=2, available_mb=8000)  # every package is in every worker: the dear one decides
    assert (both.workers, both.lanes) == (1, CPU_LANES)


@pytest.mark.parametrize("kw,workers,lanes,why", [
    ({"reloads": True}, 1, CPU_LANES, "/admin/reload needs one worker"),
    ({"available_mb": WORKER_MB}, 1, CPU_LANES, "MB free"),
    ({"cores": 1}, 1, 1, "one core"),
    ({"gpu": True}, 1, 1, "GPU"),
    ({"set_workers": 3}, 3, WORKER_LANES, "TAFL_WORKERS"),
    ({"set_lanes": 5}, 2, 5, "cheap"),
])
def test_what_keeps_the_default_at_one_worker_and_what_settings_decide(kw, workers, lanes, why):
    args = {"cores": 2, "available_mb": 8000, **kw}
    plan = choose([CHEAP], **args)
    assert (plan.workers, plan.lanes) == (workers, lanes)
    assert why in plan.workers_from
    if "set_lanes" in kw:
        assert plan.lanes_from == "TAFL_MODEL_LANES"
    assert choose([], cores=2).workers == 1  # nothing measured (a package that does not load): the safe count


def test_the_cost_is_one_threads_cpu_time_per_image(gtafl_pkg, dafl_pkg):
    for path in (gtafl_pkg, dafl_pkg):
        pkg = load_package(path)
        cost = measure(pkg)
        assert cost.sha256 == pkg.files["model.onnx"] and cost.name == pkg.name
        session = load_package(path).session(["CPUExecutionProvider"], threads=1)
        spec = session.get_inputs()[0]
        x = np.zeros([tuning.MEASURE_BATCH, *spec.shape[1:]], np.float32)
        t0 = time.perf_counter()
        session.run(None, {spec.name: x})
        wall = 1000 * (time.perf_counter() - t0) / tuning.MEASURE_BATCH
        assert 0 < cost.core_ms <= 1.5 * wall + 0.01  # CPU time on one thread: never much above that thread's wall


def test_a_plan_is_handed_on_only_under_the_settings_it_was_chosen_for(gtafl_pkg, monkeypatch):
    for name in ("TAFL_WORKERS", "TAFL_MODEL_LANES", "TAFL_ADMIN_TOKEN", tuning.PLAN_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TAFL_PACKAGES", str(gtafl_pkg))
    plan = service_plan()  # measured in a child process; the smoke model is cheap
    assert plan.workers == 2 and plan.costs[load_package(gtafl_pkg).name] > 0
    assert handed_plan() == plan and service_workers() == 2
    s = Settings.from_env()
    assert (s.workers, s.model_lanes, s.lanes_from) == (2, WORKER_LANES, plan.lanes_from)
    assert s.workers_from == plan.workers_from
    monkeypatch.setenv("TAFL_ADMIN_TOKEN", "x")  # other settings: that plan is not theirs
    assert handed_plan() is None and service_workers() == 1
    monkeypatch.setenv("TAFL_WORKERS", "1")
    assert Settings.from_env().workers_from == "TAFL_WORKERS"
    monkeypatch.setenv(tuning.PLAN_ENV, "{not json")
    with pytest.raises(Exception, match="TAFL_SERVING_PLAN"):
        handed_plan()


def test_plan_round_trips_through_its_json():
    plan = choose([CHEAP, ModelCost("c" * 64, "other", 0.3)], cores=2, available_mb=8000, key="k")
    assert Plan.from_json(plan.to_json()) == plan


@pytest.mark.slow
def test_a_service_with_no_settings_runs_the_chosen_plan_and_says_why(dafl_pkg, tmp_path):
    """No TAFL_WORKERS or TAFL_MODEL_LANES: the cheap smoke ViT is served by two workers of two lanes, and /models
    and the log say so and why; with reloads on, one worker of three lanes."""
    from tafl.serving.launch import ServerProcess

    from tests.serving.test_workers import _worker_pids

    log = tmp_path / "auto.log"
    with ServerProcess([str(dafl_pkg)], env={"BENTOML_HOME": str(tmp_path / "b1")}, log_path=log) as srv:
        pids = _worker_pids(srv)
        assert len(pids) == 2
        for pid in pids:  # glibc gives their large buffers back (the soak's growth: tafl.procs.MALLOC_ENV)
            assert psutil.Process(pid).environ().get("MALLOC_MMAP_THRESHOLD_") == MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]
        r = httpx.post(f"{srv.url}/predict", files={"file": ("a.png", digit_png(3), "image/png")}, timeout=60)
        assert r.status_code == 200, r.text[:300]
        m = httpx.get(f"{srv.url}/models", timeout=30).json()
        assert m["worker"]["workers"] == 2 and "cheap" in m["worker"]["workers_from"]
        [model] = m["models"]
        assert model["lanes"] == WORKER_LANES and "2 workers" in model["lanes_from"]
    assert "serving with 2 worker(s): every model is cheap" in log.read_text()
    env = {"BENTOML_HOME": str(tmp_path / "b2"), "TAFL_ADMIN_TOKEN": "admin"}
    with ServerProcess([str(dafl_pkg)], env=env, log_path=tmp_path / "reload.log") as srv:
        assert len(_worker_pids(srv)) == 1
        m = httpx.get(f"{srv.url}/models", timeout=30).json()
        assert m["worker"]["workers"] == 1 and "reload" in m["worker"]["workers_from"]
        assert m["models"][0]["lanes"] == CPU_LANES
