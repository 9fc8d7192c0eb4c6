"""Record-level differential privacy for everything a client sends (docs/design.md, "What leaves a site").

The unit is one record: one training image at a site. With `dp_epsilon` set, each client

* trains with DP-SGD (Opacus: per-sample gradients clipped to `dp_clip`, Gaussian noise of
  σ = z·dp_clip added to their sum, Poisson sampling of records at rate q = batch_size / n);
* releases its class counts once (the census) through the Gaussian mechanism (sensitivity 1),
  and re-sends that same noisy release whenever the server asks again;
* releases GTAFL's and CReFF's per-class expert gradients and class statistics as noisy sums of
  bounded per-record terms: every feature vector is clipped to norm F = `dp_feature_clip`·√D, so one
  record moves a class's gradient sum by at most √(2E(F² + 1)) (E heads), its feature sum by F,
  its sum of squares by F² and its count by 1. Each part is divided by its sensitivity and the
  parts are released together, so the release is one Gaussian mechanism of sensitivity √k on k
  parts, with noise multiplier z_s = r·z (r = `dp_stats_ratio`: a statistics release is not
  subsampled, so it costs far more budget per release than a DP-SGD step at the same multiplier;
  at ε = 8 with r = 1 the twenty-one releases of a DermaMNIST GTAFL run would force z from 1.6
  to 3.2, with r = 3 they cost z 1.6 → 1.7).

One accountant (dp_accounting's RDP accountant, add-or-remove-one-record neighbours) composes
every release of a client over the whole run: the census, every DP-SGD step of every round it
could take part in, and every statistics release (each round and the finishing round). z is the
smallest noise multiplier for which that composition stays within (ε, δ) (dp_accounting's
`calibrate_dp_mechanism`); each client computes its own from its record count n. The count n is
treated as public, as DP-SGD's sampling rate is in Opacus; the class counts are not.

The noise and the Poisson draws come from a generator seeded from the operating system's entropy,
never from the run's seed (which the coordinator knows): a DP run is not bit-reproducible. Opacus's
`secure_mode` (a cryptographically secure sampler, torchcsprng) is not used.

Nothing here is cryptography or an accountant of our own: the accountant is dp_accounting's, the
per-sample clipping and noise of DP-SGD are Opacus's.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where noise is drawn: the card and the page read this module without it
    import torch

MECHANISM = ("DP-SGD (Opacus: per-sample clipping, Gaussian noise, Poisson sampling) and the Gaussian mechanism on "
             "every other quantity a client computes from its records")
MECHANISM_LDA = ("the Gaussian mechanism on each site's class counts (the census) and, once, on its class sums of "
                 "clipped whitened features (method lda: no DP-SGD)")
UNIT = "record (one training image at a site)"
ACCOUNTANT = ("RDP (dp_accounting.rdp.RdpAccountant, add-or-remove-one-record), composed over the census, every "
              "DP-SGD step of every round and every statistics release of the run")
NOT_PROTECTED = ["the number of sites and each site's number of training images (DP-SGD's sampling rate reads it, "
                 "as in Opacus)",
                 "the validation split the coordinator holds for model selection, the operating point, the prediction "
                 "sets' calibration and, when the "
                 "sites train the head only, the extractor's pre-training and the head's basis",
                 "what the final model's outputs reveal beyond the (ε, δ) bound of its training"]
SCOPES = {"none": "nothing: the sites train no weights; each releases its class feature sums once (method lda)",
          "all": "the whole network",
          "head": "the classifier head only: the feature extractor is fixed before training from data no site holds "
                  "(its seeded initialisation and any SimCLR on the server's unlabeled images)"}
MIN_COUNT_SIGMAS = 2.0  # a class enters a noisy statistics release only when its noisy count is this many σ above 0


@dataclass(frozen=True)
class ClientPlan:
    """One client's privacy plan: its noise multiplier z, chosen so that the whole run's releases stay within the
    target (ε, δ), and the counts of releases that bound assumed."""

    epsilon_target: float
    delta: float
    noise_multiplier: float  # z: DP-SGD's
    stats_noise_multiplier: float  # z_s = r·z: the census's and every statistics release's
    sample_rate: float
    steps: int  # DP-SGD steps over the run, as if the client took part in every round
    releases: int  # statistics releases over the run (besides the census)
    clip: float
    feature_clip: float

    def epsilon(self, steps: int | None = None, releases: int | None = None) -> float:
        """The accountant's ε after `steps` DP-SGD steps and `releases` statistics releases (and the census)."""
        return epsilon_of(self.noise_multiplier, self.stats_noise_multiplier / self.noise_multiplier,
                          self.sample_rate, self.steps if steps is None else int(steps),
                          self.releases if releases is None else int(releases), self.delta)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _event(z: float, ratio: float, q: float, steps: int, releases: int):
    import dp_accounting as dpa

    parts = [dpa.GaussianDpEvent(z * ratio)]  # the census: class counts, sensitivity 1
    if steps:
        parts.append(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), steps))
    if releases:
        parts.append(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(z * ratio), releases))
    return dpa.ComposedDpEvent(parts)


def _quiet_absl() -> None:
    """dp_accounting's RDP series warns, through absl, for every low order it drops at large sampling rates; the
    orders it keeps still bound ε."""
    import logging

    logging.getLogger("absl").setLevel(logging.ERROR)


@lru_cache(maxsize=1024)
def epsilon_of(z: float, ratio: float, q: float, steps: int, releases: int, delta: float) -> float:
    from dp_accounting.rdp import RdpAccountant

    _quiet_absl()
    acc = RdpAccountant()
    acc.compose(_event(z, ratio, q, steps, releases))
    return float(acc.get_epsilon(delta))


@lru_cache(maxsize=256)
def calibrate(epsilon: float, delta: float, ratio: float, q: float, steps: int, releases: int) -> float:
    """The smallest DP-SGD noise multiplier z whose composed run (statistics at r·z) stays within (ε, δ)
    (dp_accounting's bisection, to 0.1 %)."""
    import dp_accounting as dpa
    from dp_accounting.rdp import RdpAccountant

    _quiet_absl()
    return float(dpa.calibrate_dp_mechanism(RdpAccountant, lambda z: _event(z, ratio, q, steps, releases), epsilon,
                                            delta, dpa.LowerEndpointAndGuess(1e-2, 1.0), tol=1e-3))


def plan_client(cfg, n: int, releases_per_round: int, finishing_releases: int = 0, dp_sgd: bool = True) -> ClientPlan:
    """The plan of a client with n training records under run config `cfg` (dp_epsilon set); `dp_sgd` False: the
    client trains nothing (LDA), so the census and its statistics releases are all the accountant composes."""
    if n < 1:
        raise ValueError("a client needs at least one record")
    q = min(1.0, cfg.batch_size / n)
    steps = cfg.rounds * cfg.local_epochs * math.ceil(1.0 / q) if dp_sgd else 0
    releases = cfg.rounds * releases_per_round + finishing_releases
    ratio = float(cfg.dp_stats_ratio)
    z = calibrate(float(cfg.dp_epsilon), float(cfg.dp_delta), ratio, q, steps, releases)
    return ClientPlan(float(cfg.dp_epsilon), float(cfg.dp_delta), z, z * ratio, q, steps, releases,
                      float(cfg.dp_clip), float(cfg.dp_feature_clip))


def noise_generator() -> torch.Generator:
    """A generator the coordinator cannot reproduce: seeded from the OS's entropy, not the run's seed."""
    import torch

    return torch.Generator().manual_seed(secrets.randbits(63))


def gaussian_release(parts: dict[str, tuple[torch.Tensor, float]], z: float,
                     gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One Gaussian mechanism over several parts: {name: (sum, L2 sensitivity of one record on it)}.

    Each part is scaled by 1/sensitivity, so one record moves the joint vector by at most √k (k parts); noise of
    σ = z·√k in those units is added, i.e. σ_i = z·√k·sensitivity_i on part i. The release is then (ε, δ)-accounted
    as GaussianDpEvent(z)."""
    import torch

    k = len(parts)
    out = {}
    for name, (value, sens) in parts.items():
        v = value.to(torch.float64)
        out[name] = v + torch.randn(v.shape, generator=gen, dtype=torch.float64) * (z * math.sqrt(k) * float(sens))
    return out


def clip_rows(x: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Each row scaled down to L2 norm ≤ max_norm (rows already inside are unchanged)."""
    norms = x.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return x * (max_norm / norms).clamp(max=1.0)


def share_epsilon(z_stats: float, divisor: float, delta: float, full_releases: int = 0) -> float:
    """Method lda under secure aggregation: the ε of one site's own share (its census at z_s, its class sums at
    z_s/divisor, and `full_releases` more at z_s: the in-domain detector's), which is what that site's numbers alone
    would reveal were SecAgg+ broken."""
    import dp_accounting as dpa
    from dp_accounting.rdp import RdpAccountant

    _quiet_absl()
    acc = RdpAccountant()
    acc.compose(dpa.ComposedDpEvent([dpa.GaussianDpEvent(z_stats), dpa.GaussianDpEvent(z_stats / divisor)]
                                    + [dpa.GaussianDpEvent(z_stats)] * int(full_releases)))
    return float(acc.get_epsilon(delta))


def privacy_section(cfg, ledger: dict[str, Any] | None, secure_aggregation: bool = False) -> dict[str, Any]:
    """The report's, metadata's and card's `privacy` object: what was promised and what the accountant says was
    spent, per client (the run's ε is the largest)."""
    if getattr(cfg, "dp_epsilon", None) is None:
        return {"mechanism": "none", "unit": None, "epsilon": None, "delta": None, "accountant": None,
                "noise_multiplier": None, "clipping": None, "secure_aggregation": bool(secure_aggregation),
                "statement": "no differential privacy: every quantity a client sends is exact"}
    clients = {}
    for k, e in sorted((ledger or {}).items(), key=lambda kv: int(kv[0])):
        plan = ClientPlan(**e["plan"])
        clients[k] = {"records": e["records"], "noise_multiplier": round(plan.noise_multiplier, 4),
                      "stats_noise_multiplier": round(plan.stats_noise_multiplier, 4),
                      "sample_rate": round(plan.sample_rate, 5), "steps": e["steps"], "releases": e["releases"],
                      "epsilon": round(plan.epsilon(e["steps"], e["releases"]), 4)}
    lda = getattr(cfg, "method", None) == "lda"
    # lda takes no DP-SGD step: its releases' multiplier is the one that matters
    zs = [c["stats_noise_multiplier" if lda else "noise_multiplier"] for c in clients.values()]
    spent = max((c["epsilon"] for c in clients.values()), default=0.0)
    return {"mechanism": MECHANISM_LDA if lda else MECHANISM, "unit": UNIT, "epsilon": spent,
            "epsilon_target": float(cfg.dp_epsilon),
            "delta": float(cfg.dp_delta), "accountant": ACCOUNTANT,
            "noise_multiplier": {"min": min(zs), "max": max(zs)} if zs else None,
            "stats_noise_ratio": float(cfg.dp_stats_ratio),
            "dp_sgd_trains": SCOPES["none" if lda else getattr(cfg, "train_scope", None) or "all"],
            "clipping": {"gradient_norm": float(cfg.dp_clip), "feature_norm_per_sqrt_dim": float(cfg.dp_feature_clip)},
            "secure_aggregation": bool(secure_aggregation), "clients": clients,
            "not_protected": NOT_PROTECTED,
            "statement": f"({spent:.3g}, {float(cfg.dp_delta):.0e})-DP per training image at every site, over the "
                         "whole run (every round, every release)", **_distributed(cfg, clients, secure_aggregation)}


def _distributed(cfg, clients: dict[str, Any], secure_aggregation: bool) -> dict[str, Any]:
    """Method lda with secure aggregation: each site adds 1/√m_t of the class sums' noise (m_t: the fewest sites a
    completed SecAgg+ sum holds), so the stated ε holds against a coordinator that sees only the secure sums; what
    one site's share alone is worth is stated beside it."""
    if not (secure_aggregation and getattr(cfg, "method", None) == "lda" and clients):
        return {}
    from tafl.training.secagg import SecAggParams, min_in_sum

    m_t = min_in_sum(cfg.clients, SecAggParams())
    z_s = min(c["stats_noise_multiplier"] for c in clients.values())
    share = share_epsilon(z_s, math.sqrt(m_t), float(cfg.dp_delta), detector_releases(cfg))
    return {"noise": "distributed", "sites_in_a_sum_at_least": m_t, "share_epsilon": round(share, 4),
            "trust": f"the class sums' noise is split over the sites of each SecAgg+ sum, each adding 1/√{m_t} of it: "
                     f"the ε above holds against a coordinator that sees only the secure sums; one site's own share, "
                     f"seen alone, is ({share:.3g}, {float(cfg.dp_delta):.0e})-DP"}


def detector_releases(cfg) -> int:
    """The Gaussian releases the in-domain detector's statistics round costs a site: one, where it is fitted under DP
    (tafl.training.detector.fit_detector)."""
    return int(bool(cfg.domain_detector) and cfg.dp_epsilon is not None)
