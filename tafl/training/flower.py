"""Flower engine: the same transport-free steps, driven across sites as a Flower ServerApp/ClientApp.

Nothing here implements a method. The ServerApp runs the simulator's round loop
(`simulator.train`) with a `FlowerTransport`, so GFF matching, expert retraining, SimCLR and the
DAFL statistics run in the ServerApp exactly as in-process; the ClientApp calls the method's
`client_stats` and `client_update`. On the wire: the round's payload and every client's weights
and extras are `ArrayRecord`s, the statistics too, the run, model and round configuration are
`ConfigRecord`s (JSON strings for nested values), losses are `MetricRecord`s.

Client data: a SuperNode started with `--node-config "partition-id=K num-partitions=N"` holds
client K of the simulated split of the run's dataset; one started with data keys
(`--node-config "dataset='folder' data-root='/data' labels='labels.csv' label-column='dx'"`) trains
on that hospital's own images (their training split). Nodes that do not answer in time, answer
with an error, or send malformed records are dropped from the round with a logged reason; the
server keeps its per-round checkpoint, so a restarted ServerApp continues with `resume=true`.

A SuperNode started with `--isolation process` runs all its messages in one warm process,
`python -m tafl.training.flower --runtime-api-address HOST:PORT` (`serve_clientapp`): torch is
imported once and the node's data prepared once (`_NODE_CACHE`), not once per message.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tafl.errors import ConfigError, DataError
from tafl.training.config import RunConfig
from tafl.training.longtail import holdout_split
from tafl.training.contract import ClientData, ClientResult, Tensors, tensor_bytes
from tafl.training.secagg import (LAYOUT_RECORD, SUM_ID, SecAggParams, SecureBounds, SecureSumError,
                                  calibration_layout, census_layout, domain_layout, sets_layout,
                                  client_arrays, combine, is_secure, layout_from_json, round_layout, route_secagg,
                                  secure_reply, secure_sum)
from tafl.training.transport import Transport

log = logging.getLogger(__name__)

DATA_KEYS = ("dataset", "data_root", "labels", "image_column", "label_column", "group_column", "image_dir",
             "val_fraction", "test_fraction", "imbalance_factor", "cache_dir")


def _records():
    from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

    return ArrayRecord, ConfigRecord, MetricRecord, RecordDict


def to_array_record(t: Tensors):
    ArrayRecord = _records()[0]
    return ArrayRecord(torch_state_dict={k: v.detach().cpu() for k, v in t.items()}) if t else ArrayRecord()


def from_array_record(rec) -> Tensors:
    return {k: v.clone() for k, v in rec.to_torch_state_dict().items()} if len(rec) else {}


# ------------------------------------------------------------------ client side
_NODE_CACHE: dict[tuple, tuple[Any, ClientData]] = {}
_CACHE_HITS = [0]  # messages served from _NODE_CACHE since it was filled (logged: the warm process's evidence)


def _client(content, context) -> tuple[Any, ClientData]:
    """The method and this node's data, rebuilt from the server's configuration (cached per process)."""
    from tafl.imaging import Preprocess
    from tafl.training.data import folder_site_names, load_dataset
    from tafl.training.models import ModelConfig
    from tafl.training.prepare import make_method, prepare

    conf = content["config"]
    node_cfg = dict(context.node_config)
    key = (conf["tafl_config"], conf["preprocess"], json.dumps(node_cfg, sort_keys=True, default=str))
    if key in _NODE_CACHE:
        _CACHE_HITS[0] += 1
        log.info("client data: reused from this process's cache (pid %d, reuse %d)", os.getpid(), _CACHE_HITS[0])
        return _NODE_CACHE[key]
    t0 = time.perf_counter()
    cfg = RunConfig.from_dict(json.loads(conf["tafl_config"]), "server's run config").validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)  # the run config governs threads, as in-process (results depend on it)
    model_cfg = ModelConfig.from_dict(json.loads(conf["model_config"]))
    pre = Preprocess.from_dict(json.loads(conf["preprocess"]))
    class_names = json.loads(conf["class_names"])
    if "partition-id" in node_cfg and cfg.client_column:  # simulation of real sites: site K decodes its own rows
        pid, names = int(node_cfg["partition-id"]), folder_site_names(cfg)
        local = RunConfig.from_dict(cfg.to_dict())
        local.site = names[pid]
        ds = load_dataset(local.validate())
        (rows,), (held,) = holdout_split([np.arange(len(ds.train))], cfg.calib_holdout, cfg.seed,
                                          ds.train.labels, cfg.calib_holdout_mode, first_client=pid)
        data = ClientData(pid, torch.from_numpy(ds.train.images), torch.from_numpy(ds.train.labels),
                          torch.from_numpy(rows), len(class_names), torch.from_numpy(held))
    elif "partition-id" in node_cfg:
        pid, n = int(node_cfg["partition-id"]), int(node_cfg.get("num-partitions", cfg.clients))
        if n != cfg.clients:
            raise ConfigError(f"this SuperNode is partition {pid} of {n}, but the run has {cfg.clients} clients")
        prep = prepare(cfg)
        data = ClientData(pid, torch.from_numpy(prep.train.images), torch.from_numpy(prep.train.labels),
                          torch.from_numpy(prep.parts[pid]), len(class_names), torch.from_numpy(prep.holdouts[pid]))
    else:  # a site's own data, named in its node config
        local = RunConfig.from_dict(cfg.to_dict())
        local.update({k.replace("-", "_"): v for k, v in node_cfg.items() if k.replace("-", "_") in DATA_KEYS},
                     "node config")
        local.img_size, local.channels, local.imbalance_factor = pre.size, pre.channels, None
        local.client_column = local.site = None  # a deployed site is one client: its CSV holds its own rows
        ds = load_dataset(local.validate())
        labels = site_labels(ds.class_names, class_names, ds.train.labels)
        cid = int(node_cfg.get("client-id", context.node_id % (2**31)))
        (rows,), (held,) = holdout_split([np.arange(len(ds.train))], cfg.calib_holdout, cfg.seed + cid,
                                          labels, cfg.calib_holdout_mode)
        data = ClientData(cid, torch.from_numpy(ds.train.images), torch.from_numpy(labels),
                          torch.from_numpy(rows), len(class_names), torch.from_numpy(held))
    method = make_method(cfg, model_cfg, pre, "cpu")
    _NODE_CACHE.clear()  # one run at a time per process
    _NODE_CACHE[key] = (method, data)
    _CACHE_HITS[0] = 0
    log.info("client data: prepared in %.1f s (pid %d, client %d, %d samples)", time.perf_counter() - t0, os.getpid(),
             int(data.client_id), len(data))
    return method, data


def site_labels(site_classes: list[str], classes: list[str], labels: np.ndarray) -> np.ndarray:
    """A site's labels as indices into the federation's classes. A site may lack classes (vidir_molemax has no
    akiec); a class the federation does not know is an error."""
    unknown = sorted(set(site_classes) - set(classes))
    if unknown:
        raise DataError(f"this site's classes {', '.join(unknown)} are not among the federation's "
                        f"({', '.join(classes)})")
    index = np.array([list(classes).index(c) for c in site_classes], np.int64)
    return index[np.asarray(labels, np.int64)]


def make_client_app():
    from flwr.app import Message
    from flwr.clientapp import ClientApp

    ArrayRecord, ConfigRecord, MetricRecord, RecordDict = _records()
    app = ClientApp()

    @app.query()
    def query(msg: Message, context) -> Message:
        method, data = _client(msg.content, context)
        # under secure aggregation a client's class counts leave it only inside the census's secure sum
        stats = {} if method.cfg.secure_aggregation else method.client_stats(data)
        return Message(RecordDict({"stats": to_array_record(stats),
                                   "meta": ConfigRecord({"client_id": int(data.client_id),
                                                         "num_samples": int(len(data))})}), reply_to=msg)

    @app.train(mods=[route_secagg])
    def train(msg: Message, context) -> Message:
        method, data = _client(msg.content, context)
        if is_secure(msg):
            return _secure_train(msg, method, data)
        if method.cfg.secure_aggregation:
            raise ValueError("this run sends its updates through SecAgg+ only; the server asked for a plaintext one")
        payload = from_array_record(msg.content["payload"])
        round_cfg = json.loads(msg.content["config"]["round_cfg"])
        t0 = time.perf_counter()
        res = method.client_update(payload, data, round_cfg)
        secs = time.perf_counter() - t0
        metrics = {k: float(v) for k, v in res.metrics.items() if isinstance(v, (int, float)) and np.isfinite(v)}
        return Message(RecordDict({"weights": to_array_record(res.weights), "extras": to_array_record(res.extras),
                                   "metrics": MetricRecord(metrics),
                                   "meta": ConfigRecord({"client_id": int(res.client_id),
                                                         "num_samples": int(res.num_samples),
                                                         "seconds": float(secs)})}), reply_to=msg)

    return app


def _secure_train(msg, method, data):
    """The collect stage of a secure sum: the census's class counts, or a round's update in the layout the message
    names (tafl.training.secagg.client_arrays). A result the server would have dropped (check_results and the
    method's own checks) is refused here, as the server cannot check one client's numbers: the client answers with
    an error and the sum goes on without it."""
    conf = msg.content["config"]
    meta = {"client_id": int(data.client_id), "num_samples": int(len(data))}
    if "census" in conf:
        return secure_reply(msg, {"class_counts": method.client_stats(data)["class_counts"]}, meta)
    payload = from_array_record(msg.content["payload"])
    round_cfg = json.loads(conf["round_cfg"])
    t0 = time.perf_counter()
    res = method.client_update(payload, data, round_cfg)
    secs = time.perf_counter() - t0
    if round_cfg.get("calibrate"):
        from tafl.prior import n_params
        from tafl.training.calibrate import calibration_problem

        C = int(method.model_cfg.num_classes)
        why = calibration_problem(res, C, n_params(str(round_cfg["calibrate"]), C))
    elif round_cfg.get("domain_stats"):
        from tafl.training.detector import problem

        why = problem(res, int(method.model_cfg.num_classes), int(method.model.domain_dim))
    elif round_cfg.get("conformal_stats") is not None:
        from tafl.training.sets import problem as sets_problem

        why = sets_problem(res, int(method.model_cfg.num_classes))
    else:
        why = _update_problem(method, payload, res)
    if why is not None:
        raise ValueError(f"client {data.client_id}: this round's update cannot be aggregated: {why}")
    arrays, plain = client_arrays(res, payload, layout_from_json(str(msg.content[LAYOUT_RECORD]["layout"])))
    return secure_reply(msg, arrays, {**meta, "seconds": float(secs), **plain})


def _update_problem(method, payload: Tensors, res: ClientResult) -> str | None:
    """Why the server's checks (aggregate.check_results, the method's extra check) would drop this result, or None."""
    from tafl.training.aggregate import problem_with

    if res.num_samples <= 0:
        return f"reports {res.num_samples} samples"
    if res.weights:
        why = problem_with(method.scoped({k: payload[k] for k in method.model.state_dict() if k in payload}),
                           res.weights, "model update")
        if why is not None:
            return why
        if res.metrics.get("steps") == 0:
            return "no local step had a finite loss"
    check = getattr(method, "_grads_problem", None)
    return check(res) if check is not None and (res.extras or res.weights) else None


# ------------------------------------------------------------------ a warm ClientApp process
def serve_clientapp(runtime_api_address: str = "127.0.0.1:9094", *, insecure: bool = False,
                    root_certificates: str | None = None, superexec_auth_secret: bytes | None = None,
                    poll_s: float = 0.2, ready_file: str | Path | None = None, max_tasks: int | None = None) -> int:
    """Run a SuperNode's ClientApp tasks one after another in this one long-lived process
    (`tafl.training.flower_warm.WarmClientApp`): torch is imported once and the node's data prepared once."""
    from tafl.training.flower_warm import WarmClientApp

    import tafl.training.simulator  # noqa: F401 - what the first message would import, before the node is ready

    app = WarmClientApp(runtime_api_address, insecure=insecure, root_certificates=root_certificates,
                        superexec_auth_secret=superexec_auth_secret)
    return app.serve(poll_s=poll_s, ready_file=ready_file, max_tasks=max_tasks)


def main(argv: list[str] | None = None) -> int:
    """`python -m tafl.training.flower --runtime-api-address HOST:PORT`: a warm ClientApp process."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m tafl.training.flower",
                                description=serve_clientapp.__doc__.split("\n")[0])
    p.add_argument("--runtime-api-address", default="127.0.0.1:9094",
                   help="the SuperNode's Runtime API (flower-supernode --isolation process --host H --port P)")
    p.add_argument("--insecure", action="store_true", help="plain HTTP to the Runtime API (it is on loopback)")
    p.add_argument("--root-certificates", help="CA of the Runtime API's TLS certificate")
    p.add_argument("--superexec-auth-secret-file", help="the secret the SuperNode was given with the same flag")
    p.add_argument("--poll", type=float, default=0.2, help="seconds between task polls (default 0.2)")
    p.add_argument("--ready-file", help="written with this process's id once it is ready for tasks")
    a = p.parse_args(argv)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    tafl_log = logging.getLogger("tafl")
    tafl_log.addHandler(handler)
    tafl_log.setLevel(logging.INFO)
    secret = Path(a.superexec_auth_secret_file).read_bytes() if a.superexec_auth_secret_file else None
    return serve_clientapp(a.runtime_api_address, insecure=a.insecure, root_certificates=a.root_certificates,
                           superexec_auth_secret=secret, poll_s=a.poll, ready_file=a.ready_file)


# ------------------------------------------------------------------ server side
def parse_train_reply(msg) -> ClientResult:
    """A ClientResult from a train reply; ValueError naming what is malformed."""
    if msg.has_error():
        raise ValueError(f"the node answered with an error: {msg.error.reason[:300]}")
    content = msg.content
    for key in ("weights", "meta"):
        if key not in content:
            raise ValueError(f"the reply lacks the '{key}' record")
    meta = content["meta"]
    for key in ("client_id", "num_samples"):
        if key not in meta or not isinstance(meta[key], int):
            raise ValueError(f"meta record lacks an integer '{key}'")
    try:
        weights = from_array_record(content["weights"])
        extras = from_array_record(content["extras"]) if "extras" in content else {}
    except Exception as exc:  # noqa: BLE001 - whatever a broken ArrayRecord raises
        raise ValueError(f"arrays cannot be read ({type(exc).__name__}: {exc})") from exc
    metrics = dict(content["metrics"]) if "metrics" in content else {}
    metrics["seconds"] = float(meta.get("seconds", 0.0))
    return ClientResult(int(meta["client_id"]), int(meta["num_samples"]), weights, extras, metrics)


class FlowerTransport(Transport):
    """The round loop's clients over Flower. With `cfg.secure_aggregation` every quantity the server only needs summed
    travels through SecAgg+ (tafl.training.secagg): the census's class counts once, then one secure sum per round whose
    one combined ClientResult the method's server_update aggregates as it would the clients' separate results
    (docs/flower.md, "Secure aggregation"). `method`: the server's method, which names the model's tensors and the
    extras the layout must carry (needed with secure aggregation)."""

    def __init__(self, grid, cfg: RunConfig, prep, *, timeout: float | None = None, wait_s: float | None = None,
                 method=None, bounds: SecureBounds | None = None):
        self.grid, self.cfg = grid, cfg
        self.timeout = timeout or cfg.flower_timeout
        self.num_clients = cfg.clients
        self.secure = bool(cfg.secure_aggregation)
        self.method = method
        self.num_classes = len(prep.dataset.class_names)
        self.bounds = bounds or SecureBounds()
        # 2^30 levels per entry (the most Flower's int32 rounding takes) in a 2^40 modulus: up to 1023 clients a sum
        self.secagg = SecAggParams(quantization_range=2**30, modulus_range=2**40, timeout=self.timeout)
        self.secure_sums: list[dict[str, Any]] = []  # per secure sum: round, clients, clipped entries, seconds
        if self.secure:
            if method is None:
                raise ConfigError("secure aggregation needs the server's method to lay out what clients sum")
            final_frac = getattr(method, "final_frac", 1.0) if getattr(method, "cr", False) else 1.0
            if getattr(method, "cr", False) and min(cfg.frac, final_frac if final_frac > 0 else 1.0) < 1.0:
                log.warning("secure aggregation with frac %s (finishing round %s): the per-class row counts and the "
                            "classes each site holds stay the same from round to round, and sums of them over "
                            "different subsets of sites can be differenced; use --frac 1 where that matters "
                            "(docs/flower.md, \"Secure aggregation\")", cfg.frac, final_frac)
        _, ConfigRecord, _, _ = _records()
        self.common = {"tafl_config": json.dumps(cfg.to_dict()), "model_config": json.dumps(prep.model_cfg.to_dict()),
                       "preprocess": json.dumps(prep.dataset.preprocess.to_dict()),
                       "class_names": json.dumps(list(prep.dataset.class_names))}
        self.node_of: dict[int, int] = {}
        self.n_of: dict[int, int] = {}  # client -> its record count (public in tafl's privacy model)
        deadline = time.time() + (wait_s if wait_s is not None else cfg.flower_wait_s)
        nodes = list(grid.get_node_ids())
        while len(nodes) < cfg.clients and time.time() < deadline:
            time.sleep(1.0)
            nodes = list(grid.get_node_ids())
        if not nodes:
            raise ConfigError("no SuperNode is connected to the SuperLink")
        if len(nodes) < cfg.clients:
            log.warning("only %d of %d SuperNodes connected; the others' rounds will be missing", len(nodes),
                        cfg.clients)
        self.nodes = nodes

    def _config(self, **extra: Any):
        ConfigRecord = _records()[1]
        return ConfigRecord({**self.common, **extra})

    def _send(self, node_ids: list[int], message_type: str, content_fn) -> list:
        from flwr.app import Message

        msgs = [Message(content=content_fn(n), message_type=message_type, dst_node_id=n) for n in node_ids]
        return list(self.grid.send_and_receive(msgs, timeout=self.timeout))

    def census(self) -> dict[int, Tensors]:
        out = self._query(self.nodes, census=True)
        if not self.secure:
            return out
        # each client's class counts summed securely once, over every site (a constant summed over different subsets
        # would leak by differencing): the server learns only the federation's counts, kept as one row
        ids = sorted(self.node_of)
        layout = census_layout(self.num_classes, max(self.n_of[k] for k in ids))
        res = self._secure_sum(ids, layout, lambda n: _records()[3]({"config": self._config(census="1")}), 0,
                               "census")
        if res is None:
            raise ConfigError("the census's secure sum failed; see the log above")
        counts = np.clip(np.rint(res.sums["class_counts"]), 0, None)
        return {SUM_ID: {"class_counts": torch.tensor(counts, dtype=torch.float32)}}

    def _secure_sum(self, ids: list[int], layout, content_fn, round_: int, what: str):
        """One SecAgg+ sum over clients `ids`; None (logged) when Flower abandons it. Booked in `secure_sums`."""
        nodes = [self.node_of[k] for k in ids]
        client_of = {n: k for k, n in self.node_of.items()}
        try:
            res = secure_sum(self.grid, nodes, content_fn, layout, params=self.secagg, round_=round_)
        except SecureSumError as exc:
            log.warning("%s: the secure sum over clients %s failed: %s", what, ids, exc)
            self.secure_sums.append({"round": round_, "what": what, "clients": [], "clipped": 0, "failed": str(exc)})
            return None
        in_sum = sorted(client_of[n] for n in res.node_ids)
        for n, m in res.metrics.items():
            if int(m.get("client_id", client_of[n])) != client_of[n]:
                log.warning("%s: node %s answers as client %s but registered as client %s", what, n,
                            m.get("client_id"), client_of[n])
        left = sorted(set(ids) - set(in_sum))
        entries = sum(int(np.prod(shape)) for shape, _ in layout.values())
        book = {"round": round_, "what": what, "clients": in_sum, "clipped": res.clipped, "entries": entries,
                "seconds": round(res.seconds, 3)}
        self.secure_sums.append(book)
        log.info("%s: secure sum over clients %s (%d entries each), %d entries clipped, %.1f s%s", what, in_sum,
                 entries, res.clipped, res.seconds, f"; left out: {left} ({'; '.join(res.failures)[:300]})"
                 if left else "")
        if res.clipped:
            log.warning("%s: %d summed entries exceeded their bounds and were clipped (a biased sum): see "
                        "docs/flower.md on SecureBounds", what, res.clipped)
        return res

    def _query(self, node_ids: list[int], census: bool = False) -> dict[int, Tensors]:
        RecordDict = _records()[3]
        out: dict[int, Tensors] = {}
        for rep in self._send(node_ids, "query", lambda n: RecordDict({"config": self._config()})):
            node = rep.metadata.src_node_id
            try:
                if rep.has_error():
                    raise ValueError(f"error: {rep.error.reason[:200]}")
                cid = int(rep.content["meta"]["client_id"])
                n_samples = int(rep.content["meta"]["num_samples"])
                stats = from_array_record(rep.content["stats"])
            except (KeyError, ValueError, TypeError) as exc:
                log.warning("node %s: unusable statistics reply (%s); ignored", node, exc)
                continue
            if census:
                if cid in self.node_of and self.node_of[cid] != node:
                    log.warning("client id %d is claimed by nodes %s and %s; keeping the first", cid,
                                self.node_of[cid], node)
                    continue
                self.node_of[cid] = node
                self.n_of[cid] = n_samples
            out[cid] = stats
        if census:
            log.info("census: %d client(s) answered: %s", len(out), sorted(out))
        return out

    def stats(self, ids: list[int]) -> dict[int, Tensors]:
        if self.secure:  # no per-client counts: the round config uses the census's global counts
            return {}
        nodes = [self.node_of[k] for k in ids if k in self.node_of]
        return self._query(nodes) if nodes else {}

    def train(self, ids, payload, round_cfg):
        RecordDict = _records()[3]
        missing = [k for k in ids if k not in self.node_of]
        if missing:
            log.warning("clients %s have no connected SuperNode; they miss this round", missing)
        if self.secure:
            return self._secure_train([k for k in ids if k in self.node_of], payload, round_cfg)
        nodes = [self.node_of[k] for k in ids if k in self.node_of]
        rec = to_array_record(payload)
        wire_down = rec.count_bytes() * len(nodes)
        cfg_rec = self._config(round_cfg=json.dumps(round_cfg))
        replies = self._send(nodes, "train", lambda n: RecordDict({"payload": rec, "config": cfg_rec}))
        results, cost = [], {"client_s": 0.0, "uplink_bytes": 0, "downlink_bytes": tensor_bytes(payload) * len(nodes),
                             "wire_downlink_bytes": wire_down, "wire_uplink_bytes": 0}
        answered = set()
        for rep in replies:
            node = rep.metadata.src_node_id
            answered.add(node)
            try:
                res = parse_train_reply(rep)
            except ValueError as exc:
                log.warning("round %s: node %s rejected: %s", round_cfg.get("round"), node, exc)
                continue
            if self.node_of.get(res.client_id) != node:
                log.warning("round %s: node %s claims client %s it did not register; rejected", round_cfg.get("round"),
                            node, res.client_id)
                continue
            cost["client_s"] += res.metrics.pop("seconds", 0.0)
            cost["uplink_bytes"] += tensor_bytes(res.weights) + tensor_bytes(res.extras)
            cost["wire_uplink_bytes"] += sum(r.count_bytes() for r in rep.content.values())
            results.append(res)
        # replies come in arrival order; aggregation sums in list order, so order them as selected (as in-process):
        # the same answers give the same model whatever order the nodes finished in
        order = {k: i for i, k in enumerate(ids)}
        results.sort(key=lambda res: order.get(res.client_id, len(order)))
        lost = [n for n in nodes if n not in answered]
        if lost:
            log.warning("round %s: node(s) %s did not answer within %.0f s; the round goes on without them",
                        round_cfg.get("round"), lost, self.timeout)
        return results, cost

    def layout(self, payload: Tensors, round_cfg: dict[str, Any], ids: list[int]):
        """The round's layout (tafl.training.secagg.round_layout) from public values: the server method's model
        tensors and extras, the run config, and the largest record count among the round's clients."""
        method, cfg = self.method, self.cfg
        if round_cfg.get("calibrate"):  # a calibration round: the held-out rows' NLL sums
            return calibration_layout(str(round_cfg["calibrate"]), self.num_classes, max(self.n_of[k] for k in ids),
                                      self.bounds, round_cfg.get("scale", 1.0), round_cfg.get("bias"))
        if round_cfg.get("conformal_stats") is not None:  # the sets' score histograms: whole counts
            from tafl.conformal import GRID

            return sets_layout(self.num_classes, max(self.n_of[k] for k in ids), GRID)
        if round_cfg.get("domain_stats"):  # the in-domain detector's sums, features clipped to a public norm
            n_max = max(self.n_of[k] for k in ids)
            noise = count_slack = 0.0
            if method.dp:
                z = method.privacy.plan(n_max).stats_noise_multiplier
                noise, count_slack = z * 2 ** 0.5, 10.0 * z
            return domain_layout(self.num_classes, method.model.domain_dim, n_max, float(round_cfg["domain_clip"]),
                                 noise, count_slack)
        if not method.trains:  # lda: one release of class sums, no weights
            return method.secure_layout(payload, max(self.n_of[k] for k in ids))
        buffers = dict(method.model.named_buffers())
        weights = {k: (tuple(v.shape), k in buffers) for k, v in method.scoped(method.model.state_dict()).items()
                   if k in payload and v.is_floating_point()}
        grads = None
        if getattr(method, "cr", False):  # GTAFL and CReFF: expert gradients (and class statistics)
            grads = (self.num_classes, len(method.names), method.model.feature_dim)
        return round_layout(weights, max(self.n_of[k] for k in ids), self.bounds, local_epochs=cfg.local_epochs,
                            grads=grads, stats=bool(getattr(method, "uses_stats", False)),
                            grad_samples=cfg.grad_samples, features_only=bool(round_cfg.get("features_only")))

    def _secure_train(self, ids: list[int], payload: Tensors, round_cfg: dict[str, Any]):
        """One secure sum over the round's clients, returned as ONE combined ClientResult (secagg.combine). Its id is
        the first client in the sum: the round loop counts the clients whose ids it finds among the results as
        having answered (a round whose result carried no client's id would count as all dropped, and two such rounds
        stop the run as diverged); the cost's `answered` lists every client in the sum, `secure_sum` its clipped
        entries and seconds."""
        RecordDict = _records()[3]
        r = round_cfg.get("round")
        rec = to_array_record(payload)
        cfg_rec = self._config(round_cfg=json.dumps(round_cfg))
        cost: dict[str, Any] = {"client_s": 0.0, "uplink_bytes": 0,
                                "downlink_bytes": tensor_bytes(payload) * len(ids),
                                "wire_downlink_bytes": rec.count_bytes() * len(ids)}
        if len(ids) < 2:
            log.warning("round %s: %d client(s) reachable; a secure sum needs more; the round has no update", r,
                        len(ids))
            return [], cost
        layout = self.layout(payload, round_cfg, ids)
        res = self._secure_sum(ids, layout, lambda n: RecordDict({"payload": rec, "config": cfg_rec}), int(r or 0),
                               f"round {r}")
        cost["secure_sum"] = self.secure_sums[-1]
        if res is None:
            return [], cost
        client_of = {n: k for k, n in self.node_of.items()}
        in_sum = [k for k in ids if self.node_of[k] in set(res.node_ids)]  # the selection's order
        cost["answered"] = in_sum  # every client whose update is in the combined result
        plain = [res.metrics[self.node_of[k]] for k in in_sum]
        # each client's plaintext counters (DP-SGD steps and releases: functions of its public record count), for
        # the round loop's privacy ledger, which a combined result cannot feed
        cost["client_metrics"] = {k: {**{m: float(v) for m, v in res.metrics[self.node_of[k]].items()
                                         if isinstance(v, (int, float))}, "num_samples": int(self.n_of[k])}
                                  for k in in_sum}
        cost["client_s"] = float(sum(float(m.get("seconds", 0.0)) for m in plain))
        cost["uplink_bytes"] = 8 * (cost["secure_sum"]["entries"] + 1) * len(in_sum)  # int64 masked vectors
        public_n = sum(self.n_of[client_of[n]] for n in res.node_ids)
        if "num_samples" in res.sums and abs(float(res.sums["num_samples"][0]) - public_n) > 0.5:
            log.warning("round %s: the secure sum counts %.1f samples, the census %d", r,
                        float(res.sums["num_samples"][0]), public_n)
        try:
            combined = combine(res.sums, layout, payload, client_id=in_sum[0], plain=plain)
        except SecureSumError as exc:
            log.warning("round %s: the secure sum is unusable (%s); the round has no update", r, exc)
            return [], cost
        if "calib_nll" in res.errors:  # the calibration's fit treats an NLL change within this as no change
            combined.metrics["calib_nll_error"] = float(res.errors["calib_nll"])
        return [combined], cost


def make_server_app(cfg: RunConfig | None = None, out: str | Path | None = None, *, resume: bool | None = None,
                    force: bool = False):
    """A ServerApp running `simulator.train` over Flower. Without arguments it reads the Flower run
    config: `config` (a YAML path), `config-json` (key overrides), `out`, `resume`, `force`."""
    from flwr.serverapp import ServerApp

    app = ServerApp()

    @app.main()
    def main(grid, context) -> None:
        from tafl.training.config import load_config
        from tafl.training.simulator import train

        rc = dict(context.run_config)
        c = cfg
        if c is None:
            overrides = json.loads(rc.get("config-json", "{}") or "{}")
            c = load_config(rc.get("config") or None, overrides)
        o = out or rc.get("out", "runs/flower")
        r = bool(rc.get("resume", False)) if resume is None else resume
        f = force or bool(rc.get("force", False))
        train(c, o, resume=r, force=f, progress=False,
              transport_factory=lambda method, prep: FlowerTransport(grid, c, prep, method=method))

    return app


def run_flower_simulation(cfg: RunConfig, out: str | Path, *, resume: bool = False, force: bool = False,
                          num_cpus: int = 1) -> dict[str, Any]:
    """`tafl train --engine flower`: Flower's simulation engine (Ray) on this machine."""
    from flwr.simulation import run_simulation

    if cfg.client_column:  # one SuperNode per site of the labels CSV
        from tafl.training.data import folder_site_names

        cfg.clients = len(folder_site_names(cfg))
    run_simulation(server_app=make_server_app(cfg, out, resume=resume, force=force), client_app=make_client_app(),
                   num_supernodes=cfg.clients,
                   backend_config={"client_resources": {"num_cpus": num_cpus, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": max(num_cpus, 2), "include_dashboard": False}})
    report = Path(out) / "report.json"
    if not report.is_file():
        raise ConfigError(f"the Flower simulation ended without a report in {out}; see its log above")
    return json.loads(report.read_text())


server_app = make_server_app()
client_app = make_client_app()


if __name__ == "__main__":
    import sys

    from tafl.training import flower as _module  # the module the SuperNode's ClientApp reference loads: one cache

    sys.exit(_module.main())
