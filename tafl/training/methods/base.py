"""The transport-free FL step interface (docs/design.md, "Federated learning") that every method implements.

A round, driven by the in-process simulator or by the Flower adapter alike:

    stats   = {k: method.client_stats(data_k)}                  # tiny: class counts, c_k, ...
    cfg     = method.round_config(state, stats, round)         # plain JSON values, broadcast
    payload = method.broadcast(state)                          # tensors sent to each client
    results = [method.client_update(payload, data_k, cfg)]     # local work
    state   = method.server_update(state, results, round)      # aggregation + server work

and, once after the last round where a method asks for it (`finish_config`), a features-only
finishing round whose results go to `server_finish`.

Everything that crosses the wire is a `dict[str, Tensor]` or plain JSON, so transports only
serialise; no method knows which transport runs it. `GlobalState` is what checkpoints hold.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from tafl.errors import ConfigError
from tafl.imaging import Preprocess
from tafl.training.aggregate import weighted_average
from tafl.training.config import RunConfig
from tafl.training.models import Classifier, ModelConfig, build_model

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]
SERVER = 1 << 20  # the id server-side random streams use in place of a client id


def _as_float(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32)


def weights_key(tensors: Tensors) -> str:
    """A digest of a set of weights: equal exactly when every tensor is bit for bit the same."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in tensors.items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


BASIS = "head_basis."  # the payload keys of the server's head basis (train_scope head)


def split_basis(payload: Tensors) -> tuple[Tensors, Tensors | None]:
    """A round's payload without the head basis, and the basis (None when the run trains the whole network)."""
    basis = {k: v for k, v in payload.items() if k.startswith(BASIS)}
    return {k: v for k, v in payload.items() if not k.startswith(BASIS)}, (basis or None)


class BasisHead(nn.Module):
    """What a site trains with `train_scope: head`: a step (A, a) of the classifier head in the server's basis.

    The server sends the mean μ of its unlabeled pool's features and a whitening projection P (k × D, the pool's
    leading principal directions scaled to unit variance). The head becomes W + A·P, b + a − A·P·μ: the logits are
    the round's W·f + b plus A·P(f − μ) + a. A, a start at zero. Whitening makes plain SGD well conditioned (a
    fixed extractor's features share a mean far larger than their spread: 11.3 against 0.15 a dimension on
    DermaMNIST), and DP-SGD's noise grows with √(k·C), not √(D·C) (docs/decisions.md, "The head under DP"). The inputs are the
    rows [P(f − μ), W·f + b], computed once per round, so a step reads no image."""

    def __init__(self, k: int, num_classes: int, mean: torch.Tensor, proj: torch.Tensor):
        super().__init__()
        self.k = k
        self.delta = nn.Linear(k, num_classes)
        nn.init.zeros_(self.delta.weight)
        nn.init.zeros_(self.delta.bias)
        self.register_buffer("mean", mean)
        self.register_buffer("proj", proj)

    @classmethod
    def start(cls, head: nn.Linear, feats: torch.Tensor, basis: Tensors) -> tuple[BasisHead, torch.Tensor]:
        mean = basis[BASIS + "mean"].to(feats)
        proj = basis[BASIS + "proj"].to(feats)
        step = cls(proj.shape[0], head.out_features, mean, proj).to(feats.device)
        with torch.no_grad():
            rows = torch.cat([(feats - mean) @ proj.t(), head(feats)], 1)
        return step, rows

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.delta(rows[:, :self.k]) + rows[:, self.k:]

    def finish(self, head: nn.Linear) -> None:
        """Fold the step into `head` in place: W += A·P, b += a − A·P·μ."""
        with torch.no_grad():
            ap = self.delta.weight @ self.proj
            head.weight.add_(ap)
            head.bias.add_(self.delta.bias - ap @ self.mean)


@dataclass
class ClientData:
    """One client's local data: indices into image/label tensors (shared in simulation)."""

    client_id: int
    images: torch.Tensor  # uint8 (N_all, H, W, C)
    labels: torch.Tensor  # int64 (N_all,)
    indices: torch.Tensor  # int64 (n,) this client's rows
    num_classes: int
    holdout: torch.Tensor | None = None  # int64 rows held out of training for the calibration round

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def local_labels(self) -> torch.Tensor:
        return self.labels[self.indices]

    def class_counts(self) -> torch.Tensor:
        return torch.bincount(self.local_labels, minlength=self.num_classes)


@dataclass
class ClientResult:
    client_id: int
    num_samples: int
    weights: Tensors  # the updated model state (extractor, head, BatchNorm buffers)
    extras: Tensors = field(default_factory=dict)  # method extras: expert gradients, statistics
    metrics: dict[str, float] = field(default_factory=dict)  # loss etc.


@dataclass
class GlobalState:
    weights: Tensors  # the global model state
    extras: Tensors = field(default_factory=dict)  # method state: expert heads, GFF banks, counts
    meta: dict[str, Any] = field(default_factory=dict)  # JSON-able bookkeeping

    def to_dict(self) -> dict[str, Any]:
        return {"weights": self.weights, "extras": self.extras, "meta": self.meta}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GlobalState:
        return cls(dict(d["weights"]), dict(d.get("extras", {})), dict(d.get("meta", {})))


def tensor_bytes(tensors: Tensors) -> int:
    return int(sum(t.numel() * t.element_size() for t in tensors.values()))


class Method:
    """Base: FedAvg-style training of one `Classifier`. Subclasses override the steps they change."""

    name = "base"
    trains = True  # the sites train weights and report their local loss (lda: they only send class sums)

    def __init__(self, cfg: RunConfig, model_cfg: ModelConfig, preprocess: Preprocess,
                 device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.preprocess = preprocess
        self.device = torch.device(device)
        self.model: Classifier = build_model(model_cfg).to(self.device)  # the one working copy
        self.mean = torch.tensor(preprocess.mean, dtype=torch.float32, device=self.device).view(1, -1, 1, 1)
        self.std = torch.tensor(preprocess.std, dtype=torch.float32, device=self.device).view(1, -1, 1, 1)
        self._calib_cache: dict[tuple[int, int], np.ndarray] = {}  # (client, round) -> held-out logits
        self.dp = cfg.dp_epsilon is not None  # record-level DP (tafl.training.privacy)
        self._dp_counts: dict[int, torch.Tensor] = {}  # each client's one noisy census release, re-sent when asked
        self._noise: torch.Generator | None = None
        self.pool: torch.Tensor | None = None  # the server's unlabeled images (attach_server_pool)
        # client -> ((rows, extractor digest), the fixed extractor's features): frozen_features
        self._features: dict[int, tuple[tuple[int, str], torch.Tensor]] = {}
        self._basis: tuple[str, Tensors] | None = None  # (extractor key, head basis): head_basis

    # ---- state ----
    def init_state(self, train_counts: np.ndarray) -> GlobalState:
        torch.manual_seed(self.cfg.seed)
        model = build_model(self.model_cfg, pretrained=self.cfg.pretrained)
        pretraining = self.pretrain(model)
        meta: dict[str, Any] = {"round": 0, "client_counts": {}}
        if pretraining:
            meta["pretraining"] = pretraining
        return GlobalState(weights={k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                           extras={"global_counts": torch.zeros(len(train_counts))}, meta=meta)

    # ---- the local recipe every method shares ----
    def local_lr(self, round_: int) -> float:
        """This round's local learning rate (cfg.lr under cfg.lr_schedule and cfg.warmup_rounds)."""
        from tafl.training.local import scheduled_lr

        return scheduled_lr(self.cfg.lr, int(round_), self.cfg.rounds, self.cfg.lr_schedule, self.cfg.warmup_rounds)

    @property
    def policy(self):
        """The augmentation policy applied to uint8 batches before normalising, or None."""
        if self.cfg.augment_policy == "none":
            return None
        if getattr(self, "_policy", None) is None:
            from tafl.training.local import PolicyAugment

            self._policy = PolicyAugment(self.cfg.augment_policy, self.model_cfg.in_chans)
        return self._policy

    # ---- differential privacy (tafl.training.privacy) ----
    def dp_releases_per_round(self) -> tuple[int, int]:
        """Statistics releases a client makes per training round and in the finishing round (besides the census
        and the DP-SGD steps): none for a method that sends only its model."""
        return 0, 0

    def dp_plan(self, n: int):
        from tafl.training.privacy import plan_client

        per_round, finishing = self.dp_releases_per_round()
        return plan_client(self.cfg, n, per_round, finishing)

    @property
    def noise(self) -> torch.Generator:
        """The DP noise and Poisson draws: seeded from the OS, never from the run's seed."""
        if self._noise is None:
            from tafl.training.privacy import noise_generator

            self._noise = noise_generator()
        return self._noise

    def local_train(self, images: torch.Tensor, labels: torch.Tensor, data: ClientData, round_: int,
                    gen: torch.Generator, basis: Tensors | None = None, **kw: Any) -> dict[str, float]:
        """The local training every method shares: local SGD, or DP-SGD when the run is private (its noise
        multiplier from this client's plan), on the whole model or, with `train_scope: head`, on a `BasisHead` step
        in the server's `basis` (from the round's payload: `split_basis`). `kw`: sample_weights, prox_mu, prox_ref,
        loss_fn."""
        from tafl.training.local import dp_local_sgd, local_sgd

        cfg = self.cfg
        common = dict(normalize=self.normalize, epochs=cfg.local_epochs, batch_size=cfg.batch_size,
                      lr=self.local_lr(round_), momentum=cfg.momentum, weight_decay=cfg.weight_decay, gen=gen,
                      augment=cfg.augment, optimizer=cfg.optimizer, policy=self.policy)
        model: nn.Module = self.model
        if cfg.train_scope == "head":
            if basis is None:
                raise ValueError("train_scope 'head' needs the server's head basis in the payload")
            model, images = BasisHead.start(self.model.head, self.frozen_features(data.client_id, images), basis)
            common.update(normalize=_as_float, augment=False, policy=None)
            if kw.get("prox_ref") is not None:  # FedProx pulls the head toward the round's: the step toward zero
                kw["prox_ref"] = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
        if not self.dp:
            out = local_sgd(model, images, labels, **common, **kw)
        else:
            if kw.get("sample_weights") is not None or kw.get("loss_fn") is not None:
                raise ValueError("DP-SGD samples uniformly with the plain cross-entropy (the config refuses the rest)")
            plan = self.dp_plan(len(data))
            out = dp_local_sgd(model, images, labels, **common, noise_gen=self.noise,
                               noise_multiplier=plan.noise_multiplier, max_grad_norm=plan.clip,
                               sample_rate=plan.sample_rate, prox_mu=kw.get("prox_mu", 0.0),
                               prox_ref=kw.get("prox_ref"))
        if isinstance(model, BasisHead):
            model.finish(self.model.head)
        if not self.dp:
            return out
        out.pop("loss", None)  # the site's training loss is not covered by the accountant: it stays on the site
        return out

    def head_basis(self, state: GlobalState) -> Tensors:
        """With `train_scope: head`, what the round's payload adds (`BasisHead`): the mean of the server pool's
        features under the round's extractor and the whitening projection onto their leading principal directions;
        computed once per extractor. Empty otherwise."""
        if self.cfg.train_scope != "head":
            return {}
        key = weights_key({k: v for k, v in state.weights.items() if k.startswith("extractor.")})
        if self._basis is not None and self._basis[0] == key:
            return self._basis[1]
        own = self.model.state_dict().keys()
        self.model.load_state_dict({k: v for k, v in state.weights.items() if k in own})
        feats = self.frozen_features(-1, self.pool).double()
        mean = feats.mean(0)
        _, sing, vt = torch.linalg.svd(feats - mean, full_matrices=False)
        spread = sing / math.sqrt(max(1, len(feats) - 1))
        k = int(min(self.cfg.head_basis_dim, int((spread > 1e-6 * spread[0]).sum())))
        basis = {BASIS + "mean": mean.float().cpu(), BASIS + "proj": (vt[:k] / spread[:k, None]).float().cpu()}
        self._basis = (key, basis)
        return basis

    def frozen_features(self, client_id: int, images_u8: torch.Tensor) -> torch.Tensor:
        """The fixed extractor's features of a client's training rows (eval mode, no augmentation), kept while the
        extractor's weights stay the same (GTAFL's SimCLR moves them every few rounds)."""
        ext = self.model.extractor
        key = (len(images_u8), weights_key(ext.state_dict()))
        hit = self._features.get(client_id)
        if hit is not None and hit[0] == key:
            return hit[1]
        was = ext.training
        ext.eval()
        with torch.no_grad():
            feats = torch.cat([ext(self.normalize(images_u8[i:i + self.cfg.eval_batch_size]))
                               for i in range(0, len(images_u8), self.cfg.eval_batch_size)])
        ext.train(was)
        self._features[client_id] = (key, feats)
        return feats

    # ---- the five steps ----
    def client_stats(self, data: ClientData) -> Tensors:
        """The client's class counts: exact, or under DP its one noisy release (Gaussian, sensitivity 1; negative
        values clipped to 0 after the noise), the same each time the server asks."""
        if not self.dp:
            return {"class_counts": data.class_counts().to(torch.float32)}
        k = int(data.client_id)
        if k not in self._dp_counts:
            from tafl.training.privacy import gaussian_release

            z = self.dp_plan(len(data)).stats_noise_multiplier
            noisy = gaussian_release({"c": (data.class_counts().to(torch.float64), 1.0)}, z, self.noise)["c"]
            self._dp_counts[k] = noisy.clamp_min(0).to(torch.float32)
        return {"class_counts": self._dp_counts[k].clone()}

    def round_config(self, state: GlobalState, stats: dict[int, Tensors], round_: int) -> dict[str, Any]:
        self.record_counts(state, stats)
        return {"round": round_, "seed": self.cfg.seed}

    def record_counts(self, state: GlobalState, stats: dict[int, Tensors]) -> None:
        """Keep each client's latest class counts; the global counts are their sum.

        Round 0 is the census every transport runs before training: all clients report.
        """
        table = state.meta.setdefault("client_counts", {})
        for k, s in stats.items():
            counts = s.get("class_counts")
            if counts is None or counts.shape != state.extras["global_counts"].shape or \
                    not bool(torch.isfinite(counts).all()) or bool((counts < 0).any()):
                log.warning("client %s sent unusable class counts; ignored", k)
                continue
            table[str(k)] = [float(v) for v in counts.tolist()]
        if table:
            state.extras["global_counts"] = torch.tensor(np.sum(list(table.values()), axis=0), dtype=torch.float32)

    def broadcast(self, state: GlobalState) -> Tensors:
        return state.weights

    def scoped(self, weights: Tensors) -> Tensors:
        """The tensors a site's model update carries: all of them, or with `train_scope: head` only the classifier
        head's (the rest is the server's own, unchanged by the site: sending it would only cost the uplink)."""
        if self.cfg.train_scope != "head":
            return weights
        return {k: v for k, v in weights.items() if k.startswith("head.")}

    def local_update(self) -> Tensors:
        """The trained model's tensors this site sends (`scoped`), copied off the training device."""
        return {k: v.detach().cpu().clone() for k, v in self.scoped(self.model.state_dict()).items()}

    def aggregate_update(self, state: GlobalState, good: list[ClientResult]) -> Tensors:
        """FedAvg's weighted mean of the sites' updates over the tensors they send; the rest stays the server's."""
        avg = weighted_average([self.scoped(r.weights) for r in good], [r.num_samples for r in good])
        return {k: avg.get(k, v) for k, v in state.weights.items()}

    def client_update(self, payload: Tensors, data: ClientData, round_cfg: dict[str, Any]) -> ClientResult:
        raise NotImplementedError

    def server_update(self, state: GlobalState, results: list[ClientResult], round_: int) -> GlobalState:
        raise NotImplementedError

    def finish_config(self, state: GlobalState) -> dict[str, Any] | None:
        """The round config of a features-only finishing round after the last round, or None (no such round)."""
        return None

    def server_finish(self, state: GlobalState, results: list[ClientResult], round_: int) -> GlobalState:
        raise NotImplementedError

    # ---- inference ----
    def inference_model(self, state: GlobalState) -> nn.Module:
        """A module mapping a normalised batch to {"probs": (B, C), "label": (B,)}; the label at the run's
        operating point where one was chosen on validation (tafl.training.decision)."""
        from tafl.errors import CheckpointError
        from tafl.training.decision import check_record

        try:
            offset = check_record(state.meta.get("decision"), self.model_cfg.num_classes)
        except ValueError as exc:
            raise CheckpointError(f"the checkpoint's operating point is unusable: {exc}") from None
        model = build_model(self.model_cfg)
        model.load_state_dict(state.weights)
        return ProbsAndLabel(model, offset).eval()

    output_keys: tuple[str, ...] = ("probs", "label")  # what evaluation collects from the inference model

    def choose_operating_point(self, state: GlobalState, images: np.ndarray, labels: np.ndarray,
                               batch_size: int) -> GlobalState:
        """The plain decision's τ (tafl.training.decision) on the validation split, recorded in the state's meta:
        the report, `tafl eval` and the package all decide with it."""
        from tafl.training.decision import select_operating_point
        from tafl.training.evaluate import predict

        module = self.inference_model(state).to(self.device)
        out = predict(module, images, self.normalize, batch_size, keys=("logits",))
        rec = select_operating_point(out["logits"], labels, self.default_source_prior(state))
        return GlobalState(state.weights, state.extras, dict(state.meta, decision=rec))

    def attach_server_pool(self, images_u8: torch.Tensor | None) -> None:
        """Unlabeled server-side images: the extractor's pre-training (`pretrain_steps`) and GTAFL's SimCLR."""
        self.pool = images_u8
        if self.cfg.pretrain_steps and (images_u8 is None or len(images_u8) < 2):
            raise ConfigError("--pretrain-steps needs an unlabeled server pool of at least 2 images (simclr_pool)")

    def pretrain(self, model: Classifier) -> dict[str, Any]:
        """`pretrain_steps` of SimCLR on the server's unlabeled pool, before round 1, on `model`'s extractor in
        place: data that spend no site's privacy budget (docs/decisions.md, "The head under DP"). Returns what the report records."""
        from tafl.training.simclr import ProjectionHead, simclr_refine

        cfg = self.cfg
        if not cfg.pretrain_steps:
            return {}
        gen = self.generator(0, SERVER, 4)
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))  # the projection head's init
        proj = ProjectionHead(model.feature_dim, cfg.simclr_proj_dim).to(self.device)
        model.to(self.device)
        t0 = time.perf_counter()
        loss = simclr_refine(model.extractor, proj, self.pool, self.normalize, steps=cfg.pretrain_steps,
                             batch=cfg.simclr_batch, lr=cfg.pretrain_lr, tau=cfg.simclr_tau, gen=gen)
        log.info("pre-trained the extractor on the server's %d unlabeled images: %d SimCLR steps, loss %.3f, %.0f s",
                 len(self.pool), cfg.pretrain_steps, loss, time.perf_counter() - t0)
        return {"steps": int(cfg.pretrain_steps), "pool": cfg.simclr_pool, "images": int(len(self.pool)),
                "loss": float(loss), "seconds": round(time.perf_counter() - t0, 1)}

    def extra_report(self, state: GlobalState, outputs: dict[str, np.ndarray], test, ranks: np.ndarray) -> dict[str, Any]:
        """Method-specific report sections (e.g. each expert's accuracies); none by default."""
        return {}

    # ---- calibration and prior adaptation (tafl.prior) ----
    def calibration_update(self, payload: Tensors, data: ClientData, round_cfg: dict[str, Any]) -> ClientResult:
        """A calibration round on a client: the NLL statistics of its held-out rows at the round's (scale,
        bias). Only sums leave the client (tafl.prior.nll_stats); its held-out posteriors are computed once per
        calibration and kept for the following Newton rounds."""
        from tafl import prior

        rows = data.holdout if data.holdout is not None else torch.zeros(0, dtype=torch.int64)
        key = (int(data.client_id), int(round_cfg["round"]))
        z = self._calib_cache.get(key)
        if z is None:
            z = self.calibration_logits(payload, data.images[rows]) if len(rows) else \
                np.zeros((0, self.model_cfg.num_classes))
            self._calib_cache = {k: v for k, v in self._calib_cache.items() if k[1] == key[1]}
            self._calib_cache[key] = z
        bias = round_cfg.get("bias")
        stats = prior.nll_stats(z, data.labels[rows].numpy(), np.asarray(round_cfg["scale"], np.float64),
                                None if bias is None else np.asarray(bias, np.float64), round_cfg["calibrate"])
        return ClientResult(data.client_id, len(rows), {}, {f"calib_{k}": torch.from_numpy(np.asarray(v, np.float64))
                                                            for k, v in stats.items()}, {"calibration": 1.0})

    def posterior_module(self, payload: Tensors) -> nn.Module:
        """The module whose outputs `posterior_logits` turns into the logits calibration works on."""
        keys = set(self.model.state_dict())
        self.model.load_state_dict({k: v for k, v in payload.items() if k in keys})
        return ProbsAndLabel(self.model).eval()

    def calibration_logits(self, payload: Tensors, images_u8: torch.Tensor) -> np.ndarray:
        from tafl.training.evaluate import predict

        out = predict(self.posterior_module(payload), images_u8, self.normalize, self.cfg.eval_batch_size,
                      keys=self.output_keys)
        return self.posterior_logits(out)

    def posterior_logits(self, outputs: dict[str, np.ndarray]) -> np.ndarray:
        """(N, C) logits of the posteriors that calibration and prior estimation use (log-probabilities:
        softmax is unchanged by a per-row constant)."""
        return np.log(np.clip(np.asarray(outputs["probs"], np.float64), 1e-12, None))

    def posterior_description(self) -> str:
        return "the model's softmax"

    def default_source_prior(self, state: GlobalState) -> np.ndarray:
        """The prior the uncalibrated posteriors describe: the training data's class mix."""
        counts = state.extras["global_counts"].numpy().astype(np.float64)
        return counts / counts.sum() if counts.sum() > 0 else np.full(len(counts), 1.0 / len(counts))

    # ---- helpers ----
    def normalize(self, batch_u8: torch.Tensor) -> torch.Tensor:
        """uint8 (B, H, W, C) -> float (B, C, H, W), the same formula as Preprocess.normalize."""
        x = batch_u8.to(self.device).permute(0, 3, 1, 2).to(torch.float32) / 255.0
        return (x - self.mean) / self.std

    def generator(self, round_: int, client_id: int, stream: int = 0) -> torch.Generator:
        seed = int(np.random.SeedSequence([self.cfg.seed, round_, client_id, stream]).generate_state(1)[0])
        return torch.Generator().manual_seed(seed)


class ProbsAndLabel(nn.Module):
    """logits, softmax probabilities and the label: argmax(logits + offset), offset the operating point's
    (tafl.training.decision; None: the plain argmax). The probabilities never carry the offset."""

    def __init__(self, model: nn.Module, offset: np.ndarray | None = None):
        super().__init__()
        self.model = model
        self.offset = None if offset is None else torch.as_tensor(np.asarray(offset), dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.model(x)  # (B, C)
        decide = logits if self.offset is None else logits + self.offset.to(logits.device)
        return {"logits": logits, "probs": torch.softmax(logits, dim=1), "label": decide.argmax(dim=1)}
