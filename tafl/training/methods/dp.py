"""Record-level differential privacy as a part a method composes (tafl.training.privacy holds the mechanisms and
the accountant): a client's plan, the noise generator and the census's one noisy release.

A method sets what it releases besides the census and the DP-SGD steps (`releases`: statistics releases per training
round and in the finishing round; `dp_sgd` False for a method whose sites train nothing) and draws its noise from
`noise`, one generator per method, seeded from the OS, never from the run's seed.
"""

from __future__ import annotations

import torch

from tafl.training.config import RunConfig
from tafl.training.contract import ClientData


class ClientPrivacy:
    """The run's DP for one method instance; `enabled` False (no dp_epsilon): nothing here is used."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.enabled = cfg.dp_epsilon is not None
        self.releases: tuple[int, int] = (0, 0)  # statistics releases per training round, in the finishing round
        self.dp_sgd = True  # the sites train with DP-SGD (lda: they train nothing)
        self._noise: torch.Generator | None = None
        self._census: dict[int, torch.Tensor] = {}  # client -> its one noisy census release (C,), re-sent when asked

    def plan(self, n: int):
        """The plan (tafl.training.privacy.ClientPlan) of a client with n training records."""
        from tafl.training.privacy import detector_releases, plan_client

        per_round, finishing = self.releases
        # the in-domain detector's statistics (tafl.training.detector): one release after training
        finishing += detector_releases(self.cfg)
        return plan_client(self.cfg, n, per_round, finishing, dp_sgd=self.dp_sgd)

    @property
    def noise(self) -> torch.Generator:
        """The DP noise and Poisson draws: seeded from the OS, never from the run's seed."""
        if self._noise is None:
            from tafl.training.privacy import noise_generator

            self._noise = noise_generator()
        return self._noise

    @noise.setter
    def noise(self, gen: torch.Generator) -> None:
        """Fix the draws (a test, an offline analysis); a run never does: its noise comes from the OS."""
        self._noise = gen

    def census(self, data: ClientData) -> torch.Tensor:
        """The client's class counts (C,) as its one noisy release (Gaussian, sensitivity 1; negative values clipped
        to 0 after the noise), the same each time the server asks."""
        k = int(data.client_id)
        if k not in self._census:
            from tafl.training.privacy import gaussian_release

            z = self.plan(len(data)).stats_noise_multiplier
            noisy = gaussian_release({"c": (data.class_counts().to(torch.float64), 1.0)}, z, self.noise)["c"]
            self._census[k] = noisy.clamp_min(0).to(torch.float32)
        return self._census[k].clone()

