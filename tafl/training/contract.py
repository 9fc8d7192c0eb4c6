"""The training contract: what crosses between an FL method and the code that drives it (docs/design.md, "one
algorithm, two transports"). Standard library only, no torch: the command line, config validation and the Flower
wire code read it without the training stack.

A round, driven by the in-process simulator (`tafl.training.rounds`) or by Flower (`tafl.training.flower`) alike:

    stats   = {k: method.client_stats(data_k)}                 # Tensors per client: class counts, c_k, ...
    cfg     = method.round_config(state, stats, round)         # RoundConfig: plain JSON values, broadcast
    payload = method.broadcast(state)                          # Tensors sent to every selected client
    results = [method.client_update(payload, data_k, cfg)]     # one ClientResult per client that answered
    state   = method.server_update(state, results, round)      # GlobalState: aggregation and server work

Round 0 is the census: every client's `client_stats` before training. Everything on the wire is `Tensors` (a
`dict[str, torch.Tensor]`) or JSON (`RoundConfig`), so a transport only serialises. `GlobalState` is what a
checkpoint holds.

`Method` is the contract a method implements: eight steps. What the drivers ask of a method beyond them is optional
and has a default here (a finishing round, report sections, the posteriors calibration works on). Differential
privacy, the head basis, the feature cache, the local recipe and calibration are parts a method composes
(tafl.training.methods: `dp.ClientPrivacy`, `head_basis.HeadBasis` and `FeatureCache`, `recipe.LocalRecipe`,
`calibration.CalibrationClient`; `base.ClassifierMethod` wires them up), not steps it inherits. A method registers
itself where it is defined, with its own settings (tests/training/test_toy_method.py is a whole method in one file):

    @dataclass
    class ToyConfig(MethodConfig):
        toy_step: float = 0.5  # the comment is the flag's --help

    @register_method("toy", config=ToyConfig)
    class Toy(ClassifierMethod):
        opts_type = ToyConfig  # self.opts: this run's ToyConfig
        def client_update(self, payload, data, round_cfg): ...
        def server_update(self, state, results, round_): ...

after which `--method toy --toy-step 0.25` is a valid run configuration (`tafl.training.config.RunConfig`). The
built-in methods declare their module here without importing it (`declare_builtin`), so naming a method loads
neither it nor torch until it runs; their settings live in torch-free `*_config.py` files beside them, so the
command line and config validation read them without the training stack.
"""

from __future__ import annotations

import dataclasses
import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypedDict

from tafl.errors import ConfigError

if TYPE_CHECKING:  # annotations only: this module never imports torch or numpy
    import numpy as np
    import torch

Tensors = dict[str, "torch.Tensor"]  # a named set of tensors: model weights, a payload, a client's extras


# ------------------------------------------------------------------ wire types
@dataclass
class ClientData:
    """One client's local data: indices into image and label tensors (in simulation all clients share them)."""

    client_id: int
    images: torch.Tensor  # uint8 (N_all, H, W, C)
    labels: torch.Tensor  # int64 (N_all,)
    indices: torch.Tensor  # int64 (n,) this client's training rows
    num_classes: int
    holdout: torch.Tensor | None = None  # int64 (h,) rows held out of training for the calibration rounds

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def local_labels(self) -> torch.Tensor:  # int64 (n,)
        return self.labels[self.indices]

    def class_counts(self) -> torch.Tensor:  # int64 (C,)
        return self.local_labels.bincount(minlength=self.num_classes)


@dataclass
class ClientResult:
    """What one client sends back from `client_update` (or the one result standing for a secure sum's clients)."""

    client_id: int
    num_samples: int  # the client's training rows (its weight in FedAvg)
    weights: Tensors  # the updated model state it sends: extractor, head, normalisation buffers (may be empty)
    extras: Tensors = field(default_factory=dict)  # method extras: expert gradients (L, E, C, D), statistics, ...
    metrics: dict[str, float] = field(default_factory=dict)  # loss, steps, dp_steps, dp_releases, ...


@dataclass
class GlobalState:
    """The server's state between rounds; a checkpoint holds `to_dict()`."""

    weights: Tensors  # the global model state
    extras: Tensors = field(default_factory=dict)  # method state: expert heads (E, C, D), GFF banks, global counts (C,)
    meta: dict[str, Any] = field(default_factory=dict)  # JSON-able bookkeeping: round, client counts, calibration

    def to_dict(self) -> dict[str, Any]:
        return {"weights": self.weights, "extras": self.extras, "meta": self.meta}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GlobalState:
        return cls(dict(d["weights"]), dict(d.get("extras", {})), dict(d.get("meta", {})))


class RoundConfig(TypedDict, total=False):
    """The round plan a method broadcasts with its payload: JSON values only (Flower sends it as a string).

    Every round config has `round` and `seed`; the other keys appear in the rounds that use them."""

    round: int  # 1..rounds for training; rounds + 1 the finishing round; rounds + 2 the calibration rounds
    seed: int  # the run's seed: every client draw is a function of (seed, round, client)
    global_counts: list[float]  # (C,) the federation's class counts (GTAFL's GI-GDS)
    features_only: bool  # the finishing round: one feature pass, no local training
    clients_frac: float  # the finishing round: the share of clients asked
    calibrate: str  # a calibration round: the calibration kind (tafl.prior.CALIBRATIONS)
    scale: float | list[float]  # a calibration round: the current temperature (or per-class scales (C,))
    bias: list[float] | None  # a calibration round: the current per-class biases (C,)
    c_f: list[float]  # (C,) DAFL's class imbalance of the round's participants
    c_k_mean: float | None  # DAFL: the mean client imbalance of the round's participants
    class_norm: float | None  # DAFL: the mean of the class weights over the round's samples


def tensor_bytes(tensors: Tensors) -> int:
    """The bytes a set of tensors takes on the wire, before any framing."""
    return int(sum(t.numel() * t.element_size() for t in tensors.values()))


# ------------------------------------------------------------------ the method contract
class Method(ABC):
    """The steps an FL method must define; the drivers call nothing else of a method without a default below.

    Attributes the drivers read: `name` (the registered name), `trains` (False: the sites send statistics, never a
    loss), `output_keys` (what the inference module returns, collected by evaluation), `cfg` (the run's
    `RunConfig`), `model_cfg`, `device`, `normalize` (uint8 (B, H, W, C) -> float (B, C, H, W)), `dp` (whether
    the run is record-level private) and, under DP, `privacy.plan(n)` (a client's plan, for the accountant):
    `tafl.training.methods.base.ClassifierMethod` provides them.
    """

    name: ClassVar[str] = ""
    trains: ClassVar[bool] = True
    output_keys: tuple[str, ...] = ("probs", "label")

    @abstractmethod
    def init_state(self, train_counts: np.ndarray) -> GlobalState:
        """The global state before round 1. train_counts: (C,) the training set's class counts (its length is C)."""

    @abstractmethod
    def client_stats(self, data: ClientData) -> Tensors:
        """A client's small statistics for the census and each round's plan: at least "class_counts" (C,) float."""

    @abstractmethod
    def round_config(self, state: GlobalState, stats: dict[int, Tensors], round_: int) -> RoundConfig:
        """The round's plan from the participants' statistics (round 0: the census of every client); may record
        the statistics in `state.meta`."""

    @abstractmethod
    def broadcast(self, state: GlobalState) -> Tensors:
        """The tensors every selected client receives (the drivers add the head basis with `train_scope: head`)."""

    @abstractmethod
    def client_update(self, payload: Tensors, data: ClientData, round_cfg: RoundConfig) -> ClientResult:
        """The local work of one client: training, or, when `round_cfg` asks for it, a features-only or a
        calibration round."""

    @abstractmethod
    def server_update(self, state: GlobalState, results: list[ClientResult], round_: int) -> GlobalState:
        """Aggregation and the server's own work; a result that cannot be used is dropped with a logged reason."""

    @abstractmethod
    def inference_model(self, state: GlobalState) -> torch.nn.Module:
        """A module mapping a normalised batch (B, C, H, W) to at least {"probs": (B, C), "label": (B,)}."""

    @abstractmethod
    def default_source_prior(self, state: GlobalState) -> np.ndarray:
        """(C,) the class prior the uncalibrated posteriors describe (calibration, the operating point and the
        case-mix estimator adapt from it)."""

    # ---- optional, with defaults ----
    def attach_server_pool(self, images_u8: torch.Tensor | None) -> None:
        """The server's unlabeled images (N, H, W, C) uint8, or None: before the census, every run."""
        self.pool = images_u8

    def head_basis(self, state: GlobalState) -> Tensors:
        """What a training round's payload adds to `broadcast` (the head basis with `train_scope: head`)."""
        return {}

    def choose_operating_point(self, state: GlobalState, images: np.ndarray, labels: np.ndarray,
                               batch_size: int) -> GlobalState:
        """`decision: validation`: the operating point chosen on the validation split, recorded in the meta."""
        raise ConfigError(f"method '{self.name}' has no operating point to choose: use decision argmax")

    def finish_config(self, state: GlobalState) -> RoundConfig | None:
        """The round config of a features-only finishing round after the last round, or None (no such round)."""
        return None

    def server_finish(self, state: GlobalState, results: list[ClientResult], round_: int) -> GlobalState:
        """The server's step after the finishing round (only called when `finish_config` asked for one)."""
        raise NotImplementedError(f"method {self.name!r} asked for a finishing round but has no server_finish")

    def extra_report(self, state: GlobalState, outputs: dict[str, np.ndarray], test: Any,
                     ranks: np.ndarray) -> dict[str, Any]:
        """Method-specific report sections (each expert's accuracies, ...); none by default."""
        return {}

    def posterior_logits(self, outputs: dict[str, np.ndarray]) -> np.ndarray:
        """(N, C) logits of the posteriors calibration and prior estimation use: the log of outputs["probs"]
        (softmax is unchanged by a per-row constant)."""
        import numpy as np

        return np.log(np.clip(np.asarray(outputs["probs"], np.float64), 1e-12, None))

    def posterior_description(self) -> str:
        return "the model's softmax"


# ------------------------------------------------------------------ a method's own settings
@dataclass
class MethodConfig:
    """A method's own settings: a dataclass whose fields are flat keys of the run configuration (YAML, flags,
    run.json) beside the shared ones of `RunConfig`. Each field's comment is its `--help` text; `CHOICES` names the
    allowed values of its string fields. The hooks validate the settings and say what the method needs of the shared
    ones; each raises `self.bad(...)` or `run.bad(...)` (a ConfigError naming the key and its value)."""

    CHOICES: ClassVar[Mapping[str, tuple[str, ...]]] = {}

    def bad(self, key: str, why: str) -> ConfigError:
        return ConfigError(f"config '{key}' = {getattr(self, key)!r}: {why}")

    def check(self, run: Any) -> None:
        """This config's values in range; called for every run, whichever method it trains (a bad value in a file
        is an error even where it is unused)."""

    def check_unused(self, run: Any) -> None:
        """Called when another method runs: a setting that would be silently ignored is refused here."""

    def check_run(self, run: Any) -> None:
        """What this method needs of the shared settings (train scope, secure aggregation); only when it runs."""

    def check_private(self, run: Any) -> None:
        """What this method needs under record-level differential privacy; only when it runs with dp_epsilon."""

    def default_train_scope(self, private: bool) -> str:
        """`train_scope` when the config leaves it unset: the head alone under DP (docs/decisions.md, "DP trains
        the head"), else the whole network."""
        return "head" if private else "all"

    def uses_server_pool(self, run: Any) -> bool:
        """Whether the method itself needs the server's unlabeled images (besides pre-training and the head basis)."""
        return False

    def divergence_hint(self, run: Any) -> str:
        """What to add to the advice when a run of this method diverges."""
        return ""


def config_fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


# ------------------------------------------------------------------ the registry
_METHODS: dict[str, type[Method]] = {}  # name -> class, filled by @register_method when its module is imported
_CONFIGS: dict[str, type[MethodConfig]] = {}  # name -> its settings' class (MethodConfig: none of its own)
_BUILTIN: dict[str, str] = {}  # name -> the module defining it, imported on first use (declare_builtin)
_OWNER: dict[str, type[MethodConfig]] = {}  # setting (flat key) -> the settings' class that holds it


def declare_builtin(name: str, module: str) -> None:
    """A method whose module registers it when imported, named before that import (torch loads only to run it)."""
    _BUILTIN[name] = module
    _CONFIGS.setdefault(name, MethodConfig)


def register_config(*names: str) -> Callable[[type[MethodConfig]], type[MethodConfig]]:
    """Class decorator: the settings of the methods `names` (one class may serve several: gtafl and creff)."""

    def add(cls: type[MethodConfig]) -> type[MethodConfig]:
        if not (isinstance(cls, type) and issubclass(cls, MethodConfig) and dataclasses.is_dataclass(cls)):
            raise TypeError(f"{cls!r} is not a MethodConfig dataclass")
        taken = {k: c for c in set(_CONFIGS.values()) if c is not cls for k in config_fields(c)}
        clash = sorted(set(config_fields(cls)) & set(taken))
        if clash:
            raise ValueError(f"{cls.__name__}: setting(s) {', '.join(clash)} already belong to "
                             f"{taken[clash[0]].__name__}")
        for name in names:
            _CONFIGS[name] = cls
        _OWNER.update({k: cls for k in config_fields(cls)})
        return cls

    return add


def register_method(name: str, *, config: type[MethodConfig] | None = None) -> Callable[[type[Method]], type[Method]]:
    """Class decorator: `name` runs this Method; `config` is its settings' class (a built-in's is registered by
    its `*_config.py` already)."""

    def add(cls: type[Method]) -> type[Method]:
        if not (isinstance(cls, type) and issubclass(cls, Method)):
            raise TypeError(f"{cls!r} is not a Method")
        if config is not None:
            register_config(name)(config)
        _CONFIGS.setdefault(name, MethodConfig)
        _METHODS[name] = cls
        return cls

    return add


def unregister_method(name: str) -> None:
    """Forget a method registered at run time (a test's toy); the built-ins stay declared."""
    _METHODS.pop(name, None)
    if name not in _BUILTIN:
        cls = _CONFIGS.pop(name, None)
        if cls is not None and cls not in _CONFIGS.values():
            for k in config_fields(cls):
                _OWNER.pop(k, None)


def method_names() -> tuple[str, ...]:
    """Every registered method: the built-ins in their declared order, then the ones registered at run time."""
    return tuple(dict.fromkeys([*_BUILTIN, *_METHODS]))


def method_class(name: str) -> type[Method]:
    """The Method registered under `name`, importing a built-in's module on first use."""
    if name not in _METHODS and name in _BUILTIN:
        importlib.import_module(_BUILTIN[name])
    try:
        return _METHODS[name]
    except KeyError:
        raise ConfigError(f"method '{name}' is not available; choose one of {', '.join(method_names())}") from None


def config_class(name: str) -> type[MethodConfig]:
    """The settings' class of method `name` (MethodConfig for a method without settings of its own)."""
    try:
        return _CONFIGS[name]
    except KeyError:
        raise ConfigError(f"method '{name}' is not available; choose one of {', '.join(method_names())}") from None


def setting_owner(key: str) -> type[MethodConfig] | None:
    """The settings' class that holds the flat key `key`, or None (a shared key, or no key at all)."""
    return _OWNER.get(key)


def config_classes() -> dict[type[MethodConfig], tuple[str, ...]]:
    """Each distinct settings' class (with fields) and the methods it serves, in the order of the methods."""
    out: dict[type[MethodConfig], list[str]] = {}
    for name in method_names():  # the methods' order: --help lists the groups as it lists the methods
        cls = _CONFIGS.get(name, MethodConfig)
        if config_fields(cls):
            out.setdefault(cls, []).append(name)
    return {cls: tuple(names) for cls, names in out.items()}


__all__ = ["ClientData", "ClientResult", "GlobalState", "Method", "MethodConfig", "RoundConfig", "Tensors",
           "config_class", "config_classes", "config_fields", "declare_builtin", "method_class", "method_names",
           "register_config", "register_method", "setting_owner", "tensor_bytes", "unregister_method"]
