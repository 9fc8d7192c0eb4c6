"""GTAFL and CReFF: GI-GDS, expert gradients, GFF matching, specialisation, votes, switches, faults."""

from __future__ import annotations

import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: the train extra (pip install -e '.[train]')")

from tafl.training import gff  # noqa: E402
from tafl.training.checkpoint import load_checkpoint  # noqa: E402
from tafl.training.ensemble import ExpertEnsemble  # noqa: E402
from tafl.training.evaluate import evaluate_outputs  # noqa: E402
from tafl.training.methods.gtafl import gigds_class_weights  # noqa: E402
from tafl.training.simulator import make_method, prepare, train  # noqa: E402


def test_gigds_weights_against_hand_computation():
    local = torch.tensor([10.0, 0.0, 5.0])
    glob = torch.tensor([100.0, 50.0, 10.0])
    # cos = (1000 + 0 + 50) / (sqrt(125) * sqrt(12600)) = 0.8367 < 0.9 -> alpha = 1: local inverse frequency
    w, alpha = gigds_class_weights(local, glob, tau=0.9, eps=1e-6)
    assert alpha == 1.0
    assert torch.allclose(w, torch.tensor([1 / 10, 1 / 1e-6, 1 / 5]), rtol=1e-5)
    similar = torch.tensor([20.0, 10.0, 2.0])  # parallel to the global counts: cos = 1 -> alpha = 0
    w, alpha = gigds_class_weights(similar, glob, tau=0.9)
    assert alpha == 0.0
    assert torch.allclose(w, 1 / (glob + 1e-6))


def test_expert_gradients_equal_autograd():
    torch.manual_seed(0)
    E, C, D, n = 3, 4, 6, 20
    feats = torch.randn(n, D)
    labels = torch.tensor([0, 1, 3] * 6 + [0, 0])
    W, b = torch.randn(E, C, D), torch.randn(E, C)
    classes = torch.tensor([0, 1, 3])
    gW, gb = gff.class_head_gradients(feats, labels, W, b, classes)
    assert gW.shape == (3, E, C, D) and gb.shape == (3, E, C)
    for li, c in enumerate(classes.tolist()):
        rows = labels == c
        for e in range(E):
            w = W[e].clone().requires_grad_(True)
            bb = b[e].clone().requires_grad_(True)
            loss = torch.nn.functional.cross_entropy(feats[rows] @ w.t() + bb, labels[rows])
            loss.backward()
            assert torch.allclose(gW[li, e], w.grad, atol=1e-6)
            assert torch.allclose(gb[li, e], bb.grad, atol=1e-6)


def test_expert_counts_forward_uniform_backward():
    counts = gff.expert_counts(gff.EXPERT_NAMES, np.array([50, 400, 10]), np.array([1, 0, 2]), m=100, lam=0.1)
    assert counts[0].tolist() == [105, 140, 101]  # forward: m + λ·d_c
    assert counts[1].tolist() == [100, 100, 100]
    assert counts[2].tolist() == [105, 101, 140]  # backward: rank r gets the count of rank C−1−r


def _synthetic(seed=0, C=4, D=16):
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(C, D, generator=g)

    def sample(counts):
        x = torch.cat([means[c] + 1.5 * torch.randn(n, D, generator=g) for c, n in enumerate(counts)])
        return x, torch.cat([torch.full((n,), c) for c, n in enumerate(counts)])
    return sample


def test_matching_loss_decreases():
    sample = _synthetic()
    x, y = sample([300, 100, 30, 10])
    g = torch.Generator().manual_seed(1)
    W, b = gff.init_heads(3, 4, 16, g)
    gW, gb = gff.class_head_gradients(x, y, W, b, torch.arange(4))
    banks = gff.GFFBanks.create(gff.expert_counts(gff.EXPERT_NAMES, np.array([300, 100, 30, 10]), np.arange(4), 50,
                                                  0.5), 16, g)
    losses = gff.match(banks, W, b, gW.permute(1, 0, 2, 3), gb.permute(1, 0, 2), torch.ones(4, dtype=torch.bool),
                       steps=50, lr=0.1)
    assert losses[1] < 0.5 * losses[0]


def test_experts_specialise_the_backward_expert_wins_backward50():
    sample = _synthetic()
    train_counts = np.array([1000, 300, 100, 30])
    x, y = sample(train_counts)
    xt, yt = sample([500] * 4)
    ranks = np.arange(4)
    g = torch.Generator().manual_seed(0)
    banks = gff.GFFBanks.create(gff.expert_counts(gff.EXPERT_NAMES, train_counts, ranks, 100, 1.0), 16, g)
    W, b = gff.init_heads(3, 4, 16, g)
    for _ in range(8):  # rounds: clients' gradients at the current experts, then match and retrain
        gW, gb = gff.class_head_gradients(x, y, W, b, torch.arange(4))
        gff.match(banks, W, b, gW.permute(1, 0, 2, 3), gb.permute(1, 0, 2), torch.ones(4, dtype=torch.bool), 100, 0.1)
        W, b, _ = gff.retrain(banks, W, b, 30, 0.01, 32, g)
    acc = {}
    for e, name in enumerate(gff.EXPERT_NAMES):
        p = torch.softmax(xt @ W[e].t() + b[e], -1).numpy()
        acc[name] = evaluate_outputs(p, p.argmax(1), yt.numpy(), ranks)["test_distributions"]
    assert acc["backward"]["backward50"]["accuracy"] > acc["uniform"]["backward50"]["accuracy"]
    assert acc["backward"]["backward50"]["accuracy"] > acc["forward"]["backward50"]["accuracy"]
    assert acc["forward"]["forward50"]["accuracy"] > acc["backward"]["forward50"]["accuracy"]


def _ensemble(labels_per_expert, C=4, vote="hard", weights=None):
    """An ensemble whose experts output fixed logits: expert e prefers labels_per_expert[e]."""
    E = len(labels_per_expert)
    W = torch.zeros(E, C, 1)
    b = torch.zeros(E, C)
    for e, lab in enumerate(labels_per_expert):
        b[e, lab] = 2.0 + e * 0.1
    return ExpertEnsemble(torch.nn.Identity(), W, b, ("forward", "uniform", "backward")[:E], vote, weights)


def test_hard_vote_majority_and_ties_go_to_uniform():
    x = torch.zeros(1, 1)
    assert int(_ensemble([2, 2, 0])(x)["label"]) == 2  # majority
    assert int(_ensemble([0, 3, 1])(x)["label"]) == 3  # all disagree: the uniform expert (index 1) wins
    assert int(_ensemble([1, 0, 2])(x)["label"]) == 0
    out = _ensemble([0, 3, 1])(x)
    assert out["votes"].tolist() == [[1.0, 1.0, 0.0, 1.0]]
    assert out["expert_labels"].tolist() == [[0, 3, 1]]
    assert out["expert_probs"].shape == (1, 3, 4)
    # weights: the backward expert weighs 2.5 and outvotes the other two
    assert int(_ensemble([0, 0, 1], weights=(1.0, 1.0, 2.5))(x)["label"]) == 1


def test_soft_and_confidence_votes():
    x = torch.zeros(1, 1)
    W = torch.zeros(3, 3, 1)
    b = torch.tensor([[3.0, 2.9, 0.0], [0.0, 5.0, 0.0], [1.0, 0.9, 0.0]])
    names = ("forward", "uniform", "backward")
    # hard: votes 0, 1, 0 -> class 0; soft: mean probability favours class 1
    assert int(ExpertEnsemble(torch.nn.Identity(), W, b, names, "hard")(x)["label"]) == 0
    assert int(ExpertEnsemble(torch.nn.Identity(), W, b, names, "soft")(x)["label"]) == 1
    conf = ExpertEnsemble(torch.nn.Identity(), W, b, names, "confidence")(x)
    assert int(conf["label"]) == 1  # the confident uniform expert outweighs two unsure ones


def _smoke(cfg, method, **kw):
    cfg.method = method
    cfg.simclr_steps, cfg.simclr_batch, cfg.retrain_epochs, cfg.match_steps, cfg.simclr_every = 2, 32, 20, 20, 1
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


@pytest.mark.slow
def test_creff_equals_gtafl_with_parts_switched_off(tmp_path, smoke_cfg):
    train(_smoke(smoke_cfg, "creff"), tmp_path / "creff", progress=False)
    train(_smoke(smoke_cfg, "gtafl", en=False, cl=False, gs=False, bank_init="normal", gff_centre=False,
                 final_round_frac=0.0), tmp_path / "gtafl", progress=False)
    a = load_checkpoint(tmp_path / "creff" / "final.pt")["state"]
    b = load_checkpoint(tmp_path / "gtafl" / "final.pt")["state"]
    for part in ("weights", "extras"):
        assert a[part].keys() == b[part].keys()
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), k
    assert a["meta"]["experts"] == ["uniform"]


@pytest.mark.slow
def test_gtafl_two_rounds_end_to_end(tmp_path, smoke_cfg):
    report = train(_smoke(smoke_cfg, "gtafl"), tmp_path / "run", progress=False)
    assert set(report["experts"]) == {"forward", "uniform", "backward", "original_head"}
    for dists in report["experts"].values():
        assert len(dists) == 11
    t = report["timing"]
    assert t["gff_s"] > 0 and t["retrain_s"] > 0 and t["simclr_s"] > 0
    ck = load_checkpoint(tmp_path / "run" / "final.pt")
    st = ck["state"]
    assert st["extras"]["expert.weight"].shape[0] == 3 and st["meta"]["experts"] == ["forward", "uniform", "backward"]
    assert st["meta"]["vote"] == "hard"
    hist = report["gff_history"]
    # two rounds and the finishing round (features of the final extractor from every client)
    assert [h["round"] for h in hist] == [1, 2, 3] and all(h["match_after"] < h["match_before"] for h in hist)
    assert report["finishing_round"]["clients"] == [0, 1, 2, 3] and report["finishing_round"]["dropped"] == []
    assert st["meta"]["finished"] is True and st["extras"]["gff.centre"].shape == (st["extras"]["expert.weight"].shape[2],)
    # expert gradients travel up and expert heads down: more bytes than FedAvg's
    smoke_cfg.method = "fedavg"
    fed = train(smoke_cfg, tmp_path / "fedavg", progress=False)
    assert report["communication"]["uplink_bytes"] > fed["communication"]["uplink_bytes"]
    assert report["communication"]["downlink_bytes"] > fed["communication"]["downlink_bytes"]


@pytest.mark.slow
def test_ablation_without_classifier_retraining_predicts_with_the_fedavg_head(tmp_path, smoke_cfg):
    report = train(_smoke(smoke_cfg, "gtafl", cr=False, rounds=1), tmp_path / "nocr", progress=False)
    assert report["switches"] == {"cr": False, "en": False, "cl": True, "gs": True}
    assert "experts" not in report or not report["experts"]
    st = load_checkpoint(tmp_path / "nocr" / "final.pt")["state"]
    assert "expert.weight" not in st["extras"] and st["meta"]["experts"] == []


@pytest.mark.slow
def test_gtafl_resume_after_kill_loses_nothing(tmp_path, smoke_cfg):
    cfg = _smoke(smoke_cfg, "gtafl", rounds=3)
    train(cfg, tmp_path / "full", progress=False)
    cfg.rounds = 2
    train(cfg, tmp_path / "part", progress=False)
    cfg.rounds = 3
    train(cfg, tmp_path / "part", resume=True, progress=False)
    a = load_checkpoint(tmp_path / "full" / "final.pt")["state"]
    b = load_checkpoint(tmp_path / "part" / "final.pt")["state"]
    for part in ("weights", "extras"):
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), k


def _method_and_clients(cfg):
    from tafl.training.contract import ClientData

    prep = prepare(cfg)
    m = make_method(cfg, prep.model_cfg, prep.dataset.preprocess)
    m.attach_server_pool(torch.from_numpy(prep.dataset.val.images))
    images, labels = torch.from_numpy(prep.train.images), torch.from_numpy(prep.train.labels)
    clients = [ClientData(k, images, labels, torch.from_numpy(p), prep.dataset.num_classes)
               for k, p in enumerate(prep.parts)]
    state = m.init_state(prep.train_counts)
    m.round_config(state, {c.client_id: m.client_stats(c) for c in clients}, 0)
    return m, clients, state


def test_nan_and_malformed_clients_are_dropped_and_the_round_completes(smoke_cfg, caplog):
    m, clients, state = _method_and_clients(_smoke(smoke_cfg, "gtafl", cl=False))
    rcfg = m.round_config(state, {}, 1)
    payload = m.broadcast(state)
    good = m.client_update(payload, clients[0], rcfg)
    nan_w = m.client_update(payload, clients[1], rcfg)
    nan_w.weights["head.weight"][0, 0] = float("nan")
    inf_g = m.client_update(payload, clients[2], rcfg)
    inf_g.extras["grad_w"][0, 0, 0, 0] = float("inf")
    bad_shape = m.client_update(payload, clients[3], rcfg)
    bad_shape.extras["grad_b"] = bad_shape.extras["grad_b"][:, :2]
    with caplog.at_level(logging.WARNING):
        new = m.server_update(state, [good, nan_w, inf_g, bad_shape], 1)
    assert new.meta["dropped"] == [1, 2, 3]
    for cid in (1, 2, 3):
        assert f"dropping client {cid}" in caplog.text
    assert all(torch.isfinite(v).all() for v in new.weights.values() if v.is_floating_point())
    assert torch.isfinite(new.extras["expert.weight"]).all()


def test_class_absent_from_every_client_keeps_its_bank(smoke_cfg, caplog):
    m, clients, state = _method_and_clients(_smoke(smoke_cfg, "gtafl", cl=False))
    rcfg = m.round_config(state, {}, 1)
    payload = m.broadcast(state)
    results = [m.client_update(payload, c, rcfg) for c in clients]
    state = m.server_update(state, results, 1)
    bank_before = state.extras["gff.features"].clone()
    missing = 0
    for r in results:  # pretend nobody holds class 0 this round
        keep = r.extras["grad_classes"] != missing
        r.extras = {k: v[keep] for k, v in r.extras.items()}  # gradients and class statistics alike
    results = [r for r in results if len(r.extras["grad_classes"])]
    with caplog.at_level(logging.INFO):
        state2 = m.server_update(state, results, 2)
    assert "class(es) [0] held by no participating client" in caplog.text
    assert torch.equal(state2.extras["gff.features"][:, 0], bank_before[:, 0])
    assert not torch.equal(state2.extras["gff.features"][:, 1], bank_before[:, 1])
    assert state2.meta["gff_history"][-1]["absent_classes"] == [0]


def test_match_head_uniform_takes_every_gradient_at_the_uniform_expert(smoke_cfg):
    m, clients, state = _method_and_clients(_smoke(smoke_cfg, "gtafl", cl=False))
    payload = m.broadcast(state)
    own = m.client_update(payload, clients[0], m.round_config(state, {}, 1)).extras["grad_w"]
    assert not torch.allclose(own[:, 0], own[:, 2])  # the experts' own heads differ
    m.cfg.match_head = "uniform"
    u = m.client_update(payload, clients[0], m.round_config(state, {}, 1)).extras["grad_w"]
    assert torch.equal(u[:, 0], u[:, 1]) and torch.equal(u[:, 2], u[:, 1])
    assert torch.allclose(u[:, 1], own[:, 1])  # the uniform expert's own gradient is unchanged
    new = m.server_update(state, [m.client_update(payload, c, m.round_config(state, {}, 1)) for c in clients[:3]], 1)
    assert torch.isfinite(new.extras["expert.weight"]).all()


def test_match_head_must_be_own_or_uniform(smoke_cfg):
    from tafl.errors import ConfigError
    smoke_cfg.match_head = "backward"
    with pytest.raises(ConfigError, match="match_head"):
        smoke_cfg.validate()


# ------------------------------------------------------------------ class feature statistics (issue 12)
def test_class_statistics_aggregate_exactly_to_the_pooled_mean_and_spread():
    g = torch.Generator().manual_seed(3)
    feats = torch.relu(torch.randn(90, 5, generator=g) * 2 + 1)  # ReLU features: a large common mean
    labels = torch.randint(0, 3, (90,), generator=g)
    parts = []
    for rows in (slice(0, 17), slice(17, 60), slice(60, 90)):  # three clients of unequal size
        cls = torch.unique(labels[rows])
        parts.append((cls, *gff.class_feature_stats(feats[rows], labels[rows], cls)))
    S, Q, N = gff.aggregate_stats(parts, 3, 5)
    mean, std = gff.moments(S, Q, N)
    for c in range(3):
        x = feats[labels == c].double()
        assert int(N[c]) == len(x)
        assert torch.allclose(mean[c].double(), x.mean(0), atol=1e-6)
        assert torch.allclose(std[c].double(), x.std(0, unbiased=False), atol=1e-5)
    # averaging the clients' means instead would be wrong when their sizes differ
    naive = torch.stack([p[1][p[0] == 0][0] / p[3][p[0] == 0][0] for p in parts if (p[0] == 0).any()]).mean(0)
    assert not torch.allclose(naive.float(), mean[0], atol=1e-3)


@pytest.mark.parametrize("corrupt, why", [
    (lambda e: e["stat_sum"].__setitem__((0, 0), float("nan")), "NaN or Inf"),
    (lambda e: e["stat_count"].__setitem__(0, -3.0), "positive whole numbers"),
    (lambda e: e.__setitem__("stat_sumsq", e["stat_sumsq"][:, :5]), "shapes"),
    (lambda e: e.__setitem__("stat_sum", e["stat_sum"] * 1e3), "inconsistent"),
    (lambda e: e.pop("stat_count"), "missing"),
])
def test_bad_class_statistics_drop_the_client_for_the_round(smoke_cfg, caplog, corrupt, why):
    m, clients, state = _method_and_clients(_smoke(smoke_cfg, "gtafl", cl=False))
    rcfg = m.round_config(state, {}, 1)
    payload = m.broadcast(state)
    good, bad = (m.client_update(payload, c, rcfg) for c in clients[:2])
    corrupt(bad.extras)
    with caplog.at_level(logging.WARNING):
        new = m.server_update(state, [good, bad], 1)
    assert new.meta["dropped"] == [1]
    assert "dropping client 1" in caplog.text and why in caplog.text
    assert torch.isfinite(new.extras["stats.mean"]).all() and torch.isfinite(new.extras["gff.features"]).all()


def test_banks_start_at_the_clients_class_statistics_and_stay_there(smoke_cfg):
    m, clients, state = _method_and_clients(_smoke(smoke_cfg, "gtafl", cl=False, bank_init="stats", gff_centre=False))
    rcfg = m.round_config(state, {}, 1)
    payload = m.broadcast(state)
    results = [m.client_update(payload, c, rcfg) for c in clients]
    parts = [(r.extras["grad_classes"], r.extras["stat_sum"], r.extras["stat_sumsq"], r.extras["stat_count"])
             for r in results]
    mean, std = gff.moments(*gff.aggregate_stats(parts, 10, m.model.feature_dim))
    new = m.server_update(state, results, 1)
    assert torch.allclose(new.extras["stats.mean"], mean) and torch.allclose(new.extras["stats.std"], std)
    banks = gff.GFFBanks(new.extras["gff.features"], new.extras["gff.counts"])
    # matching moves the banks a little; their class means stay near μ_c, far from N(0, 1)'s zero mean
    gap = (banks.class_means() - mean[None]).norm(dim=-1) / mean.norm(dim=-1).clamp_min(1e-6)[None]
    assert float(gap.max()) < 0.5, gap
    assert float(banks.class_means().norm(dim=-1).min()) > 0.5 * float(mean.norm(dim=-1).min())
    assert new.meta["banks"] == {"init": "stats", "anchor": "recentre", "centred": False}
    assert len(new.meta["gff_history"][-1]["bank_mean_drift"]) == 3


def test_creff_keeps_its_published_normal_banks_and_sends_no_statistics(smoke_cfg):
    m, clients, state = _method_and_clients(_smoke(smoke_cfg, "creff"))
    res = m.client_update(m.broadcast(state), clients[0], m.round_config(state, {}, 1))
    assert not any(k.startswith("stat_") for k in res.extras) and "stats.mean" not in state.extras
    smoke_cfg.bank_init = "stats"  # CReFF + statistics: the ablation row
    m, clients, state = _method_and_clients(smoke_cfg)
    res2 = m.client_update(m.broadcast(state), clients[0], m.round_config(state, {}, 1))
    assert {"stat_sum", "stat_sumsq", "stat_count"} <= set(res2.extras)
    from tafl.training.contract import tensor_bytes
    assert tensor_bytes(res2.extras) > tensor_bytes(res.extras)  # they travel, and are counted


def test_recentre_moves_present_classes_to_their_mean_and_leaves_absent_ones():
    g = torch.Generator().manual_seed(0)
    counts = np.array([[5, 7, 3], [4, 4, 4]])
    banks = gff.GFFBanks.create(counts, 6, g)
    before = banks.features.clone()
    mean, std = torch.randn(3, 6, generator=g) * 5, torch.rand(3, 6, generator=g) + 0.5
    have = torch.tensor([True, True, False])
    gff.anchor(banks, "recentre", mean, std, have, g)
    assert torch.allclose(banks.class_means()[:, :2], mean[None, :2].expand(2, 2, 6), atol=1e-5)
    assert torch.equal(banks.features[:, 2, :3], before[:, 2, :3])
    gff.anchor(banks, "standardise", mean, std, have, g)
    assert torch.allclose(banks.class_stds()[:, :2], std[None, :2].expand(2, 2, 6), atol=1e-4)


def test_centred_frame_gradients_are_exact_conversions_of_the_clients_raw_ones():
    """What the server does with a client's gradients in the centred frame equals computing them on
    centred features at the same heads: ∂W(f − κ) = ∂W(f) − ∂b ⊗ κ with the bias b + W·κ."""
    g = torch.Generator().manual_seed(5)
    feats = torch.relu(torch.randn(40, 8, generator=g) + 2)
    labels = torch.randint(0, 4, (40,), generator=g)
    W, b = torch.randn(3, 4, 8, generator=g), torch.randn(3, 4, generator=g)
    kappa = feats.mean(0)
    cls = torch.unique(labels)
    gW, gb = gff.class_head_gradients(feats, labels, W, b, cls)
    gWc, gbc = gff.class_head_gradients(feats - kappa, labels, W, b + W @ kappa, cls)
    assert torch.allclose(gbc, gb, atol=1e-6)
    assert torch.allclose(gWc, gW - gb[..., None] * kappa, atol=1e-5)


def test_centred_experts_keep_raw_frame_heads_and_the_centre(smoke_cfg):
    m, clients, state = _method_and_clients(_smoke(smoke_cfg, "gtafl", cl=False))
    assert m.centred and m.uses_stats
    rcfg = m.round_config(state, {}, 1)
    new = m.server_update(state, [m.client_update(m.broadcast(state), c, rcfg) for c in clients], 1)
    kappa = new.extras["gff.centre"]
    present = new.extras["stats.count"] > 0
    assert torch.allclose(kappa, new.extras["stats.mean"][present].mean(0))
    # zero-mean banks in the centred frame: the banks' grand mean sits near 0, not near κ
    banks = gff.GFFBanks(new.extras["gff.features"], new.extras["gff.counts"])
    assert float(banks.class_means().mean((0, 1)).norm()) < 0.5 * float(kappa.norm())


def test_learned_vote_weights_follow_the_experts_that_do_best_over_the_priors():
    from tafl.training.ensemble import learn_vote_weights, simplex_grid

    assert simplex_grid(3, 0.5).tolist() == [[0, 0, 1], [0, 0.5, 0.5], [0, 1, 0], [0.5, 0, 0.5], [0.5, 0.5, 0], [1, 0, 0]]
    g = torch.Generator().manual_seed(0)
    C, D = 3, 4
    feats = torch.randn(300, D, generator=g)
    labels = torch.arange(C).repeat_interleave(100)
    feats[:, :C] += 3 * torch.nn.functional.one_hot(labels, C)  # class c lives along axis c
    good = torch.eye(C, D) * 2
    W = torch.stack([good, -good, torch.zeros(C, D)])  # expert 0 right, 1 inverted, 2 blind
    b = torch.zeros(3, C)
    priors = torch.tensor([[0.6, 0.3, 0.1], [1 / 3] * 3, [0.1, 0.3, 0.6]])
    w = learn_vote_weights(feats, labels, W, b, priors)
    assert w[1] < w[0] and w[1] <= 0.2, w  # the inverted expert is outweighed ...
    pooled = ExpertEnsemble(torch.nn.Identity(), W, b, ("forward", "uniform", "backward"), "learned", tuple(w))(feats)
    assert torch.equal(pooled["label"], (feats @ good.t()).argmax(1))  # ... so the vote is as good as expert 0
    same = torch.stack([good, good, good])  # identical experts: nothing to learn, equal weights
    assert torch.allclose(learn_vote_weights(feats, labels, same, b, priors), torch.full((3,), 1 / 3), atol=0.07)


def test_learned_rule_is_the_weighted_soft_vote():
    W = torch.zeros(3, 3, 1)
    b = torch.tensor([[3.0, 0.0, 0.0], [0.0, 3.0, 0.0], [0.0, 0.0, 3.0]])
    names = ("forward", "uniform", "backward")
    x = torch.zeros(1, 1)
    assert int(ExpertEnsemble(torch.nn.Identity(), W, b, names, "learned", (0.1, 0.2, 0.7))(x)["label"]) == 2
    assert int(ExpertEnsemble(torch.nn.Identity(), W, b, names, "learned", (0.6, 0.2, 0.2))(x)["label"]) == 0


def test_default_lambda_makes_the_banks_independent_of_the_data_size(smoke_cfg):
    m, _, _ = _method_and_clients(_smoke(smoke_cfg, "gtafl", cl=False))
    small, big = np.array([400, 100, 40, 10]), np.array([400, 100, 40, 10]) * 50
    ranks = np.arange(4)
    a = gff.expert_counts(gff.EXPERT_NAMES, small, ranks, 100, m.gff_lambda(small))
    b = gff.expert_counts(gff.EXPERT_NAMES, big, ranks, 100, m.gff_lambda(big))
    assert np.array_equal(a, b)
    assert a[0].tolist() == [100 + round(100 * 400 / 137.5), 173, 129, 107]  # m·(1 + d_c / mean d)
    assert a[0].sum() == pytest.approx(2 * a[1].sum(), abs=4)  # the forward bank is twice the uniform one
    smoke_cfg.gff_lambda = 0.01  # the paper's fixed λ stays available
    assert make_method(smoke_cfg, m.model_cfg, m.preprocess).gff_lambda(big) == 0.01


@pytest.mark.slow
def test_continuing_a_finished_model_finishes_again(tmp_path, smoke_cfg):
    """`tafl retrain` starts from a finished model; its new rounds make the finishing round due again."""
    cfg = _smoke(smoke_cfg, "gtafl", cl=False, rounds=1)
    train(cfg, tmp_path / "first", progress=False)
    ck = load_checkpoint(tmp_path / "first" / "final.pt")
    assert ck["state"]["meta"]["finished"] is True
    report = train(cfg, tmp_path / "again", progress=False, init_from=ck)
    assert report["finishing_round"]["clients"] == [0, 1, 2, 3]
    assert load_checkpoint(tmp_path / "again" / "final.pt")["state"]["meta"]["finished"] is True
