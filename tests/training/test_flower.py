"""Flower: one implementation. Simulation engine == in-process; loopback deployment; faults; resume."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest

torch = pytest.importorskip("torch", reason="needs torch: the train extra (pip install -e '.[train]')")

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict  # noqa: E402

from tafl.training.checkpoint import load_checkpoint  # noqa: E402
from tafl.training.config import load_config  # noqa: E402
from tafl.training.flower import parse_train_reply, run_flower_simulation  # noqa: E402
from tafl.training.flower_local import LocalFederation  # noqa: E402
from tafl.training.simulator import train  # noqa: E402
from tests.conftest import CONFIGS, SMOKE_GTAFL  # noqa: E402

pytestmark = pytest.mark.slow

FLOWER_SMOKE = {"clients": 3, "frac": 1.0, "rounds": 2, "threads": 1}


def _cfg(method: str):
    extra = {"gtafl": SMOKE_GTAFL, "fedavg_head": {"method": "fedavg", "train_scope": "head"}}.get(method,
                                                                                               {"method": method})
    return load_config(CONFIGS / "smoke.yaml", {**FLOWER_SMOKE, **extra})


def _state(path):
    return load_checkpoint(path)["state"]


# fedavg_head: the head basis crosses Flower; lda: a site sends class sums and no weights
@pytest.mark.parametrize("method", ["fedavg", "gtafl", "fedavg_head", "lda"])
def test_flower_simulation_equals_in_process(tmp_path, method, monkeypatch):
    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    train(_cfg(method), tmp_path / "inproc", progress=False)
    run_flower_simulation(_cfg(method), tmp_path / "flower")
    a, b = _state(tmp_path / "inproc" / "final.pt"), _state(tmp_path / "flower" / "final.pt")
    for part in ("weights", "extras"):
        assert a[part].keys() == b[part].keys()
        for k in a[part]:
            assert torch.allclose(a[part][k].float(), b[part][k].float(), atol=1e-6), (part, k)
    rep = json.loads((tmp_path / "flower" / "report.json").read_text())
    assert rep["communication"]["wire_uplink_bytes"] >= rep["communication"]["uplink_bytes"]
    if method == "gtafl":  # the class statistics and the features-only finishing round cross Flower too
        assert float(b["extras"]["stats.count"].sum()) > 0 and "gff.centre" in b["extras"]
        assert rep["finishing_round"]["clients"] == [0, 1, 2] and rep["finishing_round"]["dropped"] == []
    if method == "lda":  # the head was fitted from the sums the sites sent over Flower
        heard = sorted({c for h in rep["history"] for c in h["clients"]})
        assert b["meta"]["lda_sites"] == heard and all(f"lda_sum.{c}" in b["extras"] for c in heard)


def test_restarted_server_app_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    cfg = _cfg("fedavg")
    train(cfg, tmp_path / "ref", progress=False)
    cfg.rounds = 1
    run_flower_simulation(cfg, tmp_path / "fl")  # the ServerApp stops after round 1 ...
    cfg.rounds = 2
    run_flower_simulation(cfg, tmp_path / "fl", resume=True)  # ... and a new one continues
    a, b = _state(tmp_path / "ref" / "final.pt"), _state(tmp_path / "fl" / "final.pt")
    assert all(torch.allclose(a["weights"][k].float(), b["weights"][k].float(), atol=1e-6) for k in a["weights"])
    hist = json.loads((tmp_path / "fl" / "report.json").read_text())["history"]
    assert [h["round"] for h in hist] == [1, 2]


def _reply(content: RecordDict) -> Message:
    msg = Message(content=RecordDict(), message_type="train", dst_node_id=1)
    return Message(content=content, reply_to=msg)


def test_malformed_records_are_rejected_with_a_reason(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_run_id", "_node_id", "_task_id"):  # what a running ServerApp has set: flwr 1.42 stamps messages
        monkeypatch.setattr(TaskIdentity, name, 1)
    good = RecordDict({"weights": ArrayRecord(torch_state_dict={"w": torch.ones(2)}),
                       "meta": ConfigRecord({"client_id": 3, "num_samples": 10, "seconds": 0.5})})
    res = parse_train_reply(_reply(good))
    assert res.client_id == 3 and res.num_samples == 10 and torch.equal(res.weights["w"], torch.ones(2))
    with pytest.raises(ValueError, match="lacks the 'weights' record"):
        parse_train_reply(_reply(RecordDict({"meta": ConfigRecord({"client_id": 3, "num_samples": 1})})))
    with pytest.raises(ValueError, match="integer 'num_samples'"):
        parse_train_reply(_reply(RecordDict({"weights": ArrayRecord(), "meta": ConfigRecord({"client_id": 3})})))


def _yaml(path, cfg: dict):
    import yaml

    path.write_text(yaml.safe_dump(cfg))
    return path


def test_loopback_deployment_gtafl_exports_and_survives_a_killed_node(tmp_path):
    """SuperLink + 3 SuperNodes as processes, each beside one warm ClientApp process; node 2 (its
    SuperNode and its ClientApp process) is killed after round 1: round 2 goes on with the other
    two, and the saved model exports. The survivors ran every message in one process, which
    prepared their data once and reused it for each later message."""
    # Load only stretches the replies (torch is imported and each node's data prepared before or at
    # the census, not per message); a node killed for good is declared offline by the SuperLink after
    # its heartbeat lapses, so the generous reply timeout costs no time in round 2
    base = {**_cfg("gtafl").to_dict(), "flower_timeout": 120.0, "flower_wait_s": 120.0}
    cfg_file = _yaml(tmp_path / "cfg.yaml", base)
    home = tmp_path / "flwr"
    with LocalFederation(3, home) as fed:
        out = tmp_path / "run"
        killer = threading.Thread(target=lambda: (_wait_for(out / "checkpoints" / "round_0001.pt"), fed.kill_node(2)))
        killer.start()
        r = fed.run({"config": str(cfg_file), "out": str(out), "force": True}, timeout=900)
        killer.join()
        assert fed.supernodes[2].poll() is not None and fed.clientapps[2].poll() is not None
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        hist = json.loads((out / "report.json").read_text())["history"]
        assert [h["round"] for h in hist] == [1, 2]
        assert hist[0]["dropped"] == [] and 2 in hist[1]["dropped"], hist
        assert "did not answer" in (out / "train.log").read_text() or "rejected" in (out / "train.log").read_text()
        from tafl.packaging.export import export_checkpoint

        pkg = export_checkpoint(out / "final.pt", tmp_path / "pkg")
        assert pkg.expert_names == ["forward", "uniform", "backward"]
    for i in (0, 1):
        text = (home / f"clientapp{i}.log").read_text()
        pid = int((home / f"clientapp{i}.ready").read_text())
        tasks = re.findall(r"task \d+ done in [\d.]+ s in process (\d+)", text)
        # census, then a statistics query and a train message in each of 2 rounds, then the finishing round
        assert len(tasks) >= 6 and set(tasks) == {str(pid)}, text[-3000:]
        assert text.count("client data: prepared") == 1, text[-3000:]
        assert text.count("client data: reused from this process's cache") == len(tasks) - 1, text[-3000:]


def _wait_for(path, timeout=600):
    deadline = time.time() + timeout
    while not path.exists() and time.time() < deadline:
        time.sleep(0.05)


def test_flower_with_a_client_column_runs_one_supernode_per_site_on_its_own_rows(tmp_path, monkeypatch):
    """--client-column on Flower: one SuperNode per site, each decoding only its own site's rows (`site`), the
    same model as the in-process simulator; and a deployed site's labels index the federation's classes even
    where the site lacks one (vidir_molemax has no akiec)."""
    import numpy as np

    from tafl.errors import DataError
    from tafl.training.data import load_dataset
    from tafl.training.flower import site_labels
    from tests.training.test_sites import make_sites, site_cfg

    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    root = make_sites(tmp_path / "d")
    flags = {"rounds": 1, "frac": 1.0, "threads": 1, "calib_holdout": 0.1}
    train(site_cfg(root, **flags), tmp_path / "inproc", progress=False)
    run_flower_simulation(site_cfg(root, **flags), tmp_path / "flower")
    a, b = _state(tmp_path / "inproc" / "final.pt"), _state(tmp_path / "flower" / "final.pt")
    for k in a["weights"]:
        assert torch.allclose(a["weights"][k].float(), b["weights"][k].float(), atol=1e-6), k
    rep = json.loads((tmp_path / "flower" / "report.json").read_text())
    assert sorted(rep["sites"]) == ["east", "north", "south"] and rep["config"]["clients"] == 3
    # the conformal sets' round through Flower: every site's histograms, the same thresholds as in process
    assert rep["conformal"]["fitted"] and rep["conformal"]["clients"] == [0, 1, 2]
    assert a["meta"]["conformal"]["thresholds"] == b["meta"]["conformal"]["thresholds"]

    east = load_dataset(site_cfg(root, site="east"))  # what east's SuperNode decodes: east's rows only
    full = load_dataset(site_cfg(root))
    k = full.site_names.index("east")
    assert east.class_names == full.class_names  # the federation's ten classes, though east has no 9s
    assert (east.train.sites == k).all() and sorted(east.train.ids) == sorted(full.train.ids[full.train.sites == k])
    assert np.array_equal(east.train.images, full.train.images[full.train.sites == k])
    assert site_labels(["b", "d"], ["a", "b", "c", "d"], np.array([0, 1, 1])).tolist() == [1, 3, 3]
    with pytest.raises(DataError, match="classes z are not among the federation's"):
        site_labels(["a", "z"], ["a", "b"], np.array([0, 1]))
    with pytest.raises(DataError, match="has no site 'west'"):
        load_dataset(site_cfg(root, site="west"))


def test_secure_aggregation_gtafl_runs_on_sums_only_and_matches_the_plaintext_run(tmp_path, monkeypatch):
    """`--engine flower --secure-aggregation`: the census and every round (the finishing one too) go through one SecAgg+
    sum each, nothing is clipped, round 1's aggregated weights equal the plaintext run's within the quantisation error,
    and the model's mean accuracy over the eleven distributions is within a few points of the plaintext run's (the
    in-process run, which the Flower run without secure aggregation reproduces exactly). Later rounds differ more
    than round 1: local SGD amplifies the ~1e-7 differences (a plaintext run with weights moved by ±1e-7 does too)."""
    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    over = {**FLOWER_SMOKE, **SMOKE_GTAFL, "clients": 4, "frac": 1.0}
    plain = train(load_config(CONFIGS / "smoke.yaml", over), tmp_path / "plain", progress=False)
    secure = run_flower_simulation(load_config(CONFIGS / "smoke.yaml", {**over, "engine": "flower",
                                                                         "secure_aggregation": True}),
                                   tmp_path / "secure")
    assert secure["privacy"]["secure_aggregation"] is True and plain["privacy"]["secure_aggregation"] is False
    # no held-out rows: the sets come from the server's validation split, as in process
    assert secure["conformal"]["fitted"] and secure["conformal"]["source"] == "the server's validation split"
    log = (tmp_path / "secure" / "train.log").read_text()
    sums = re.findall(r"(census|round \d): secure sum over clients \[0, 1, 2, 3\] \(\d+ entries each\), "
                      r"(\d+) entries clipped", log)
    # the census, two rounds, the finishing round and the in-domain detector's sums (round rounds + 3)
    assert sums == [("census", "0"), ("round 1", "0"), ("round 2", "0"), ("round 3", "0"), ("round 5", "0")], \
        log[-3000:]
    det, ref = secure["domain_detector"], plain["domain_detector"]
    assert det["fitted"] and det["private"] == "secure aggregation" and det["train_images"] == ref["train_images"]
    assert det["clients"] == [0, 1, 2, 3] and det["clip"] > 0  # the sum's clients, as the transport lists them
    a = _state(tmp_path / "plain" / "checkpoints" / "round_0001.pt")["weights"]
    b = _state(tmp_path / "secure" / "checkpoints" / "round_0001.pt")["weights"]
    assert a.keys() == b.keys() and all(torch.allclose(a[k].float(), b[k].float(), atol=1e-6) for k in a)
    gap = abs(secure["average_accuracy"] - plain["average_accuracy"])
    assert gap < 0.06, (secure["average_accuracy"], plain["average_accuracy"])
    # every client of a round is in its sum: none is listed as dropped, and each round records its sum
    assert all(h["dropped"] == [] and h["secure_sum"]["clients"] for h in secure["history"])


def test_dp_and_secure_aggregation_together_account_every_site(tmp_path, monkeypatch):
    """DP on top of SecAgg+: the combined result carries no site's counters, so the transport reports them and
    the accountant books every site's steps and releases; the report states both protections."""
    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    over = {**FLOWER_SMOKE, **SMOKE_GTAFL, "clients": 4, "frac": 1.0, "rounds": 1, "gs": False, "dp_epsilon": 4.0,
            "engine": "flower", "secure_aggregation": True}
    rep = run_flower_simulation(load_config(CONFIGS / "smoke.yaml", over), tmp_path / "dp_secure")
    p = rep["privacy"]
    assert p["secure_aggregation"] is True and 0 < p["epsilon"] <= 4.0 + 1e-3
    assert sorted(p["clients"]) == ["0", "1", "2", "3"]
    # round 1, the finishing round and the in-domain detector's statistics
    assert all(c["steps"] > 0 and c["releases"] == 3 for c in p["clients"].values())
    assert rep["domain_detector"]["fitted"] and rep["domain_detector"]["private"] == \
        "differential privacy, secure aggregation"


def test_secure_aggregation_with_federated_calibration_fits_on_sums_only(tmp_path, monkeypatch):
    """`--secure-aggregation --calibration vector`: every Newton round of the calibration is one SecAgg+ sum over all
    four sites (nothing clipped), the fit covers the same held-out images as the plaintext run's and lowers their
    NLL; the report says the model is calibrated."""
    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    over = {**FLOWER_SMOKE, "method": "fedavg", "clients": 4, "frac": 1.0, "rounds": 1, "calibration": "vector",
            "calib_holdout": 0.2, "calibration_check": False}  # the fit itself, not whether it ships
    plain = train(load_config(CONFIGS / "smoke.yaml", over), tmp_path / "plain", progress=False)
    secure = run_flower_simulation(load_config(CONFIGS / "smoke.yaml", {**over, "engine": "flower",
                                                                         "secure_aggregation": True}),
                                   tmp_path / "secure")
    log = (tmp_path / "secure" / "train.log").read_text()
    cal_sums = re.findall(r"round 3: secure sum over clients \[0, 1, 2, 3\] \(\d+ entries each\), (\d+) entries "
                          r"clipped", log)  # the calibration rounds are numbered rounds + 2
    a, b = plain["prior_adaptation"]["calibration"], secure["prior_adaptation"]["calibration"]
    assert secure["prior_adaptation"]["calibrated"] and len(cal_sums) == b["fit"]["iterations"] > 2, log[-3000:]
    assert set(cal_sums) == {"0"}
    assert b["fit"]["images"] == a["fit"]["images"] > 0 and b["fit"]["clients"] == [0, 1, 2, 3]
    assert b["fit"]["nll_after"] < b["fit"]["nll_before"]
    assert b["fit"]["nll_after"] == pytest.approx(a["fit"]["nll_after"], abs=0.05)  # round 1 differs by ~1e-7
    # the conformal sets' histograms: one SecAgg+ sum (round rounds + 4) of whole counts over the four sites, the
    # same calibration images as in process and thresholds within a bin of theirs (the models differ by ~1e-7)
    sets_sums = re.findall(r"round 5: secure sum over clients \[0, 1, 2, 3\] \(\d+ entries each\), (\d+) entries "
                           r"clipped", log)
    assert sets_sums == ["0"], log[-3000:]
    sa, sp = secure["conformal"], plain["conformal"]
    assert sa["fitted"] and sa["source"] == ("the clients' held-out rows, one SecAgg+ sum and the server's "
                                             "validation split")
    assert sa["held_out_images"] == sp["held_out_images"] > 0 and sa["validation_images"] == sp["validation_images"] > 0
    assert sa["clients"] == [0, 1, 2, 3]
    assert sa["calibration_images"] == sp["calibration_images"] > 0 and sa["per_class"] == sp["per_class"]
    ta = _state(tmp_path / "secure" / "final.pt")["meta"]["conformal"]["thresholds"]
    tp = _state(tmp_path / "plain" / "final.pt")["meta"]["conformal"]["thresholds"]
    for level in ta:
        assert max(abs(x - y) for x, y in zip(ta[level], tp[level])) <= 2.0 / 2000


def test_lda_under_secure_aggregation_fits_the_plaintext_head_and_splits_dp_noise_over_the_sum(tmp_path, monkeypatch):
    """Method lda with `--secure-aggregation`: the server holds only the sum of the four sites' class sums, within
    the quantisation error of the plaintext sums, and fits the same head. With DP on top, each site adds 1/√m_t of the
    noise (m_t: the fewest sites a completed sum holds), the report says so, and one site's share alone is worth a
    larger ε than the run's."""
    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    over = {**FLOWER_SMOKE, "method": "lda", "clients": 4, "frac": 1.0, "rounds": 1}
    train(load_config(CONFIGS / "smoke.yaml", over), tmp_path / "plain", progress=False)
    run_flower_simulation(load_config(CONFIGS / "smoke.yaml", {**over, "engine": "flower",
                                                                "secure_aggregation": True}), tmp_path / "secure")
    a, b = _state(tmp_path / "plain" / "final.pt"), _state(tmp_path / "secure" / "final.pt")
    assert b["meta"]["lda_sites"] == [-1] and sorted(a["meta"]["lda_sites"]) == [0, 1, 2, 3]
    plain_sum = sum(a["extras"][f"lda_sum.{k}"].double() for k in range(4))
    assert torch.allclose(b["extras"]["lda_sum.-1"].double(), plain_sum, atol=1e-3)
    wa, wb = a["weights"]["head.weight"].double(), b["weights"]["head.weight"].double()
    assert float((wa - wb).abs().max()) <= 1e-3 * float(wa.abs().max())  # the whitening scales entries up
    rep = run_flower_simulation(load_config(CONFIGS / "smoke.yaml", {**over, "engine": "flower",
                                                                      "secure_aggregation": True, "dp_epsilon": 4.0}),
                                tmp_path / "dp")
    p = rep["privacy"]
    assert p["noise"] == "distributed" and p["sites_in_a_sum_at_least"] == 3  # round(0.67 · 4)
    # the class sums and the in-domain detector's sums (the census is the plan's own)
    assert all(c["steps"] == 0 and c["releases"] == 2 for c in p["clients"].values())
    assert p["epsilon"] <= 4.0 + 1e-3 < p["share_epsilon"]
    from tafl.privacy_text import privacy_lines

    card = "\n".join(privacy_lines(p))  # the report's, the card's and the page's privacy section
    assert "| distributed noise |" in card and "| noise multiplier (the releases) |" in card and "√k" in card
