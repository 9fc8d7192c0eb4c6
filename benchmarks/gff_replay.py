"""Exact offline replay of GTAFL's server-side expert work on a finished run, for design decisions.

    python benchmarks/gff_replay.py record RUN_DIR [RUN_DIR ...]
    python benchmarks/gff_replay.py sweep RUN_DIR [RUN_DIR ...] --variants VARIANTS.json --name NAME

Why it is exact: the extractor's trajectory does not depend on the expert heads, the banks or
the vote (clients train the extractor and the original head; the experts are only evaluated at
the features). So `record` recomputes, from the run's per-round checkpoints (train with
`--keep_checkpoints` >= rounds), the features every participating client embedded in every
round — the same rows (`GTAFL.gradient_sample` with the client's generator), the same broadcast
extractor in eval mode — plus the final extractor's validation and test features. `sweep` then
re-runs the server's expert loop (`GTAFL.feature_extras` on the clients' side,
`GTAFL._retrain_experts` on the server's: the product's own code) under each variant's config
overrides, and scores every expert and vote rule on the validation split (the eleven-distribution
prior-weighted accuracy). Replaying a run's own config reproduces its expert heads bit for bit
(checked by `record`'s --verify). The test split is scored too but chooses nothing: decisions are
taken on the `val_*` columns.

The finishing round (`final_round_frac`) is replayed from the rows every client embedded with the
final extractor (`record` keeps them too).
Writes benchmarks/results/<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tafl.imaging import Preprocess  # noqa: E402
from tafl.training.config import RunConfig  # noqa: E402
from tafl.training.ensemble import ExpertEnsemble  # noqa: E402
from tafl.training.evaluate import evaluate_outputs  # noqa: E402
from tafl.training.longtail import DISTRIBUTION_NAMES, select_clients  # noqa: E402
from tafl.training.contract import ClientResult  # noqa: E402
from tafl.training.models import ModelConfig  # noqa: E402
from tafl.training.simulator import make_method, prepare  # noqa: E402

RULES = ("hard", "soft", "confidence", "learned")


def _cfg(run: Path) -> RunConfig:
    return RunConfig.from_dict(json.loads((run / "run.json").read_text())["config"], str(run / "run.json")).validate()


@torch.no_grad()
def record(run: Path) -> Path:
    cfg = _cfg(run)
    prep = prepare(cfg)
    method = make_method(cfg, prep.model_cfg, prep.dataset.preprocess)
    torch.set_num_threads(2)
    images, labels = torch.from_numpy(prep.train.images), torch.from_numpy(prep.train.labels)
    state0 = method.init_state(prep.train_counts)
    ckpt = {}
    for r in range(1, cfg.rounds + 1):
        f = run / "checkpoints" / f"round_{r:04d}.pt"
        if not f.is_file():
            raise SystemExit(f"{f} is missing: train with --keep_checkpoints {cfg.rounds} to replay")
        ckpt[r] = f

    def embed(weights, rows: torch.Tensor) -> torch.Tensor:
        method.model.load_state_dict(weights)
        method.model.eval()
        return torch.cat([method.model.features(method.normalize(images[rows[s:s + 512]])).float()
                          for s in range(0, len(rows), 512)])

    rounds = {}
    for r in range(1, cfg.rounds + 2):  # R+1: the feature-only round at the final extractor
        weights = state0.weights if r == 1 else torch.load(ckpt[r - 1], weights_only=True)["state"]["weights"]
        clients = []
        for k in select_clients(cfg.clients, cfg.frac, cfg.seed, r):
            part = torch.from_numpy(prep.parts[k])
            idx = part[method.gradient_sample(labels[part], method.generator(r, k))]
            clients.append({"id": k, "n": len(part), "feats": embed(weights, idx), "labels": labels[idx]})
        rounds[r] = clients
    final = torch.load(ckpt[cfg.rounds], weights_only=True)["state"]["weights"]
    everyone = []  # every client's rows at the final extractor (a final feature round with all clients)
    for k in range(cfg.clients):
        part = torch.from_numpy(prep.parts[k])
        idx = part[method.gradient_sample(labels[part], method.generator(cfg.rounds + 1, k))]
        everyone.append({"id": k, "n": len(part), "feats": embed(final, idx), "labels": labels[idx]})
    ds = prep.dataset
    cache = {"rounds": rounds, "final_all": everyone, "train_counts": prep.train_counts, "client_counts": prep.client_counts,
             "ranks": prep.ranks, "config": cfg.to_dict(), "model_config": prep.model_cfg.to_dict(),
             "preprocess": ds.preprocess.to_dict(),
             "val": (_embed_split(method, final, ds.val.images), ds.val.labels),
             "test": (_embed_split(method, final, ds.test.images), ds.test.labels)}
    out = run / "replay_cache.pt"
    torch.save(cache, out)
    return out


@torch.no_grad()
def _embed_split(method, weights, images_u8: np.ndarray) -> torch.Tensor:
    method.model.load_state_dict(weights)
    method.model.eval()
    x = torch.from_numpy(images_u8)
    return torch.cat([method.model.features(method.normalize(x[s:s + 512])).float() for s in range(0, len(x), 512)])


def replay(cache: dict, overrides: dict) -> dict:
    """The server's expert loop under `overrides`; returns the final extras and meta."""
    recorded = dict(cache["config"])
    if recorded.get("bank_init") == "auto":  # runs made while `auto` (= normal banks for gtafl) existed
        recorded["bank_init"] = "normal"
    cfg = RunConfig.from_dict({**recorded, "method": "gtafl", "cl": False, "cr": True, **overrides}).validate()
    method = make_method(cfg, ModelConfig.from_dict(cache["model_config"]), Preprocess.from_dict(cache["preprocess"]))
    state = method.init_state(np.asarray(cache["train_counts"]))
    method.round_config(state, {k: {"class_counts": torch.tensor(row, dtype=torch.float32)}
                                for k, row in enumerate(np.asarray(cache["client_counts"]))}, 0)
    extras, meta = dict(state.extras), dict(state.meta)
    R = max(cache["rounds"]) - 1
    schedule = [(r, cache["rounds"][r]) for r in range(1, R + 1)]
    if method.final_frac > 0:  # the finishing round: every client (frac 1) or round R+1's selection otherwise
        schedule.append((R + 1, cache["final_all"] if method.final_frac >= 1 else cache["rounds"][R + 1]))
    for r, clients in schedule:
        W, b = extras["expert.weight"], extras["expert.bias"]
        results = [ClientResult(c["id"], c["n"], {}, method.feature_extras(c["feats"], c["labels"], W, b))
                   for c in clients]
        good = [res for res in results if method._grads_problem(res) is None]
        method._retrain_experts(extras, meta, good, r, {})
    return {"extras": extras, "meta": meta, "names": method.names}


def score(extras: dict, meta: dict, names: tuple[str, ...], feats: torch.Tensor, labels: np.ndarray,
          ranks: np.ndarray, rules=RULES) -> dict:
    """Every expert's and every vote rule's eleven-distribution accuracies on (feats, labels)."""
    out = {}
    W, b = extras["expert.weight"], extras["expert.bias"]
    for rule in rules:
        w = tuple(meta["vote_weights"]) if rule == "learned" and meta.get("vote_weights") else None
        res = ExpertEnsemble(torch.nn.Identity(), W, b, tuple(names), rule, w)(feats)
        ev = evaluate_outputs(res["probs"].numpy(), res["label"].numpy(), labels, ranks)
        out[rule] = _short(ev)
        if rule == rules[0]:
            for e, name in enumerate(names):
                p = res["expert_probs"][:, e].numpy()
                out[name] = _short(evaluate_outputs(p, p.argmax(1), labels, ranks))
    return out


def _short(ev: dict) -> dict:
    return {"avg": ev["average_accuracy"], **{n: ev["test_distributions"][n]["accuracy"] for n in DISTRIBUTION_NAMES}}


_CACHES: dict = {}


def _job(args):
    path, vname, ov, server_seed = args
    if path not in _CACHES:
        _CACHES[path] = torch.load(Path(path) / "replay_cache.pt", weights_only=False)
    cache = _CACHES[path]
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    if server_seed:  # another draw of the server's own randomness (banks, expert init, retraining order)
        ov = {**ov, "seed": int(cache["config"]["seed"]) + 1000 * server_seed}
    rep = replay(cache, ov)
    ranks = np.asarray(cache["ranks"])
    return vname, f"{Path(path).name}#{server_seed}", {
        "val": score(rep["extras"], rep["meta"], rep["names"], cache["val"][0], np.asarray(cache["val"][1]), ranks),
        "test": score(rep["extras"], rep["meta"], rep["names"], cache["test"][0], np.asarray(cache["test"][1]), ranks),
        "vote_weights": rep["meta"].get("vote_weights"),
        "seconds": time.perf_counter() - t0,
        "bank_mean_drift": rep["meta"]["gff_history"][-1].get("bank_mean_drift")}


def sweep(runs: list[Path], variants: dict[str, dict], name: str, server_seeds: int = 1, procs: int = 1) -> dict:
    for run in runs:
        if not (run / "replay_cache.pt").is_file():
            record(run)
    jobs = [(str(run), vname, ov, k) for vname, ov in variants.items() for run in runs for k in range(server_seeds)]
    if procs > 1:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(procs) as pool:
            out = pool.map(_job, jobs, chunksize=1)
    else:
        out = [_job(j) for j in jobs]
    results: dict = {v: {} for v in variants}
    for vname, key, res in out:
        results[vname][key] = res
    write(results, variants, name)
    return results


def _spec(r: dict) -> bool:
    """The specialisation property: forward beats backward on forward50, backward beats forward on backward50."""
    return r["forward"]["forward50"] > r["backward"]["forward50"] and r["backward"]["backward50"] > r["forward"]["backward50"]


def write(results: dict, variants: dict, name: str) -> None:
    res_dir = REPO / "benchmarks" / "results"
    res_dir.mkdir(parents=True, exist_ok=True)
    (res_dir / f"{name}.json").write_text(json.dumps({"variants": variants, "results": results}, indent=1))
    ref = next(iter(results))
    lines = [f"# {name}", "", "`python benchmarks/gff_replay.py sweep ...` (" + time.strftime("%Y-%m-%d") + "): the "
             "server's expert loop replayed on the recorded client features of each run (and, with --server-seeds, "
             "with other server-side random draws). Prior-weighted accuracy %, the eleven-distribution mean, as "
             "mean ± sd over the replays; Δ is the paired mean difference to the first variant. Decisions are read "
             "from the validation columns; the test columns chose nothing.", "",
             "| variant | val hard | val soft | val conf. | val learned | Δ val hard | val F / U / B expert | spec. val | "
             "spec. test | F50 gap val | B50 gap val | test hard | test soft | test learned | test F / U / B expert |",
             "|---" * 15 + "|"]
    for vname, runs in results.items():
        def ms(split, key):
            xs = [100 * r[split][key]["avg"] for r in runs.values() if key in r[split]]
            if not xs:
                return "—"
            return f"{statistics.mean(xs):.2f} ± {statistics.stdev(xs) if len(xs) > 1 else 0:.2f}"

        def m(split, key):
            return f"{statistics.mean(100 * r[split][key]['avg'] for r in runs.values()):.1f}"
        delta = [100 * (r["val"]["hard"]["avg"] - results[ref][k]["val"]["hard"]["avg"]) for k, r in runs.items()
                 if k in results[ref]]
        gf = statistics.mean(100 * (r["val"]["forward"]["forward50"] - r["val"]["backward"]["forward50"])
                             for r in runs.values())
        gb = statistics.mean(100 * (r["val"]["backward"]["backward50"] - r["val"]["forward"]["backward50"])
                             for r in runs.values())
        n = len(runs)
        lines.append(f"| {vname} | {ms('val', 'hard')} | {ms('val', 'soft')} | {ms('val', 'confidence')} | "
                     f"{ms('val', 'learned')} | {statistics.mean(delta):+.2f} | {m('val', 'forward')} / {m('val', 'uniform')} / "
                     f"{m('val', 'backward')} | {sum(_spec(r['val']) for r in runs.values())}/{n} | "
                     f"{sum(_spec(r['test']) for r in runs.values())}/{n} | {gf:+.1f} | {gb:+.1f} | "
                     f"{ms('test', 'hard')} | {ms('test', 'soft')} | {ms('test', 'learned')} | {m('test', 'forward')} / "
                     f"{m('test', 'uniform')} / "
                     f"{m('test', 'backward')} |")
    lines += ["", "F50 gap: forward minus backward expert on forward50; B50 gap: backward minus forward expert on "
              "backward50 (both positive when the experts specialise as designed).", "",
              "Variants: " + "; ".join(f"**{k}** `{json.dumps(v)}`" for k, v in variants.items())]
    (res_dir / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def verify(run: Path) -> None:
    """Replaying the run's own config must reproduce its final expert heads exactly."""
    cache = torch.load(run / "replay_cache.pt", weights_only=False)
    cfg = cache["config"]
    st = torch.load(run / "checkpoints" / f"round_{cfg['rounds']:04d}.pt", weights_only=True)["state"]
    old = {"bank_init": "normal", "gff_centre": False, "final_round_frac": 0.0}  # a run from before statistics
    rep = replay(cache, {} if st["meta"].get("banks") else old)
    ck = st["extras"]
    diff = float((rep["extras"]["expert.weight"] - ck["expert.weight"]).abs().max())
    print(f"{run.name}: max |W_replay − W_run| = {diff:.3g}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("verb", choices=("record", "sweep", "verify", "table"))
    p.add_argument("runs", nargs="*", type=Path)
    p.add_argument("--variants", type=Path)
    p.add_argument("--name", default="gff_replay")
    p.add_argument("--server-seeds", type=int, default=1, help="replays per run with other server-side random draws")
    p.add_argument("--procs", type=int, default=1, help="replays in parallel (each is single-threaded)")
    a = p.parse_args()
    if a.verb == "record":
        for run in a.runs:
            t0 = time.perf_counter()
            print(f"{record(run)} ({time.perf_counter() - t0:.0f} s)")
    elif a.verb == "table":  # the Markdown table again from benchmarks/results/<name>.json
        d = json.loads((REPO / "benchmarks" / "results" / f"{a.name}.json").read_text())
        write(d["results"], d["variants"], a.name)
    elif a.verb == "verify":
        for run in a.runs:
            verify(run)
    else:
        sweep(a.runs, json.loads(a.variants.read_text()), a.name, a.server_seeds, a.procs)


if __name__ == "__main__":
    main()
