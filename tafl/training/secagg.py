"""Secure sums over clients with Flower's own SecAgg+ (docs/secagg-notes.md; users: docs/flower.md).

The server learns only the sum over the clients that answered, never one client's arrays: each
client quantises its arrays, adds pairwise and private masks (`flwr.client.mod.secaggplus_mod`),
and the server removes the masks from the sum (`flwr.server.workflow.SecAggPlusWorkflow`). No
cryptography is written here; this module only drives Flower's workflow from a custom round loop
and fixes the layout both sides agree on.

A secure sum is one SecAgg+ run (four message round trips, all of type "train"):

    server                                       client (ClientApp train handler, mods=[route_secagg])
    secure_sum(grid, nodes, content_fn, layout)  -> setup / share-keys: answered by secaggplus_mod
                                                 -> collect: the handler runs with content_fn(node) + the
                                                    layout, and answers secure_reply(msg, arrays, metrics)
                                                 -> unmask: answered by secaggplus_mod
    <- SecureSum.sums: {key: Σ_k arrays_k[key]}

Layout: `{key: (shape, bound)}`. Every client sends exactly these keys with these shapes; a client
divides each array by its bound, Flower clips to [-1, 1] (clipping_range 1.0) and quantises with
`quantization_range` levels, and the server multiplies the sum back. With N clients in the sum, an
entry of key k is off by at most N * 2 * bound_k / quantization_range (stochastic rounding: unbiased,
typically sqrt(N) times smaller); an entry beyond its bound is clipped, which the client reports
(`secure_sum.clipped`, plaintext).

Flower's weighting is switched off (every client reports num_examples 1, max_weight 1): the
workflow's weighted average is then the plain mean, times the number of clients in it. Weighted
means are sums of n_k * x_k divided by the sum of n_k, both summed securely.

The second half fixes what tafl sums (`round_layout`, `census_layout`), turns a client's ClientResult into that layout
(`client_arrays`) and the sums back into one ClientResult for the method's unchanged server_update (`combine`);
`tafl.training.flower.FlowerTransport` drives it when the run has `secure_aggregation`.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

log = logging.getLogger(__name__)

LAYOUT_RECORD = "secure_sum"  # ConfigRecord sent with the collect-stage message: {"layout": JSON}
SECAGG_CONFIGS = "secaggplus_configs"  # flwr.common.secure_aggregation.secaggplus_constants.RECORD_KEY_CONFIGS
Layout = Mapping[str, tuple[Sequence[int], float]]


@dataclass
class SecAggParams:
    """SecAgg+ settings (flwr.server.workflow.SecAggPlusWorkflow).

    num_shares: neighbours each client shares its secrets with, itself included; a float is a fraction of
    the clients (1.0: everyone). reconstruction_threshold: shares needed to rebuild a secret; a float is a
    fraction of num_shares (Flower raises it to at least 2). Every client must keep at least that many
    live neighbours through every stage, or the sum is abandoned. quantization_range: levels per client
    entry; modulus_range (a power of 2) must exceed num_clients * quantization_range.
    """

    num_shares: int | float = 1.0
    reconstruction_threshold: int | float = 0.67
    quantization_range: int = 2**22
    modulus_range: int = 2**32
    timeout: float | None = None

    def step(self, bound: float) -> float:
        """One quantisation level of an entry whose bound is `bound`."""
        return 2.0 * bound / self.quantization_range

    def error_bound(self, bound: float, num_clients: int) -> float:
        """Largest error of one summed entry: every client's stochastic rounding moves it by under one level."""
        return num_clients * self.step(bound)

    def max_clients(self) -> int:
        """Most clients whose quantised sum stays below the modulus (beyond it the sum wraps around)."""
        return self.modulus_range // self.quantization_range - 1


class SecureSumError(RuntimeError):
    """The SecAgg+ run was abandoned (too few clients or neighbours left at some stage)."""


# ------------------------------------------------------------------ layout
def layout_to_json(layout: Layout) -> str:
    return json.dumps({k: [list(map(int, s)), float(b)] for k, (s, b) in sorted(layout.items())})


def layout_from_json(text: str) -> dict[str, tuple[tuple[int, ...], float]]:
    return {k: (tuple(int(d) for d in s), float(b)) for k, (s, b) in json.loads(text).items()}


def pack(arrays: Mapping[str, Any], layout: Layout) -> tuple[list[np.ndarray], int]:
    """Arrays in the layout's key order, each divided by its bound; and how many entries exceed their bound.

    Raises ValueError for missing or extra keys, a wrong shape, or a non-finite entry: such a client must
    not take part (it answers with an error and the sum goes on without it)."""
    keys = sorted(layout)
    if set(arrays) != set(keys):
        raise ValueError(f"secure sum: keys {sorted(arrays)} differ from the layout's {keys}")
    out, clipped = [], 0
    for k in keys:
        shape, bound = layout[k]
        a = np.asarray(arrays[k].detach().cpu().numpy() if hasattr(arrays[k], "detach") else arrays[k],
                       dtype=np.float64)
        if a.shape != tuple(shape):
            raise ValueError(f"secure sum: '{k}' has shape {a.shape}, the layout says {tuple(shape)}")
        if not np.isfinite(a).all():
            raise ValueError(f"secure sum: '{k}' has NaN or Inf entries")
        scaled = a / bound
        clipped += int((np.abs(scaled) > 1.0).sum())
        out.append(np.ascontiguousarray(scaled))
    return out, clipped


def unpack(arrays: Sequence[np.ndarray], layout: Layout, num_clients: int) -> dict[str, np.ndarray]:
    """The workflow's output (the mean of the scaled arrays) as sums in the layout's units."""
    keys = sorted(layout)
    if len(arrays) != len(keys):
        raise SecureSumError(f"secure sum: {len(arrays)} arrays came back for {len(keys)} layout keys")
    out = {}
    for k, a in zip(keys, arrays):
        shape, bound = layout[k]
        a = np.asarray(a, dtype=np.float64)
        if a.shape != tuple(shape):
            raise SecureSumError(f"secure sum: '{k}' came back with shape {a.shape}, not {tuple(shape)}")
        out[k] = a * (num_clients * bound)
    return out


# ------------------------------------------------------------------ client side
MIN_CLIENTS_KEY = "secagg-min-clients"  # node config: the fewest clients this node sums with (default 3)


def route_secagg(msg, ctxt, call_next):
    """A ClientApp mod: SecAgg+ messages (those with Flower's SecAgg+ config record) go through
    `secaggplus_mod`; every other train message passes as it is. secaggplus_mod alone would reject
    tafl's plain train messages, and the workflow sends plain "train" (no action) messages, so both
    kinds reach the same train handler.

    The node refuses a secure sum over fewer clients than its node config's `secagg-min-clients`
    (default 3): the server picks the participants, and a sum over two, one of them the server's own,
    is the other's arrays. (Flower's mod takes any number the server announces.) It also refuses an
    unmask request that names a node both live and dropped: answering it would hand the server both of
    that node's secrets, its private mask seed and its pairwise key, and with them its own arrays.
    (Flower's mod answers it; its protocol has no round in which clients confirm the dropped set.)"""
    from flwr.client.mod import secaggplus_mod

    configs = msg.content.config_records.get(SECAGG_CONFIGS)
    if configs is None:
        return call_next(msg, ctxt)
    if configs.get("stage") == "setup":
        least = int(ctxt.node_config.get(MIN_CLIENTS_KEY, 3))
        if int(configs.get("sample_num", 0)) < least:
            raise SecureSumError(f"this node sums with at least {least} clients; the server asked "
                                 f"{configs.get('sample_num')}")
    if configs.get("stage") == "unmask":
        both = set(configs.get("active_nids", [])) & set(configs.get("dead_nids", []))
        if both:
            raise SecureSumError(f"the server names node(s) {sorted(both)} both live and dropped")
    return secaggplus_mod(msg, ctxt, call_next)


def is_secure(msg) -> bool:
    """Whether a train message asks for a secure_reply (the collect stage of a secure sum)."""
    return LAYOUT_RECORD in msg.content.config_records


def secure_reply(msg, arrays: Mapping[str, Any], metrics: Mapping[str, float | int | str] | None = None):
    """The handler's answer to a secure-sum message: `arrays` in the layout the message names, in the
    FitRes record layout secaggplus_mod masks. `metrics` travel in plaintext (per client, visible to the
    server): keep them to what may be seen. Every ArrayRecord of this reply is emptied by the mod."""
    from flwr.app import Message
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
    from flwr.compat.common.recorddict_compat import fitres_to_recorddict

    layout = layout_from_json(str(msg.content.config_records[LAYOUT_RECORD]["layout"]))
    packed, clipped = pack(arrays, layout)
    if clipped:
        log.warning("secure sum: %d entries exceed their bounds and are clipped", clipped)
    fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(packed), 1,
                    {**dict(metrics or {}), "secure_sum.clipped": clipped})
    return Message(fitres_to_recorddict(fitres, keep_input=False), reply_to=msg)


# ------------------------------------------------------------------ server side
@dataclass
class SecureSum:
    sums: dict[str, np.ndarray]  # key -> Σ over the clients in the sum, in float64
    node_ids: list[int]  # the nodes whose arrays are in the sum
    metrics: dict[int, dict[str, Any]]  # node -> its plaintext metrics
    errors: dict[str, float]  # key -> the largest error of one entry (N * 2 * bound / quantization_range)
    failures: list[str] = field(default_factory=list)  # error replies and lost nodes, as Flower reported them
    seconds: float = 0.0

    @property
    def num_clients(self) -> int:
        return len(self.node_ids)

    @property
    def clipped(self) -> int:
        return int(sum(int(m.get("secure_sum.clipped", 0)) for m in self.metrics.values()))


def _capture_strategy(grid, node_ids: list[int]):
    """A Strategy that only names the round's nodes (configure_fit) and keeps what aggregate_fit is given:
    SecAggPlusWorkflow talks to the round through a Strategy and nothing else."""
    from flwr.common import FitIns, Parameters
    from flwr.server.compat.grid_client_proxy import GridClientProxy
    from flwr.server.strategy import Strategy

    class Capture(Strategy):
        results: list = []
        failures: list = []

        def initialize_parameters(self, client_manager):
            return None

        def configure_fit(self, server_round, parameters, client_manager):
            empty = FitIns(Parameters(tensors=[], tensor_type=""), {})
            return [(GridClientProxy(n, grid, 0), empty) for n in node_ids]

        def aggregate_fit(self, server_round, results, failures):
            self.results, self.failures = list(results), list(failures)
            return None, {}

        def configure_evaluate(self, server_round, parameters, client_manager):
            return []

        def aggregate_evaluate(self, server_round, results, failures):
            return None, {}

        def evaluate(self, server_round, parameters):
            return None

    return Capture()


def secure_sum(grid, node_ids: Sequence[int], content_fn: Callable[[int], Any], layout: Layout, *,
               params: SecAggParams | None = None, round_: int = 0) -> SecureSum:
    """Σ over `node_ids` of the arrays their handlers give `secure_reply`, through Flower's SecAgg+.

    content_fn(node) is the RecordDict of the node's collect-stage train message (the round's payload and
    config, as a plain train message would carry them); the layout record is added to it. Nodes that fail
    at any stage are left out of the sum (Flower recovers their masks) as long as every node keeps
    reconstruction_threshold live neighbours; otherwise SecureSumError."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
    from flwr.common import parameters_to_ndarrays
    from flwr.server.compat.legacy_context import LegacyContext
    from flwr.server.workflow import SecAggPlusWorkflow
    from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key
    from flwr.server.workflow.secure_aggregation.secaggplus_workflow import WorkflowState

    p = params or SecAggParams()
    nodes = list(dict.fromkeys(int(n) for n in node_ids))
    if len(nodes) < 2:
        raise SecureSumError(f"a secure sum needs at least 2 clients, got {len(nodes)}")
    if len(nodes) > p.max_clients():
        raise SecureSumError(f"{len(nodes)} clients overflow modulus_range {p.modulus_range} at quantization_range "
                             f"{p.quantization_range} (at most {p.max_clients()})")
    for k, (_, bound) in layout.items():
        if not (bound > 0 and math.isfinite(bound)):
            raise ValueError(f"secure sum: '{k}' needs a positive finite bound, got {bound}")
    workflow = SecAggPlusWorkflow(p.num_shares, p.reconstruction_threshold, max_weight=1.0, clipping_range=1.0,
                                  quantization_range=p.quantization_range, modulus_range=p.modulus_range,
                                  timeout=p.timeout)
    strategy = _capture_strategy(grid, nodes)
    state = RecordDict({MAIN_CONFIGS_RECORD: ConfigRecord({Key.CURRENT_ROUND: int(round_)}),
                        MAIN_PARAMS_RECORD: ArrayRecord()})
    ctx = LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=state, run_config={}), strategy=strategy)
    layout_rec = ConfigRecord({"layout": layout_to_json(layout)})
    ws = WorkflowState()
    t0 = time.perf_counter()
    # SecAggPlusWorkflow.__call__ runs these four stages; run here one by one so the collect stage carries
    # our own content in place of the legacy FitIns records the strategy stub gave
    if not workflow.setup_stage(grid, ctx, ws):
        raise SecureSumError(f"secure sum (round {round_}): setup failed ({_failures(ws)})")
    ws.nid_to_fitins = {n: _with_layout(content_fn(n), layout_rec) for n in ws.nid_to_fitins}
    for name, stage in (("share-keys", workflow.share_keys_stage),
                        ("collect", workflow.collect_masked_vectors_stage), ("unmask", workflow.unmask_stage)):
        if not stage(grid, ctx, ws):
            raise SecureSumError(f"secure sum (round {round_}): the {name} stage failed: too few live "
                                 f"neighbours for reconstruction threshold {ws.threshold} ({_failures(ws)})")
    results = strategy.results
    if not results:
        raise SecureSumError(f"secure sum (round {round_}): no client's masked arrays arrived ({_failures(ws)})")
    n = len(results)
    sums = unpack(parameters_to_ndarrays(results[0][1].parameters), layout, n)
    return SecureSum(sums=sums, node_ids=[int(proxy.node_id) for proxy, _ in results],
                     metrics={int(proxy.node_id): dict(res.metrics) for proxy, res in results},
                     errors={k: p.error_bound(b, n) for k, (_, b) in layout.items()},
                     failures=list(dict.fromkeys(str(f) for f in ws.failures)),  # Flower lists some twice
                     seconds=time.perf_counter() - t0)


def _with_layout(content, layout_rec):
    from flwr.app import RecordDict

    out = RecordDict(dict(content.items()))  # a node's own dict: the workflow adds its SecAgg+ record to it
    out[LAYOUT_RECORD] = layout_rec
    return out


def _failures(ws) -> str:
    return "; ".join(str(f)[:200] for f in ws.failures) or "no error replies"


# ------------------------------------------------------------------ what tafl sums (FlowerTransport's layout)
# The round's layout, built by the server from public values only (the model's keys and shapes, the run config,
# the largest site's record count from the census), so no bound says anything about one site's data:
#
#   num_samples              (1,)          n_k                                  bound n_max
#   w:<key>                  the tensor's  n_k·(θ_k − θ_global), every floating   bound n_max·δ (δ: weight_delta for
#                                          tensor of the model (BatchNorm's     parameters, buffer_delta for floating
#                                          running statistics included)         buffers)
#   m:<metric>               (2,)          [value, 1] (or [0, 0] when absent)   bound SUMMED_METRICS' bound
#   grad_w                   (C, E, C, D)  the client's mean CE gradient per    bound feature (F)
#                                          local class, scattered at its class
#   grad_b                   (C, E, C)     the same for the biases              bound 1 (|p − y| ≤ 1)
#   grad_holders             (C,)          1 at the client's gradient classes   bound 1
#   stat_sum, stat_sumsq     (C, D)        per-class feature sums (≤ grad_samples rows a class)  G·F, G·F²
#   stat_count               (C,)          per-class row counts                 bound G (grad_samples)
#   class_counts             (C,)          the census: the client's class counts  bound n_max
#   lda_sum, lda_count       (C, k), (C,)  method lda: per-class sums of the       n_max·B, n_max + slack (lda_layout)
#                                          whitened features, class counts
#   calib_nll, calib_grad,   (1,), (P,),   a calibration round's sums over the   n_max·(2(a·Z+b) + log C), n_max·Z,
#   calib_hess               (P, P)        client's held-out rows (tafl.prior)   n_max·C·Z²/2 (calibration_layout)
#   calib_counts, calib_n    (C,), (1,)    their class counts and number        bound n_max
#
# Integer tensors (BatchNorm's num_batches_tracked) are not summed: plaintext aggregation takes their maximum,
# and each client reports how far its own advanced (`int_advance`: its number of local batches, a function of
# its public record count and the run config); the server sets them to the payload's value plus the largest.
WEIGHT_PREFIX, METRIC_PREFIX = "w:", "m:"
GRAD_KEYS = ("grad_w", "grad_b", "grad_holders")
STAT_KEYS = ("stat_sum", "stat_sumsq", "stat_count")
LDA_KEYS = ("lda_sum", "lda_count")  # method lda: a site's class sums of whitened features and its class counts
CLIENT_EXTRAS = ("grad_classes", "grad_w", "grad_b", "stat_sum", "stat_sumsq", "stat_count") + LDA_KEYS
# metrics the round loop reads (its history's loss and non-finite share, check_results' step count) travel only
# summed; how the combined result reports them: "mean" over the clients that reported one (the history averages the
# clients' losses), or "sum". Every other metric a method reports (GI-GDS's α, ...) is withheld: nothing reads it
SUMMED_METRICS = {"loss": "mean", "steps": "sum", "nonfinite_steps": "sum"}
# metrics that may travel in plaintext, per client: bookkeeping that says nothing about a site's data beyond its
# public record count (the DP accountant's step and release counts, the finishing round's flag)
PLAINTEXT_METRICS = ("dp_steps", "dp_releases", "features_only")
SUM_ID = -1  # the census's one "client": the sum over every site


@dataclass
class SecureBounds:
    """The largest |entry| a client may send, per kind of quantity (docs/flower.md, "Secure aggregation").

    Measured on the smoke config (GTAFL, 4 clients, 5 rounds, lr 0.05, momentum 0.9, 3 local epochs): parameter
    deltas |θ_k − θ_g| ≤ 0.42, BatchNorm running-statistic deltas ≤ 4.1, class-mean features ≤ 5.0, mean expert
    gradients ≤ 3.9 (biases ≤ 0.95), local losses ≤ 2.2. The defaults leave 20x or more headroom; an entry beyond its
    bound is clipped (biased) and counted (`SecureSum.clipped`, logged per round)."""

    weight_delta: float = 10.0  # |θ_k − θ_global| of a parameter after one round's local training
    buffer_delta: float = 100.0  # the same for a floating buffer (BatchNorm running mean and variance)
    feature: float = 100.0  # a class's mean feature value (GTAFL/CReFF statistics and expert gradients)
    loss: float = 1e4  # a client's mean local loss
    logit: float = 100.0  # |z| of a held-out image's logit (or log-probability) that the calibration works on


def round_layout(weights: Mapping[str, tuple[Sequence[int], bool]], n_max: int, bounds: SecureBounds, *,
                 local_epochs: int = 1, grads: tuple[int, int, int] | None = None, stats: bool = False,
                 grad_samples: int = 1, features_only: bool = False) -> dict[str, tuple[tuple[int, ...], float]]:
    """A training round's layout. weights: every floating model tensor, key -> (shape, is_buffer); n_max: the largest
    record count among the round's clients (public: the census); grads: (C, E, D) when the method sends expert
    gradients; stats: whether it sends class statistics; features_only: GTAFL's finishing round (no weights)."""
    n_max = max(1, int(n_max))
    out: dict[str, tuple[tuple[int, ...], float]] = {"num_samples": ((1,), float(n_max))}
    if not features_only:
        for k, (shape, buffer) in weights.items():
            out[WEIGHT_PREFIX + k] = (tuple(int(d) for d in shape),
                                      n_max * (bounds.buffer_delta if buffer else bounds.weight_delta))
        most_steps = float(n_max * max(1, int(local_epochs)) + 1)  # at most one step per record and epoch
        for name, bound in (("loss", bounds.loss), ("steps", most_steps), ("nonfinite_steps", most_steps)):
            out[METRIC_PREFIX + name] = ((2,), bound)
    if grads is not None:
        C, E, D = (int(v) for v in grads)
        out.update(grad_w=((C, E, C, D), bounds.feature), grad_b=((C, E, C), 1.0), grad_holders=((C,), 1.0))
        if stats:
            G = float(max(1, int(grad_samples)))
            out.update(stat_sum=((C, D), G * bounds.feature), stat_sumsq=((C, D), G * bounds.feature ** 2),
                       stat_count=((C,), G))
    return out


CALIB_KEYS = ("calib_nll", "calib_grad", "calib_hess", "calib_counts", "calib_n")
DOMAIN_KEYS = ("dom_sum", "dom_outer", "dom_counts")  # the in-domain detector's round (tafl.training.detector)


def calibration_layout(kind: str, num_classes: int, n_max: int, bounds: SecureBounds, scale: Any = 1.0,
                       bias: Sequence[float] | None = None) -> dict[str, tuple[tuple[int, ...], float]]:
    """A calibration round's layout (tafl.prior.nll_stats' sums over a client's held-out rows, at most n_max of
    them), from public values: the calibration's kind, the classes, the largest site's record count, the logit
    bound Z and the round's own (scale, bias), which the server chose. Per image, with u = a·z + b:
    NLL ≤ 2·max|u| + log C, a gradient entry ≤ max(Z, 1) (|p − y| ≤ 1 times a column of ∂u/∂θ: z or 1), a Hessian
    entry ≤ C·max(Z, 1)² / 2 (the covariance diag(p) − ppᵀ has eigenvalues ≤ 1/2)."""
    from tafl.prior import n_params

    C, n_max = int(num_classes), float(max(1, int(n_max)))
    P = n_params(kind, C)
    a = float(np.max(np.abs(np.asarray(scale, np.float64))))
    b = 0.0 if bias is None else float(np.max(np.abs(np.asarray(bias, np.float64)), initial=0.0))
    Z = max(float(bounds.logit), 1.0)
    nll = 2.0 * (a * Z + b) + math.log(C)
    return {"calib_nll": ((1,), n_max * nll), "calib_grad": ((P,), n_max * Z),
            "calib_hess": ((P, P), n_max * C * Z * Z / 2.0), "calib_counts": ((C,), n_max),
            "calib_n": ((1,), n_max)}


def lda_layout(num_classes: int, k: int, n_max: int, entry: float, count_slack: float = 0.0
               ) -> dict[str, tuple[tuple[int, ...], float]]:
    """Method lda's one release (no weights, no metrics): per class the sum of the site's whitened features, each
    entry at most `entry` (the clip bound F, plus room for the noise of a DP share), and its class counts (at most
    n_max, plus `count_slack` for a DP census's noise)."""
    n_max = max(1, int(n_max))
    return {"num_samples": ((1,), float(n_max)), "lda_sum": ((int(num_classes), int(k)), n_max * float(entry)),
            "lda_count": ((int(num_classes),), n_max + float(count_slack))}


def domain_layout(num_classes: int, dim: int, n_max: int, clip: float, noise: float = 0.0,
                  count_slack: float = 0.0) -> dict[str, tuple[tuple[int, ...], float]]:
    """The in-domain detector's round: per class the sum of a site's features, each clipped to norm `clip` (an
    entry ≤ n_max·clip), their outer products' sum (an entry ≤ n_max·clip²) and the class counts (≤ n_max). `noise`:
    a DP release's noise multiplier times √2 (its two parts), room left for 10 of its standard deviations;
    `count_slack` the same for a DP census."""
    n_max, c = max(1, int(n_max)), float(clip)
    return {"num_samples": ((1,), float(n_max)), "dom_sum": ((int(num_classes), int(dim)), n_max * c + 10 * noise * c),
            "dom_outer": ((int(dim), int(dim)), n_max * c * c + 10 * noise * c * c),
            "dom_counts": ((int(num_classes),), n_max + float(count_slack))}


SETS_KEY = "conf_hist"  # the conformal sets' round (tafl.training.sets; tafl.training.methods.sets)


def sets_layout(num_classes: int, n_max: int, bins: int) -> dict[str, tuple[tuple[int, ...], float]]:
    """The conformal sets' round: per class, the counts of a site's held-out rows' scores on the fixed grid (an
    entry ≤ its held-out rows ≤ n_max); summed exactly (the quantisation error stays far below one count)."""
    n_max = max(1, int(n_max))
    return {"num_samples": ((1,), float(n_max)), SETS_KEY: ((int(num_classes), int(bins)), float(n_max))}


def min_in_sum(num_clients: int, params: SecAggParams) -> int:
    """The fewest clients a completed SecAgg+ sum over `num_clients` can hold: Flower's reconstruction threshold
    (SecAggPlusWorkflow.setup_stage's rule; every stage stops the sum when a client keeps fewer live neighbours)."""
    m = int(num_clients)
    shares = params.num_shares
    if isinstance(shares, float):
        n_sh = round(shares * m)
        if n_sh < m and n_sh % 2 == 0:
            n_sh += 1
        if n_sh <= 2:
            n_sh = m
    else:
        n_sh = int(shares)
    thr = params.reconstruction_threshold
    return max(round(thr * n_sh), 2) if isinstance(thr, float) else int(thr)


def census_layout(num_classes: int, n_max: int) -> dict[str, tuple[tuple[int, ...], float]]:
    """The census: each client's class counts (each ≤ its record count ≤ n_max), summed once over every site."""
    return {"class_counts": ((int(num_classes),), float(max(1, int(n_max))))}


def client_arrays(res, payload: Mapping[str, Any], layout: Layout) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """A client's ClientResult in the round's layout, and the metrics it may send in plaintext.

    ValueError when the result holds something the layout cannot carry (a floating tensor or an extra the server did
    not ask for, one it asked for and the result lacks): such a client answers with an error and is left out."""
    arrays: dict[str, np.ndarray] = {}
    n = float(res.num_samples)
    if "calib_n" in layout:  # a calibration round: the held-out rows' NLL sums and nothing else
        if set(res.extras) != set(CALIB_KEYS) or res.weights:
            raise ValueError("a calibration round's result must hold exactly the calibration sums")
        return {k: np.asarray(res.extras[k].double().numpy(), np.float64) for k in CALIB_KEYS}, {}

    def np64(t) -> np.ndarray:
        return np.asarray(t.detach().cpu().double().numpy() if hasattr(t, "detach") else t, dtype=np.float64)

    if SETS_KEY in layout:  # the conformal sets' round: the per-class score histograms, no weights
        if set(res.extras) != {SETS_KEY} or res.weights:
            raise ValueError("the conformal sets' round must hold exactly the score histograms")
        return {"num_samples": np.array([n]), SETS_KEY: np64(res.extras[SETS_KEY])}, {}
    if "dom_outer" in layout:  # the in-domain detector's round: its three sums, no weights
        if set(res.extras) != set(DOMAIN_KEYS) or res.weights:
            raise ValueError("the in-domain detector's round must hold exactly its feature sums and counts")
        plain = {m: float(v) for m, v in res.metrics.items() if m in PLAINTEXT_METRICS and np.isfinite(v)}
        return {"num_samples": np.array([n]), **{k: np64(res.extras[k]) for k in DOMAIN_KEYS}}, plain
    if "lda_sum" in layout:  # method lda: the class sums and counts, no weights
        if set(res.extras) != set(LDA_KEYS) or res.weights:
            raise ValueError("an lda round's result must hold exactly its class sums and counts")
        plain = {m: float(v) for m, v in res.metrics.items() if m in PLAINTEXT_METRICS and np.isfinite(v)}
        return {"num_samples": np.array([n]), **{k: np64(res.extras[k]) for k in LDA_KEYS}}, plain

    w_keys = {k[len(WEIGHT_PREFIX):] for k in layout if k.startswith(WEIGHT_PREFIX)}
    floating = {k for k, v in res.weights.items() if v.is_floating_point()}
    if floating != w_keys:
        odd = sorted(floating ^ w_keys)
        raise ValueError(f"the model update's floating tensors differ from the layout's ({len(odd)}, e.g. '{odd[0]}')")
    for k in w_keys:
        arrays[WEIGHT_PREFIX + k] = n * (np64(res.weights[k]) - np64(payload[k]))
    plain = {m: float(v) for m, v in res.metrics.items() if m in PLAINTEXT_METRICS and np.isfinite(v)}
    ints = [k for k in res.weights if k not in floating]
    if ints:
        plain["int_advance"] = float(max(int((res.weights[k].long() - payload[k].long()).max()) for k in ints))
    arrays["num_samples"] = np.array([n])
    for key in layout:
        if key.startswith(METRIC_PREFIX):
            v = res.metrics.get(key[len(METRIC_PREFIX):])
            ok = v is not None and np.isfinite(float(v))
            arrays[key] = np.array([float(v), 1.0]) if ok else np.zeros(2)

    unknown = sorted(set(res.extras) - set(CLIENT_EXTRAS))
    if unknown:
        raise ValueError(f"the result's extras {unknown} cannot be summed")
    has_grads, wants_grads = "grad_classes" in res.extras, "grad_w" in layout
    if has_grads != wants_grads:
        raise ValueError("the result's expert gradients and the layout disagree "
                         f"(result: {'some' if has_grads else 'none'}, layout: {'some' if wants_grads else 'none'})")
    if wants_grads:
        cls = res.extras["grad_classes"].long()
        (C, E, _, D), _ = layout["grad_w"]
        idx = cls.numpy()
        gw, gb, holders = np.zeros((C, E, C, D)), np.zeros((C, E, C)), np.zeros(C)
        gw[idx] = np64(res.extras["grad_w"])
        gb[idx] = np64(res.extras["grad_b"])
        holders[idx] = 1.0
        arrays.update(grad_w=gw, grad_b=gb, grad_holders=holders)
        has_stats, wants_stats = "stat_sum" in res.extras, "stat_sum" in layout
        if has_stats != wants_stats:
            raise ValueError("the result's class statistics and the layout disagree")
        if wants_stats:
            for k in STAT_KEYS:
                dense = np.zeros(layout[k][0])
                dense[idx] = np64(res.extras[k])
                arrays[k] = dense
    elif any(k in res.extras for k in STAT_KEYS):
        raise ValueError("class statistics without expert gradients cannot be summed")
    return arrays, plain


def combine(sums: Mapping[str, np.ndarray], layout: Layout, payload: Mapping[str, Any], *, client_id: int,
            plain: Sequence[Mapping[str, Any]] = ()):
    """The one ClientResult that stands for the clients in a secure sum: what the method's server_update computes from
    it is what it computes from their separate results, within the quantisation error.

    weights: θ_global + Σ n_k(θ_k − θ_global) / Σ n_k (FedAvg's weighted mean) for floating tensors; integer tensors
    the payload's plus the largest `int_advance` (the max rule). extras: the classes some client holds, the per-class
    mean of their expert gradients over the clients holding the class (GTAFL's per-class mean: one result holding the
    mean gives the same), and the class statistics' sums (counts rounded to whole numbers, the sum of squares raised
    to what the sum requires, as rounding may leave it a hair below). metrics: SUMMED_METRICS' means and sums, and the
    plaintext flags all clients set. num_samples: Σ n_k."""
    import torch

    from tafl.training.contract import ClientResult

    if "calib_n" in layout:  # a calibration round: the sums as one client's calibration statistics
        n_held = float(np.rint(sums["calib_n"][0]))
        counts = np.maximum(np.rint(sums["calib_counts"]), 0.0)
        if n_held <= 0 or counts.sum() != n_held:
            raise SecureSumError(f"the calibration sums count {n_held:.0f} held-out images and classes adding to "
                                 f"{counts.sum():.0f}")
        hess = sums["calib_hess"]
        extras = {"calib_nll": sums["calib_nll"], "calib_grad": sums["calib_grad"],
                  "calib_hess": (hess + hess.T) / 2.0,  # each client's is symmetric; the rounding need not be
                  "calib_counts": counts, "calib_n": np.array([n_held])}
        return ClientResult(int(client_id), int(n_held), {}, {k: torch.from_numpy(np.asarray(v, np.float64))
                                                               for k, v in extras.items()}, {"calibration": 1.0})
    if SETS_KEY in layout:  # the sets' round: the federation's histograms as whole counts, as one site's
        hist = np.maximum(np.rint(sums[SETS_KEY]), 0.0)
        return ClientResult(int(client_id), int(hist.sum()), {}, {SETS_KEY: torch.from_numpy(hist)},
                            {"conformal_stats": 1.0})
    n_tot = int(np.rint(float(sums["num_samples"][0])))
    if n_tot <= 0:
        raise SecureSumError(f"the secure sum reports {n_tot} samples")
    if "dom_outer" in layout:  # the detector's round: the federation's sums, as one site's
        outer = sums["dom_outer"]
        return ClientResult(int(client_id), n_tot, {}, {
            "dom_sum": torch.from_numpy(np.asarray(sums["dom_sum"], np.float64)),
            "dom_outer": torch.from_numpy(np.asarray((outer + outer.T) / 2.0, np.float64)),
            "dom_counts": torch.from_numpy(np.asarray(sums["dom_counts"], np.float64))}, {"domain_stats": 1.0})
    if "lda_sum" in layout:  # method lda: the federation's class sums, as one site's
        return ClientResult(int(client_id), n_tot, {}, {k: torch.from_numpy(np.asarray(sums[k], np.float64)).float()
                                                         for k in LDA_KEYS}, {})
    weights = {}
    w_keys = [k for k in layout if k.startswith(WEIGHT_PREFIX)]
    if w_keys:
        want = {k[len(WEIGHT_PREFIX):] for k in w_keys}
        advance = max((int(p.get("int_advance", 0)) for p in plain), default=0)
        for k, ref in payload.items():  # the payload's order: the model's state-dict order
            if k in want:
                weights[k] = (ref.double() + torch.from_numpy(sums[WEIGHT_PREFIX + k]) / n_tot).to(ref.dtype)
            elif not ref.is_floating_point():
                weights[k] = ref + advance
    extras = {}
    if "grad_holders" in sums:
        holders = np.rint(sums["grad_holders"])
        keep = holders > 0
        count = np.rint(sums["stat_count"]) if "stat_count" in sums else None
        if count is not None:
            keep &= count > 0  # a class a client holds has at least one row: rounding cannot make it 0 within bounds
        cls = np.nonzero(keep)[0]
        h = holders[cls]
        extras = {"grad_classes": torch.as_tensor(cls, dtype=torch.int64),
                  "grad_w": torch.from_numpy(sums["grad_w"][cls] / h[:, None, None, None]).float(),
                  "grad_b": torch.from_numpy(sums["grad_b"][cls] / h[:, None, None]).float()}
        if count is not None:
            S, N = sums["stat_sum"][cls], count[cls]
            Q = np.maximum(np.maximum(sums["stat_sumsq"][cls], 0.0), S * S / N[:, None])  # Cauchy-Schwarz
            extras.update(stat_sum=torch.from_numpy(S), stat_sumsq=torch.from_numpy(Q), stat_count=torch.from_numpy(N))
    metrics: dict[str, float] = {}
    for key in layout:
        if key.startswith(METRIC_PREFIX):
            name = key[len(METRIC_PREFIX):]
            total, present = float(sums[key][0]), float(np.rint(sums[key][1]))
            if present > 0:  # "sum" metrics are step counts: whole numbers
                metrics[name] = total / present if SUMMED_METRICS.get(name) == "mean" else float(np.rint(total))
    if plain and all(p.get("features_only") == 1.0 for p in plain):
        metrics["features_only"] = 1.0
    return ClientResult(int(client_id), n_tot, weights, extras, metrics)
