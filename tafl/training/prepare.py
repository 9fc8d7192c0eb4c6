"""Everything a run sets up before its first round: the data (the long-tailed training set, the client partition,
the held-out calibration rows), the model config, the method, and the server's unlabeled pool. The in-process
simulator and the Flower engine (server and ClientApp) prepare a run the same way through these functions."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tafl.errors import CheckpointError, ConfigError, DataError
from tafl.training.config import RunConfig
from tafl.training.contract import Method, method_class
from tafl.training.data import Dataset, Split, index_hash, load_dataset
from tafl.training.longtail import class_ranks, client_class_counts, dirichlet_partition, holdout_split, make_longtail
from tafl.training.models import ModelConfig

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    """Everything a run derives from its data and config, before any training."""

    dataset: Dataset
    train: Split  # the long-tailed training set
    parts: list[np.ndarray]  # client -> row indices into `train` it trains on
    holdouts: list[np.ndarray]  # client -> rows it holds out of training for the calibration round
    ranks: np.ndarray  # training-frequency rank per class
    train_counts: np.ndarray  # (C,)
    client_counts: np.ndarray  # (K, C)
    model_cfg: ModelConfig
    index_sha256: str


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' asked for, but no CUDA device is visible; use --device cpu or auto")
    return torch.device(name)


def prepare(cfg: RunConfig) -> Prepared:
    ds = load_dataset(cfg)
    keep = make_longtail(ds.train.labels, ds.num_classes, cfg.imbalance_factor, cfg.seed)
    train = ds.train.subset(keep)
    counts = np.bincount(train.labels, minlength=ds.num_classes)
    ranks = class_ranks(train.labels, ds.num_classes)
    if ds.site_names is not None:
        parts = site_parts(train, ds.site_names)
        cfg.clients = len(parts)  # one client per site; the checkpoint's config records it
    else:
        parts = dirichlet_partition(train.labels, cfg.clients, cfg.alpha, cfg.seed, equal=cfg.partition == "equal",
                                    num_classes=ds.num_classes)
    if cfg.centralised:  # the pooled ceiling: one client holds every training row
        parts = [np.sort(np.concatenate(parts))]
        cfg.clients, cfg.frac = 1, 1.0
    parts, holdouts = holdout_split(parts, cfg.calib_holdout, cfg.seed, train.labels, cfg.calib_holdout_mode)
    cc = client_class_counts(train.labels, parts, ds.num_classes)
    model_cfg = ModelConfig(backbone=cfg.backbone, num_classes=ds.num_classes, in_chans=ds.preprocess.channels,
                            img_size=ds.preprocess.size, width=cfg.width, patch_size=cfg.patch_size,
                            embed_dim=cfg.embed_dim, depth=cfg.depth, num_heads=cfg.num_heads,
                            tokenizer=cfg.tokenizer,
                            # a fixed extractor (train_scope head) keeps no batch statistics to trust, DP-SGD none at all
                            norm="group" if cfg.dp_epsilon or cfg.train_scope == "head" else "batch")
    return Prepared(ds, train, parts, holdouts, ranks, counts, cc, model_cfg, index_hash(cfg.dataset, train.ids, train.labels))


def site_parts(train: Split, site_names: list[str]) -> list[np.ndarray]:
    """Client k trains on the training rows of site k (--client-column): the real split, no Dirichlet draw. A site
    may lack a class (vidir_molemax has no akiec); a site with no training rows at all is an error."""
    parts = [np.flatnonzero(train.sites == k) for k in range(len(site_names))]
    empty = [site_names[k] for k, p in enumerate(parts) if len(p) == 0]
    if empty:
        raise DataError(f"site(s) {', '.join(empty)} have no training rows; a client needs data to train on "
                        "(drop those rows, or mark some as train)")
    return parts


def check_privacy_data(cfg: RunConfig, prep: Prepared) -> None:
    """δ must be below 1/n for every site's n records (a larger δ allows releasing a record outright)."""
    if cfg.dp_epsilon is None:
        return
    n_min = min(len(p) for p in prep.parts)
    if cfg.dp_delta >= 1.0 / n_min:
        raise ConfigError(f"config 'dp_delta' = {cfg.dp_delta!r}: must be below 1/n = {1.0 / n_min:.2g} for the "
                          f"smallest site's n = {n_min} training images (e.g. --dp-delta 1e-5)")


def make_method(cfg: RunConfig, model_cfg: ModelConfig, preprocess, device: torch.device | str = "cpu") -> Method:
    return method_class(cfg.method)(cfg, model_cfg, preprocess, device)


def check_compatible(ck: dict[str, Any], prep: Prepared) -> None:
    """A checkpoint to continue from must describe the same model over the same classes."""
    if list(ck["class_names"]) != list(prep.dataset.class_names):
        raise CheckpointError(f"cannot continue: the checkpoint's classes {ck['class_names']} differ from the new "
                              f"data's {prep.dataset.class_names}")
    if ModelConfig.from_dict(ck["model_config"]) != prep.model_cfg:
        raise CheckpointError(f"cannot continue: the checkpoint's model {ck['model_config']} differs from the "
                              f"config's {prep.model_cfg.to_dict()} (keep backbone, width, img_size and channels)")


def server_pool(cfg: RunConfig, ds: Dataset) -> torch.Tensor | None:
    """The server's unlabeled images for SimCLR (GTAFL's, and the extractor's pre-training): a split's images,
    never its labels."""
    if not cfg.settings().uses_server_pool(cfg) and not cfg.pretrain_steps and cfg.train_scope != "head":
        return None
    split = {"val": ds.val, "test": ds.test, "train": ds.train}[cfg.simclr_pool]
    if cfg.simclr_pool == "test":
        log.warning("SimCLR pool = the unlabeled TEST images (transductive, as the paper); reports are labelled so")
    return torch.from_numpy(split.images)
