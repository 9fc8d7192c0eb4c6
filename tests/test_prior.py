"""tafl.prior: calibration, EM prior estimation and the adapted rule, on data whose truth is known."""

from __future__ import annotations

import numpy as np
import pytest

from tafl.errors import ConfigError
from tafl.prior import (Calibration, adapt, check_prior, em_prior, fit_calibration, log_prior_ratio, nll_stats,
                        softmax, sum_stats, total_variation)

C = 5
SOURCE = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
MU = np.random.default_rng(0).normal(0, 1, (C, C)) * 1.2  # overlapping classes: priors matter


def _draw(prior, n, seed):
    """Gaussian classes with known means: the exact posterior under `SOURCE` is softmax(true_logits)."""
    rng = np.random.default_rng(seed)
    y = rng.choice(C, n, p=prior)
    x = MU[y] + rng.normal(0, 1, (n, C))
    true_logits = -0.5 * ((x[:, None, :] - MU[None]) ** 2).sum(-1) + np.log(SOURCE)
    return true_logits, y


def test_em_recovers_a_shifted_prior_from_exact_posteriors():
    target = np.array([0.05, 0.1, 0.15, 0.2, 0.5])  # the training mix reversed: an outbreak of the rare classes
    z, _ = _draw(target, 5000, 1)
    est = em_prior(softmax(z), SOURCE)
    assert est.converged and est.images == 5000
    assert total_variation(est.prior, target) < 0.03
    assert est.shift == pytest.approx(total_variation(est.prior, SOURCE))
    # with no shift the estimate stays at the source prior
    z0, _ = _draw(SOURCE, 5000, 2)
    assert total_variation(em_prior(softmax(z0), SOURCE).prior, SOURCE) < 0.03


def test_em_with_no_images_or_the_iteration_cap():
    est = em_prior(np.zeros((0, C)), SOURCE)
    assert est.images == 0 and np.allclose(est.prior, SOURCE)
    z, _ = _draw(SOURCE[::-1], 500, 3)
    capped = em_prior(softmax(z), SOURCE, max_iter=2)
    assert capped.iterations == 2 and not capped.converged
    with pytest.raises(ValueError):
        em_prior(np.ones((3, C + 1)) / (C + 1), SOURCE)


def test_the_adapted_rule_is_the_bayes_rule_for_the_new_prior():
    target = np.array([0.05, 0.1, 0.15, 0.2, 0.5])
    z, y = _draw(target, 4000, 4)
    p = softmax(z)
    plain = (p.argmax(1) == y).mean()
    adapted = (adapt(p, SOURCE, target).argmax(1) == y).mean()
    assert adapted > plain + 0.05
    # adapting to the source prior changes nothing; the shift is log q − log π
    assert np.allclose(adapt(p, SOURCE, SOURCE), p)
    assert np.allclose(log_prior_ratio(target, SOURCE), np.log(target) - np.log(SOURCE))


def test_bcts_undoes_a_temperature_and_per_class_biases():
    z, y = _draw(SOURCE, 6000, 5)
    bias = np.array([1.0, 0.0, -1.0, 0.5, 0.0])
    bad = 3.0 * z + bias  # overconfident and biased
    cal = fit_calibration(bad, y, "bcts")
    assert cal.temperature == pytest.approx(3.0, rel=0.1)
    assert cal.fit["nll_after"] < cal.fit["nll_before"]
    assert np.allclose(cal.bias, -(bias - bias.mean()) / 3.0, atol=0.15)
    # calibrated posteriors give EM its exact-posterior accuracy again
    target = np.array([0.05, 0.1, 0.15, 0.2, 0.5])
    zt, _ = _draw(target, 3000, 6)
    calibrated = em_prior(cal.probs(3.0 * zt + bias), cal.source_prior).prior
    raw = em_prior(softmax(3.0 * zt + bias), cal.source_prior).prior
    assert total_variation(calibrated, target) < 0.04 < total_variation(raw, target)
    temp = fit_calibration(bad, y, "temperature")
    assert temp.bias is None and temp.fit["nll_after"] >= cal.fit["nll_after"] - 1e-9


def test_federated_sums_equal_the_pooled_statistics():
    z, y = _draw(SOURCE, 900, 7)
    parts = [nll_stats(z[i::3], y[i::3], 0.7, np.array([0.1, 0, 0, -0.1, 0]), "bcts") for i in range(3)]
    pooled = nll_stats(z, y, 0.7, np.array([0.1, 0, 0, -0.1, 0]), "bcts")
    total = sum_stats(parts)
    for k in pooled:
        assert np.allclose(total[k], pooled[k])
    # an empty client contributes nothing
    empty = nll_stats(np.zeros((0, C)), np.zeros(0, np.int64), 1.0, None, "bcts")
    assert float(empty["n"][0]) == 0 and not empty["grad"].any()


def test_gradient_and_hessian_match_finite_differences():
    z, y = _draw(SOURCE, 200, 8)
    theta = np.array([0.8, 0.2, -0.1, 0.0, 0.3, -0.4])

    def nll(t):
        return float(nll_stats(z, y, t[0], t[1:], "bcts")["nll"][0])

    s = nll_stats(z, y, theta[0], theta[1:], "bcts")
    eps = 1e-5
    num = np.array([(nll(theta + eps * e) - nll(theta - eps * e)) / (2 * eps) for e in np.eye(len(theta))])
    assert np.allclose(s["grad"], num, rtol=1e-4, atol=1e-4)
    num_h = np.array([(nll_stats(z, y, *(lambda t: (t[0], t[1:]))(theta + eps * e), "bcts")["grad"]
                       - nll_stats(z, y, *(lambda t: (t[0], t[1:]))(theta - eps * e), "bcts")["grad"]) / (2 * eps)
                      for e in np.eye(len(theta))])
    assert np.allclose(s["hess"], num_h, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("bad, why", [([0.5, 0.5, 0.1, 0, 0], "sum to 1"), ([1.2, -0.2, 0, 0, 0], "negative"),
                                      ([0.5, 0.5], "one value per class"), ([np.nan, 1, 0, 0, 0], "finite"),
                                      ("abc", "numbers")])
def test_an_explicit_prior_is_checked(bad, why):
    with pytest.raises(ConfigError, match=why):
        check_prior(bad, C)
    assert np.allclose(check_prior([0.2] * 5, C), 0.2)


def test_calibration_round_trips_and_refuses_bad_values():
    cal = Calibration(0.5, np.array([0.1, -0.1, 0, 0, 0]), SOURCE, "bcts", {"iterations": 3})
    back = Calibration.from_dict(cal.to_dict(), C)
    assert back.temperature == pytest.approx(2.0) and np.allclose(back.bias, cal.bias)
    assert np.allclose(back.source_prior, SOURCE)
    assert Calibration.from_dict(None).kind == "none"
    with pytest.raises(ConfigError):
        Calibration.from_dict({"temperature": -1.0})
    with pytest.raises(ConfigError):
        Calibration.from_dict({"bias": [0.0, 1.0]}, C)

    with pytest.raises(ConfigError, match="class_scale"):
        Calibration.from_dict({"class_scale": [1.0, -1.0, 1.0, 1.0, 1.0]}, C)
    vec = Calibration(0.5, np.zeros(C), SOURCE, "vector", {}, np.array([0.5, 1.0, 1.5, 1.0, 1.0]))
    back = Calibration.from_dict(vec.to_dict(), C)
    assert np.allclose(back.class_scale, vec.class_scale) and np.allclose(back.scales, [0.25, 0.5, 0.75, 0.5, 0.5])


def _log_softmax(z):
    z = z - z.max(1, keepdims=True)
    return z - np.log(np.exp(z).sum(1, keepdims=True))


def test_vector_scaling_undoes_per_class_scales_that_bcts_cannot():
    """A model over- and under-confident by class (log-probabilities scaled by s_c, shifted by b_c): vector scaling
    recovers the exact posteriors and EM the shifted prior; BCTS, one scale for all classes, leaves EM off."""
    s = np.array([3.0, 0.5, 1.0, 2.0, 0.7])
    b = np.array([0.5, 0.0, -0.5, 0.3, 0.0])

    def distort(z):
        return s * _log_softmax(z) + b

    z, y = _draw(SOURCE, 8000, 11)
    vec = fit_calibration(distort(z), y, "vector")
    bcts = fit_calibration(distort(z), y, "bcts")
    assert vec.kind == "vector" and vec.class_scale is not None and abs(vec.class_scale.mean() - 1) < 1e-9
    assert np.allclose(vec.scales * s, (vec.scales * s).mean(), rtol=0.1)  # a_c·s_c: the same for every class
    assert vec.fit["nll_after"] < bcts.fit["nll_after"]
    target = np.array([0.05, 0.1, 0.15, 0.2, 0.5])
    zt, _ = _draw(target, 4000, 12)
    tv_vec = total_variation(em_prior(vec.probs(distort(zt)), vec.source_prior).prior, target)
    tv_bcts = total_variation(em_prior(bcts.probs(distort(zt)), bcts.source_prior).prior, target)
    assert tv_vec < 0.04 and tv_bcts > 2 * tv_vec


def test_vector_scaling_statistics_are_sums_and_exact_derivatives():
    z, y = _draw(SOURCE, 300, 13)
    a, bias = np.array([0.8, 1.2, 1.0, 0.6, 1.4]), np.array([0.2, -0.1, 0.0, 0.3, -0.4])
    parts = [nll_stats(z[i::3], y[i::3], a, bias, "vector") for i in range(3)]
    pooled = nll_stats(z, y, a, bias, "vector")
    total = sum_stats(parts)
    assert pooled["grad"].shape == (2 * C,) and pooled["hess"].shape == (2 * C, 2 * C)
    for k in pooled:
        assert np.allclose(total[k], pooled[k])
    theta = np.concatenate([a, bias])
    eps = 1e-5

    def at(t):
        return nll_stats(z, y, t[:C], t[C:], "vector")

    num = np.array([(at(theta + eps * e)["nll"][0] - at(theta - eps * e)["nll"][0]) / (2 * eps) for e in np.eye(2 * C)])
    assert np.allclose(pooled["grad"], num, rtol=1e-4, atol=1e-4)
    num_h = np.array([(at(theta + eps * e)["grad"] - at(theta - eps * e)["grad"]) / (2 * eps) for e in np.eye(2 * C)])
    assert np.allclose(pooled["hess"], num_h, rtol=1e-3, atol=1e-3)
    with pytest.raises(ConfigError):
        nll_stats(z, y, 1.0, None, "matrix")


def _gaussian_task(seed: int = 0, C: int = 5, d: int = 8):
    rng = np.random.default_rng(seed)
    mu = rng.normal(0, 1.2, (C, d))

    def sample(q, n):
        y = rng.choice(C, n, p=q)
        return mu[y] + rng.normal(0, 1, (n, d)), y

    def logits(x, src):  # the exact posterior's logits under the source prior
        return -0.5 * ((x[:, None, :] - mu[None]) ** 2).sum(-1) + np.log(src)

    return sample, logits


def test_confusion_estimate_holds_where_em_on_overconfident_posteriors_drifts():
    from tafl.prior import confusion_prior, soft_confusion, softmax, total_variation

    sample, logits = _gaussian_task()
    src, tgt = np.array([.5, .2, .15, .1, .05]), np.array([.05, .1, .15, .2, .5])
    xs, ys = sample(src, 4000)
    xt, _ = sample(tgt, 2000)
    over = lambda x: softmax(3 * logits(x, src))  # noqa: E731 - three times too confident
    M = soft_confusion(over(xs), ys, 5)
    assert np.allclose(M.sum(1), 1)
    tv_em = total_variation(em_prior(over(xt), src).prior, tgt)
    tv_conf = total_variation(confusion_prior(over(xt), M, src).prior, tgt)
    assert tv_conf < 0.06 < 0.2 < tv_em  # the channel M absorbs the miscalibration; EM does not


def test_confusion_estimate_shrinks_toward_the_source_and_falls_back_without_images():
    from tafl.prior import confusion_prior, confusion_stats, confusion_from_stats, soft_confusion, softmax

    sample, logits = _gaussian_task(1)
    src, tgt = np.array([.4, .3, .15, .1, .05]), np.array([.05, .05, .1, .3, .5])
    xs, ys = sample(src, 3000)
    probs = softmax(logits(xs, src))
    M = soft_confusion(probs, ys, 5)
    parts = [confusion_stats(probs[i::3], ys[i::3], 5) for i in range(3)]  # three clients' sums = the pooled matrix
    pooled = confusion_from_stats(sum(p["confusion_sum"] for p in parts), sum(p["confusion_count"] for p in parts))
    assert np.allclose(pooled, M)
    xt, _ = sample(tgt, 300)
    free = confusion_prior(softmax(logits(xt, src)), M, src).prior
    shrunk = confusion_prior(softmax(logits(xt, src)), M, src, pseudo_count=300).prior
    assert np.abs(shrunk - src).sum() < np.abs(free - src).sum()
    empty = confusion_prior(np.zeros((0, 5)), M, src)
    assert empty.images == 0 and np.allclose(empty.prior, src)
    with pytest.raises(ValueError):
        confusion_prior(probs, M[:3, :3], src)


def test_the_validation_check_blocks_adaptation_where_it_lost_on_validation(monkeypatch):
    from tafl.prior import adaptive_blocked, adaptive_check

    assert adaptive_check(None) is None and adaptive_check({"calibrated": 0.5}) is None
    good = adaptive_check({"calibrated": 0.48, "adaptive_100": 0.40, "adaptive_500": 0.475, "oracle": 0.55})
    assert good["recommended"] and good["images"] == 500 and "why" not in good  # within the 1-point tolerance
    bad = adaptive_check({"calibrated": 0.488, "adaptive_100": 0.25, "adaptive_500": 0.252, "oracle": 0.46})
    assert not bad["recommended"] and "25.2 % against 48.8 %" in bad["why"] and "--calibration vector" in bad["why"]
    assert good["against"] == "calibrated"  # an older report: only the calibrated argmax is known
    # the rule a blocked prior=adaptive serves is the model's own label (an operating point, a vote): adapting must
    # not lose to that, even where it beats the calibrated argmax
    own = adaptive_check({"calibrated": 0.45, "plain": 0.55, "adaptive_500": 0.52, "oracle": 0.58})
    assert not own["recommended"] and own["against"] == "plain" and "model's own decision" in own["why"]
    assert adaptive_check({"calibrated": 0.45, "plain": 0.55, "adaptive_500": 0.545})["recommended"]
    # the package's record as its metadata carries it; the mode is TAFL_PRIOR_ADAPTIVE, which tafl.settings reads
    from tafl.packaging.metadata import AdaptiveCheck
    from tafl.settings import prior_adaptive_mode

    assert adaptive_blocked(AdaptiveCheck(bad), "checked") == bad["why"]
    assert adaptive_blocked(AdaptiveCheck(good), "checked") is None and adaptive_blocked(AdaptiveCheck(), "checked") \
        is None and adaptive_blocked(None, "checked") is None
    assert adaptive_blocked(AdaptiveCheck({"recommended": False}), "checked")  # a reason even where none is given
    assert adaptive_blocked(AdaptiveCheck(bad), "always") is None
    with pytest.raises(ConfigError, match="checked or always"):
        adaptive_blocked(AdaptiveCheck(), "sometimes")
    monkeypatch.setenv("TAFL_PRIOR_ADAPTIVE", " Always ")
    assert prior_adaptive_mode() == "always"
    monkeypatch.setenv("TAFL_PRIOR_ADAPTIVE", "")
    assert prior_adaptive_mode() == "checked"  # blank: the default, as for every TAFL_* setting
    monkeypatch.setenv("TAFL_PRIOR_ADAPTIVE", "sometimes")
    with pytest.raises(ConfigError, match="TAFL_PRIOR_ADAPTIVE must be checked or always, got 'sometimes'"):
        prior_adaptive_mode()


def test_an_older_report_is_checked_against_its_own_label_from_its_validation_section():
    """Reports written before the adaptation means held `plain` still carry the model's own validation accuracy."""
    from tafl.prior import adaptive_check, validation_average

    old = {"prior_adaptation": {"validation": {"average": {"calibrated": 0.45, "adaptive_500": 0.50}}},
           "validation": {"average_accuracy": 0.56}}
    avg = validation_average(old)
    assert avg["plain"] == 0.56 and not adaptive_check(avg)["recommended"]
    assert validation_average({"validation": {"average_accuracy": 0.5}}) is None
    new = {"prior_adaptation": {"validation": {"average": {"calibrated": 0.45, "plain": 0.49, "adaptive_500": 0.50}}},
           "validation": {"average_accuracy": 0.56}}
    assert validation_average(new)["plain"] == 0.49  # the means' own record wins


def test_the_dirichlet_smoothed_estimate_keeps_every_class_that_maximum_likelihood_drops():
    """Identical rows that favour class 1: the likelihood is largest at the simplex's corner, so maximum-likelihood
    EM gives class 0 a prior of ~0 and the Bayes rule would never call it again. The smoothed estimate keeps it at
    no less than the prior's share, α·u / (n + α), and tends to the centre as α grows."""
    from tafl.prior import PriorEstimator

    src = np.array([0.5, 0.5])
    P = np.tile([0.3, 0.7], (200, 1))
    mle = em_prior(P, src, max_iter=2000)
    assert mle.prior[0] < 1e-3
    smooth = PriorEstimator(100.0, "uniform").estimate(P, src, max_iter=2000)
    assert smooth.prior[0] >= 100 * 0.5 / 300 - 1e-9 and smooth.prior[1] > smooth.prior[0]
    far = PriorEstimator(1e7, "uniform").estimate(P, src)
    assert np.allclose(far.prior, [0.5, 0.5], atol=1e-3)
    # the centre is a parameter: toward the source prior, as em_prior's pseudo_count always was
    skew = np.array([0.9, 0.1])
    toward_src = PriorEstimator(1e7, "source").estimate(P, skew)
    assert np.allclose(toward_src.prior, skew, atol=1e-3)
    assert np.allclose(PriorEstimator(0.0).estimate(P, src).prior, mle.prior, atol=1e-6)
    with pytest.raises(ValueError, match="center"):
        em_prior(P, src, pseudo_count=1.0, center=np.array([1.0, -1.0]))


def test_the_estimator_record_round_trips_and_bad_records_are_refused():
    from tafl.prior import PriorEstimator

    est = PriorEstimator(400.0, "uniform", {"chosen": "validation", "scores": {"0": 0.5, "400": 0.55}})
    back = PriorEstimator.from_dict(est.to_dict())
    assert back == est and back.to_dict()["kind"] == "em"
    assert "400 images toward the uniform mix" in back.describe()
    old = PriorEstimator.from_dict(None)  # a package from before the record: the maximum-likelihood EM
    assert old.pseudo_count == 0 and old.describe() == "EM (maximum likelihood)"
    for bad, why in (({"pseudo_count": -1}, ">= 0"), ({"pseudo_count": float("nan")}, ">= 0"),
                     ({"pseudo_count": "many"}, "a number"), ({"pseudo_count": 5, "center": "median"}, "center")):
        with pytest.raises(ConfigError, match=why):
            PriorEstimator.from_dict(bad)


def test_the_smoothing_is_chosen_on_the_rows_given_and_ties_keep_the_smaller():
    from tafl.prior import SMOOTHING_GRID
    from tafl.training.simulator import select_prior_smoothing

    ranks = np.argsort(np.argsort(-SOURCE))
    # exact posteriors: maximum likelihood is right, and heavy smoothing only drags the estimate to the centre
    z, y = _draw(SOURCE, 1500, 3)
    est = select_prior_smoothing(softmax(z), y, ranks, SOURCE, [100, 500], 3, 0)
    scores = est.record["scores"]
    assert set(scores) == {f"{a:g}" for a in SMOOTHING_GRID} | {f"confusion:{a:g}" for a in SMOOTHING_GRID}
    assert est.record["chosen"] == "validation" and est.kind == "em"  # exact posteriors: EM, which has no M to fit
    assert scores[f"{est.pseudo_count:g}"] == max(scores.values())
    assert est.pseudo_count <= 50 and scores["1600"] < scores["0"] - 0.01
    # posteriors that decide alone (one-hot): every smoothing scores the same, and the smallest is kept
    flat = select_prior_smoothing(np.eye(C)[y], y, ranks, SOURCE, [100], 2, 0)
    assert len(set(flat.record["scores"].values())) == 1 and flat.pseudo_count == 0


def test_the_confusion_estimator_is_chosen_where_the_posteriors_are_poor_and_travels_as_a_record():
    """Posteriors three times too confident: EM's estimate drifts, soft BBSE's does not (the channel M absorbs the
    miscalibration). The validation choice, which scores the confusion estimator cross-fitted, picks it; the
    shipped estimator (M from every validation row) estimates a new mix better than EM; its record round-trips."""
    from tafl.prior import PriorEstimator, soft_confusion
    from tafl.training.simulator import select_prior_smoothing

    sample, logits = _gaussian_task()
    src = np.array([.5, .2, .15, .1, .05])
    ranks = np.argsort(np.argsort(-src))
    xs, ys = sample(src, 3000)
    over = lambda x: softmax(3 * logits(x, src))  # noqa: E731
    est = select_prior_smoothing(over(xs), ys, ranks, src, [500], 2, 0)
    assert est.kind == "confusion", est.record["scores"]
    assert np.allclose(np.asarray(est.confusion), soft_confusion(over(xs), ys, 5))
    key = f"confusion:{est.pseudo_count:g}"
    assert est.record["scores"][key] == max(est.record["scores"].values()) > est.record["scores"]["0"]
    tgt = np.array([.05, .1, .15, .2, .5])
    xt, _ = sample(tgt, 1000)
    em = PriorEstimator(0.0, "uniform").estimate(over(xt), src).prior
    assert total_variation(est.estimate(over(xt), src).prior, tgt) < total_variation(em, tgt) - 0.1
    back = PriorEstimator.from_dict(est.to_dict())
    assert back == est and back.to_dict()["kind"] == "confusion" and "soft BBSE" in back.describe()
    bad = dict(est.to_dict(), confusion=[[0.5, 0.6], [0.5, 0.5]])
    with pytest.raises(ConfigError, match="square matrix whose rows are probability vectors"):
        PriorEstimator.from_dict(bad)
    with pytest.raises(ConfigError, match="kind must be one of em, confusion"):
        PriorEstimator.from_dict(dict(est.to_dict(), kind="bbse2"))


def test_the_services_window_estimates_with_the_packages_estimator():
    """PriorMonitor (tafl.serving.runtime): the EM that runs off the event loop is the package's estimator."""
    import time

    from tafl.prior import PriorEstimator
    from tafl.serving.runtime import PriorMonitor

    src = np.array([0.5, 0.5])
    rows = np.tile([0.3, 0.7], (40, 1))
    got = {}
    confusion = PriorEstimator(0.0, "uniform", confusion=((0.9, 0.1), (0.1, 0.9)))
    for name, est in (("mle", None), ("smooth", PriorEstimator(40.0, "uniform")), ("confusion", confusion)):
        mon = PriorMonitor(src, window=40, refresh=40, min_images=10, estimator=est)
        mon.add(rows)
        deadline = time.time() + 10
        while mon.current()[0] is None and time.time() < deadline:
            time.sleep(0.01)
        got[name] = mon.current()[0]
        assert mon.describe()["estimator"]["pseudo_count"] == (40.0 if name == "smooth" else 0.0)
        assert mon.describe()["estimator"]["kind"] == ("confusion" if name == "confusion" else "em")
    assert got["mle"][0] < 0.01 and got["smooth"][0] >= 40 * 0.5 / 80 - 1e-9
    assert got["confusion"][0] == pytest.approx(0.25, abs=1e-4)  # q·M = the rows' mean (0.3, 0.7): q = (0.25, 0.75)


def test_the_services_window_is_estimated_at_most_every_min_interval_and_last_on_the_newest_rows():
    """Under load the EM runs no more often than `min_interval`; the estimate after a burst still covers its last
    images (the refresh that waited takes the window as it is when it runs)."""
    import time

    from tafl.serving.runtime import PriorMonitor

    src = np.array([0.5, 0.5])
    mon = PriorMonitor(src, window=1000, refresh=10, min_images=10, min_interval=0.3)
    runs = []
    inner = mon.estimator.estimate
    mon.estimator.estimate = lambda rows, source, **kw: runs.append(len(rows)) or inner(rows, source, **kw)
    t0 = time.monotonic()
    for _ in range(50):  # 500 images in well under the interval: the refresh is due 50 times
        mon.add(np.tile([0.2, 0.8], (10, 1)))
    deadline = time.time() + 10
    while (mon.estimate is None or mon.estimate.images < 500) and time.time() < deadline:
        time.sleep(0.02)
    elapsed = time.monotonic() - t0
    assert mon.estimate.images == 500 and mon.current()[0][1] > 0.7
    assert len(runs) <= 2 + elapsed / 0.3, (runs, elapsed)  # not one EM per 10 images
    assert runs[-1] == 500


def test_the_prior_option_is_one_grammar_for_the_service_and_the_clients():
    """tafl.prior.parse_prior_option reads `prior=` of /predict and `tafl score --prior` alike."""
    from tafl.prior import PriorOption, parse_prior_option

    for given, mode in ((None, "train"), ("", "train"), ("  Train ", "train"), ("SITE", "site"),
                        ("adaptive", "adaptive"), ("0.2,0.8", "explicit"), (" [0.2, 0.8] ", "explicit")):
        assert parse_prior_option(given).mode == mode, given
    assert parse_prior_option("0.2, 0.8").values() == [0.2, 0.8]
    assert parse_prior_option(" [0.2, 0.8] ").values() == [0.2, 0.8]  # a JSON list, spaces around it dropped
    for bad in ("adaptiv", "0.2;0.8", "[0.2, 0.8"):
        with pytest.raises(ValueError):
            parse_prior_option(bad).values()
    assert PriorOption("explicit", "0.5,0.5").values() == [0.5, 0.5]
