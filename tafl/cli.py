"""The `tafl` command: one verb per job, each a thin call into a component.

Every `RunConfig` field is also a flag (`--local-epochs 2`), so a YAML config and the command
line share one vocabulary; flags override the file. Errors a user can cause print one line
(`tafl: error: ...`) and exit 2; Ctrl-C exits 130 and says how to resume.

Exit status, the same for every verb (README, "Verbs"): 0 when everything asked was done; 1 when some inputs were
answered and others not (`predict`, `score`, `packages list`: each failure is reported beside the answers); 2 when
nothing could be done (a mistake to fix: a bad flag, file, config or URL, a service that cannot be reached, or no
input answered at all); 130 after Ctrl-C.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any

from tafl.errors import ConfigError, DataError, ServiceCallError, TaflError

log = logging.getLogger("tafl.cli")

DEMO_CONFIG: dict[str, Any] = {
    # the embedded default: scikit-learn digits, a long tail of IF 10, 10 clients; about 3 minutes on 2 cores
    "method": "gtafl", "dataset": "digits", "img_size": 16, "imbalance_factor": 10.0, "clients": 10,
    "frac": 0.5, "alpha": 0.5, "rounds": 30, "local_epochs": 5, "batch_size": 16, "lr": 0.05, "momentum": 0.9,
    "backbone": "resnet8", "width": 0.25, "seed": 7, "threads": 2,
    "retrain_epochs": 100, "simclr_steps": 5, "simclr_batch": 64,
}


def _none_or(typ):
    def parse(text: str):
        if text.lower() in ("none", "null", "natural"):
            return None
        return typ(text)
    parse.__name__ = typ.__name__
    return parse


def _shown(value: Any) -> str:
    """A default as a user types it."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def add_config_flags(p: argparse.ArgumentParser) -> None:
    """One flag per setting, flat (`--gff-m`); every default is None so only given flags override the file.

    The shared settings come first, then one group per method config (`tafl train --help` groups them by method).
    The help of each is its field's comment (`config.field_docs`), the one place it is documented, with its default;
    fixed sets of values are argparse `choices` from `config.choices()`."""
    from tafl.training.config import RunConfig, choices, field_docs
    from tafl.training.contract import config_classes

    docs, defaults, allowed = field_docs(), RunConfig(), choices()
    shared = p.add_argument_group("run configuration (each overrides the --config file; YAML keys use _ for -)")
    _add_flags(shared, RunConfig, docs, defaults, allowed)
    for cls, names in config_classes().items():
        group = p.add_argument_group(f"settings of method {' and '.join(names)} (ignored by the other methods)")
        _add_flags(group, cls, docs, defaults.settings_of(cls), allowed)


def _add_flags(group, cls: type, docs: dict[str, str], defaults: Any, allowed: dict[str, tuple[str, ...]]) -> None:
    """A flag for each field of the dataclass `cls` (its value in `defaults` shown as the default)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        base = next(a for a in args if a is not type(None))
        flag = "--" + f.name.replace("_", "-")
        doc = docs.get(f.name) or f.name.replace("_", " ")
        help_text = f"{doc} (default: {_shown(getattr(defaults, f.name))})".replace("%", "%%")
        if base is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif f.name in allowed:
            group.add_argument(flag, dest=f.name, choices=allowed[f.name], default=None, help=help_text)
        else:
            parse = _none_or(base) if type(None) in args else base
            group.add_argument(flag, dest=f.name, type=parse, default=None, metavar=base.__name__.upper(),
                               help=help_text)


def config_overrides(ns: argparse.Namespace) -> dict[str, Any]:
    from tafl.training.config import flat_keys

    return {k: getattr(ns, k) for k in flat_keys() if getattr(ns, k, None) is not None}


# ------------------------------------------------------------------ verbs
def outcome(answered: int, failed: int) -> int:
    """The exit status of a verb over many inputs: 0 all answered, 1 some answered and some not, 2 none answered."""
    if not failed:
        return 0
    return 1 if answered else 2


def cmd_train(ns: argparse.Namespace) -> int:
    from tafl.training.config import load_config
    from tafl.training.simulator import train

    cfg = (_resumed_config(ns, Path(ns.out)) if ns.resume and not ns.config else None) \
        or load_config(ns.config, config_overrides(ns))
    if cfg.engine == "flower":
        report = _flower_simulation()(cfg, ns.out, resume=ns.resume, force=ns.force)
    else:
        report = train(cfg, ns.out, resume=ns.resume, force=ns.force, progress=None if not ns.no_progress else False)
    _print_summary(report, Path(ns.out))
    return 0


def _resumed_config(ns: argparse.Namespace, out: Path, base=None):
    """`--out DIR --resume`: the run's own configuration (DIR/run.json), with the flags given beside --resume on top,
    so that train checks only those against the run (today only `rounds` may change). None where DIR holds no run:
    train then says so."""
    from tafl.errors import RunDirError
    from tafl.training.config import RunConfig

    run_json = out / "run.json"
    if not run_json.is_file():
        return None
    try:
        saved = json.loads(run_json.read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RunDirError(f"--resume: {run_json} is not a readable tafl run ({exc}); start again with --force") \
            from None
    cfg = RunConfig.from_dict(saved, str(run_json))
    if base is not None:  # retrain: a --config file's keys, as they were given to the first command
        cfg.update(base, "--config")
    return cfg.update(config_overrides(ns), "command line").validate()


def _flower_simulation():
    """`run_flower_simulation`, or a ConfigError naming the extra when Flower (or its Ray engine) is missing."""
    try:
        import flwr  # noqa: F401
        import flwr.simulation  # noqa: F401  (needs Ray: the `simulation` extra of flwr)

        from tafl.training.flower import run_flower_simulation
    except ImportError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing not in ("flwr", "ray"):
            raise
        raise ConfigError(f"--engine flower needs Flower, but {missing} is not installed ({exc}); install the "
                          "federated extra: pip install 'tafl[federated]'") from exc
    return run_flower_simulation


def cmd_eval(ns: argparse.Namespace) -> int:
    from tafl.training.checkpoint import load_checkpoint
    from tafl.training.config import RunConfig
    from tafl.training.data import load_dataset
    from tafl.training.report import write_report
    from tafl.training.checkpoint_eval import evaluate_checkpoint

    ck = load_checkpoint(ns.checkpoint)
    cfg = RunConfig.from_dict(ck["run_config"], "checkpoint run_config")
    if ns.data_root:
        cfg.data_root = ns.data_root
    if ns.labels:
        cfg.labels = ns.labels
    cfg.img_size, cfg.channels = ck["preprocess"]["size"], ck["preprocess"]["channels"]
    ds = load_dataset(cfg.validate())
    report, outputs = evaluate_checkpoint(ck, ds)
    out = Path(ns.out) if ns.out else Path(ns.checkpoint).parent / "eval"
    write_report(out, report, outputs)
    _print_summary(report, out)
    return 0


def cmd_demo(ns: argparse.Namespace) -> int:
    """Train GTAFL on the embedded digits, export the package, serve it and call it once."""
    from tafl.packaging.export import export_checkpoint
    from tafl.training.config import RunConfig
    from tafl.training.simulator import train

    root = Path(ns.out)
    run, pkg_dir = root / "run", root / "package"
    cfg = RunConfig.from_dict(DEMO_CONFIG, "demo config").validate()
    force = (run / "run.json").is_file()  # the demo replaces its own earlier run, nothing else
    print(f"tafl demo: 1/3 training {cfg.method} on the embedded digits data ({cfg.clients} clients, "
          f"{cfg.rounds} rounds, long tail IF {cfg.imbalance_factor:g}) into {run}", flush=True)
    report = train(cfg, run, force=force, progress=None if not ns.no_progress else False)
    _print_summary(report, run)
    print(f"\ntafl demo: 2/3 exporting the ONNX model package to {pkg_dir}", flush=True)
    pkg = export_checkpoint(run / "final.pt", pkg_dir, name="tafl-demo", force=pkg_dir.exists())
    print(f"  {pkg.name} {pkg.version}: {len(pkg.expert_names)} experts, hard vote; verified against PyTorch")
    samples = _demo_samples(root / "samples", report)
    if ns.no_serve:
        return 0
    return _demo_serve(pkg_dir, samples, ns.port, ns.serve_seconds, report["test_distributions"]["uniform"]["accuracy"])


def _demo_samples(folder: Path, report: dict) -> list[Path]:
    """A few real test digits as PNG files to send to the service."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    folder.mkdir(parents=True, exist_ok=True)
    d = load_digits()
    out = []
    for digit in (0, 3, 8):
        i = int(np.flatnonzero(d.target == digit)[-1])
        img = Image.fromarray(np.round(d.images[i] * 255 / 16).astype(np.uint8), "L").resize((64, 64))
        p = folder / f"digit_{digit}.png"
        img.save(p)
        out.append(p)
    return out


def _demo_serve(pkg_dir: Path, samples: list[Path], port: int | None, seconds: float | None,
                accuracy: float) -> int:
    """Start the service, call it once, print lines to try, then keep serving until Ctrl-C or SIGTERM (or for
    `seconds`), with or without a terminal: a script that runs the README's one-liner can use the lines."""
    import signal
    import time

    import httpx

    from tafl.serving.launch import ServerProcess

    port = port or _port_or_free(3000)
    print(f"\ntafl demo: 3/3 starting the service on http://127.0.0.1:{port} (bentoml serve) ...", flush=True)

    def stop(signum, frame):  # SIGTERM as Ctrl-C: the finally below stops the server's whole process tree
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, stop)
    server = None
    try:
        server = ServerProcess([str(pkg_dir)], port=port, log_path=pkg_dir.parent / "service.log")
        server.start()
        wrong = 0
        for sample in samples:  # each answer beside the digit it shows: a small model gets some wrong, said so
            with open(sample, "rb") as fh:
                r = httpx.post(f"{server.url}/predict", files={"file": (sample.name, fh, "image/png")}, timeout=30)
            r.raise_for_status()
            body = r.json()
            truth = sample.stem.rsplit("_", 1)[-1]
            votes = ", ".join(f"{e['name']}={e['class_name']}" for e in body["experts"])
            mark = "right" if body["class_name"] == truth else "WRONG"
            wrong += mark == "WRONG"
            print(f"  {sample.name} (a {truth}) -> class {body['class_name']}, {mark} (p={body['probability']:.2f}; "
                  f"experts {votes}; {body['timing_ms']['total']:.0f} ms)")
        if wrong:
            print(f"  (a small model trained for minutes: it labels {100 * accuracy:.0f} % of the test digits "
                  "correctly, so some samples come back wrong)")
        print(f"\nThe page: open {server.url}/ in a browser (the model card, its accuracy, try an image)")
        print("Try it:\n  curl -s -F file=@" + str(samples[0]) + f" {server.url}/predict")
        print(f"  curl -s -F file=@{samples[2]} -F heatmap=true {server.url}/predict | head -c 400")
        print(f"  curl -s {server.url}/models | head -c 400\n  (service log: {pkg_dir.parent / 'service.log'})")
        if seconds is None:
            print("Serving until Ctrl-C (or SIGTERM) ...", flush=True)
            while server.proc and server.proc.poll() is None:
                time.sleep(0.5)
            if server.proc and server.proc.poll() is not None:
                raise TaflError(f"the service stopped by itself; see {pkg_dir.parent / 'service.log'}")
        else:
            print(f"Serving for {seconds:g} s ...", flush=True)
            time.sleep(seconds)
    except KeyboardInterrupt:
        print("tafl demo: stopping the service", flush=True)
    finally:
        if server is not None:
            server.stop()
        signal.signal(signal.SIGTERM, old)
    return 0


def _port_or_free(port: int) -> int:
    import socket

    from tafl.serving.launch import free_port

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return port
        except OSError:
            return free_port()


def cmd_serve(ns: argparse.Namespace) -> int:
    from tafl.serving.launch import drain_seconds_from_env, serve

    # the service reads these from its environment, which `serve` hands on; its own pre-check reads them too
    if ns.trusted_keys:
        from tafl.packaging.signing import load_trusted_keys

        load_trusted_keys(ns.trusted_keys)  # a bad key path fails here, not in the worker
        os.environ["TAFL_TRUSTED_KEYS"] = ns.trusted_keys
    if ns.package_root:
        os.environ["TAFL_PACKAGE_ROOT"] = str(Path(ns.package_root).resolve())
    if ns.site_mix:  # a JSON file travels as its absolute path: the server's working folder may differ
        os.environ["TAFL_SITE_MIX"] = str(Path(ns.site_mix).resolve()) if Path(ns.site_mix).is_file() else ns.site_mix
    if ns.workers is not None:  # checked with the other TAFL_* settings by serve's preflight
        os.environ["TAFL_WORKERS"] = str(ns.workers)
    drain = ns.drain_seconds if ns.drain_seconds is not None else drain_seconds_from_env()
    def announce() -> None:  # after serve's preflight: the packages, the TAFL_* settings and the port are good
        print(f"serving {', '.join(ns.packages)} on http://{ns.host}:{ns.port} (the page for people: "
              f"http://{ns.host}:{ns.port}/; Ctrl-C or SIGTERM stops it within {drain:g} s)", flush=True)

    return serve(ns.packages, ns.host, ns.port, ns.token, drain_seconds=drain, on_checked=announce)


def cmd_explain(ns: argparse.Namespace) -> int:
    from tafl.training.explain import explain_checkpoint

    res = explain_checkpoint(ns.checkpoint, ns.image, ns.out, ns.kind)
    print(f"{res['class_name']} (class {res['label']}, p={res['probability']:.3f}); {res['heatmap']} written to "
          f"{res['out']}")
    return 0


def cmd_export(ns: argparse.Namespace) -> int:
    from tafl.packaging.export import export_checkpoint

    pkg = export_checkpoint(ns.checkpoint, ns.out, name=ns.name, parent=ns.parent, images=ns.images,
                            data_root=ns.data_root, force=ns.force, to_bentoml=ns.to_bentoml,
                            sign_key=ns.sign_key, class_codes=ns.class_codes)
    v = pkg.metadata["verification"]
    print(f"{pkg.name} {pkg.version} -> {pkg.path} (parent {pkg.metadata['parent_version'] or 'none'}); "
          f"ONNX Runtime vs PyTorch: max |dprob| {v['max_abs_prob_diff']:.1e}, max |dheatmap| "
          f"{v['max_abs_heatmap_diff']:.1e}")
    print(f"signed by key {pkg.signed_by} (SHA256SUMS.sig)" if pkg.signed_by else
          "unsigned (services with TAFL_TRUSTED_KEYS refuse it; sign with --sign-key)")
    if ns.to_bentoml:
        print(f"stored in the BentoML model store as {ns.to_bentoml}:{pkg.version.replace('.', '_')}")
    return 0


def cmd_keys_new(ns: argparse.Namespace) -> int:
    from tafl.packaging.signing import new_keypair

    priv, pub, kid = new_keypair(ns.out, ns.name)
    print(f"key id {kid}\n  private key {priv} (mode 0600: keep it secret; `tafl export ... --sign-key {priv}`)\n"
          f"  public key  {pub} (give it to services: TAFL_TRUSTED_KEYS={pub})")
    return 0


def cmd_packages_list(ns: argparse.Namespace) -> int:
    from tafl.packaging.package import list_packages
    from tafl.training.report import pct

    rows = list_packages(ns.dir)
    if not rows:
        raise DataError(f"no model packages under {ns.dir} (a package folder holds metadata.json, model.onnx and "
                        "SHA256SUMS; `tafl export` writes one)")
    print(f"{'name':24} {'version':8} {'parent':8} {'method':7} {'avg':>6} {'F50':>6} {'B50':>6}  {'created':25} status")
    for r in sorted(rows, key=lambda r: (str(r.get("name")), str(r.get("version")))):
        print(f"{str(r.get('name'))[:24]:24} {str(r.get('version')):8} {str(r.get('parent_version') or '-'):8} "
              f"{str(r.get('method')):7} {pct(r.get('average_accuracy')):>6} {pct(r.get('forward50')):>6} "
              f"{pct(r.get('backward50')):>6}  {str(r.get('created')):25} {r['status']}  {r['path']}")
    return outcome(sum(r["status"] == "ok" for r in rows), sum(r["status"] != "ok" for r in rows))


def cmd_predict(ns: argparse.Namespace) -> int:
    """Every readable file is answered; each file that fails (unreadable here, or refused by the service) is its own
    `tafl: error:` line on stderr. The exit status is 1 when some files were answered and 2 when none was. A service
    that cannot be reached or refuses the token stops the command (exit 2) after printing what was answered before."""
    from tafl.clients.client import Client, ServiceCallError

    token = ns.token or os.environ.get("TAFL_API_TOKEN")
    heat_dir = Path(ns.heatmap) if ns.heatmap else None
    if heat_dir:
        heat_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    fatal: ServiceCallError | None = None
    with Client(ns.url, token=token) as client:
        for f in ns.files:
            try:
                p = client.predict(f, model=ns.model, heatmap=heat_dir is not None, prior=ns.prior)
            except ServiceCallError as exc:
                if exc.status in (0, 401):
                    fatal = exc  # the service is unreachable or refuses us: nothing else will work either
                    break
                rows.append({"file": f, "error": f"{exc.detail} (HTTP {exc.status})"})
                continue
            except DataError as exc:  # the local file: unreadable, a folder, missing
                rows.append({"file": f, "error": exc.message})
                continue
            rows.append(_prediction_row(f, p, heat_dir))
    _print_predictions(rows, ns.json)
    if fatal is not None:
        raise fatal
    failed = sum("error" in r for r in rows)
    return outcome(len(rows) - failed, failed)


def _prediction_row(f: str, p, heat_dir: Path | None) -> dict[str, Any]:
    row = {"file": f, "label": p.label, "class_name": p.class_name, "probability": p.probability,
           "experts": {e.name: e.class_name for e in p.experts}, "model": p.model,
           "request_id": p.request_id, "prior": p.prior}
    if p.frames:
        row["frames"] = [{"frame": fr.frame, "class_name": fr.class_name, "probability": fr.probability}
                         for fr in p.frames]
    if heat_dir and p.heatmap:
        out = heat_dir / (Path(f).name + ".heatmap.png")
        out.write_bytes(p.heatmap.png)
        row["heatmap"] = str(out)
    return row


def _print_predictions(rows: list[dict[str, Any]], as_json: bool) -> None:
    for r in rows:
        if "error" in r:
            where = "" if str(r["file"]) in r["error"] else f"{r['file']}: "
            print(f"tafl: error: {where}{r['error']}", file=sys.stderr, flush=True)
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    for r in rows:
        if "error" in r:
            continue
        ex = " ".join(f"{k}={v}" for k, v in r["experts"].items())
        pr = r.get("prior") or {}
        note = f" prior={pr.get('used')}" + (f" (fallback: {pr['fallback']})" if pr.get("fallback") else "") \
            if pr.get("used") not in (None, "train") or pr.get("fallback") else ""
        print(f"{r['file']}: {r['class_name']} (p={r['probability']:.3f}) {ex}  "
              f"[{r['model']['name']} {r['model']['version']}]{note}" +
              (f" heatmap {r['heatmap']}" if "heatmap" in r else ""))
        for fr in r.get("frames", [])[1:]:
            print(f"    frame {fr['frame']}: {fr['class_name']} (p={fr['probability']:.3f})")


def cmd_score(ns: argparse.Namespace) -> int:
    from tafl.clients.score import print_summary, score_folder

    takes_mix = (ns.prior or "").strip().lower() in ("adaptive", "site")  # the site's mix: a centre or the prior
    site_mix = ns.site_mix or ((os.environ.get("TAFL_SITE_MIX") or "").strip() or None if takes_mix else None)
    dicomweb_only = [f for f, v in (("--study", ns.study), ("--since", ns.since), ("--modality", ns.modality),
                                    ("--store-sr", ns.store_sr)) if v]
    if ns.dicomweb:
        if ns.folder:
            raise ConfigError("give a FOLDER or --dicomweb URL, not both")
        if ns.engine != "local" or ns.dicom_out:
            raise ConfigError("--dicomweb scores with the local engine and files SRs back with --store-sr "
                              "(not --engine ray or --dicom-out)")
        from tafl.clients.dicomweb import PacsUnavailable, score_dicomweb

        try:
            summary = score_dicomweb(ns.dicomweb, ns.out, url=ns.url, package=ns.package,
                                     token=ns.token or os.environ.get("TAFL_API_TOKEN"), model=ns.model,
                                     studies=ns.study, since=ns.since, modality=ns.modality, store_sr=ns.store_sr,
                                     heatmap=ns.dicom_heatmap, concurrency=ns.concurrency, batch_size=ns.batch_size,
                                     resume=ns.resume, force=ns.force,
                                     progress=False if ns.no_progress else None, prior=ns.prior,
                                     sr_processes=None, site_mix=site_mix)
        except PacsUnavailable as exc:
            if Path(ns.out).exists():
                raise PacsUnavailable(f"{exc.message}. Every row in {ns.out} is complete: run the same command "
                                      "with --resume to finish") from None
            raise
        print_summary(summary)
        if ns.store_sr:
            print(f"SRs filed to {summary['source']}: {summary['stored_sr']}; refused: {summary['sr_refused']}")
        return _score_status(summary)
    if not ns.folder:
        raise ConfigError("give the FOLDER to score, or --dicomweb URL to score from a PACS")
    if dicomweb_only:
        raise ConfigError(f"{', '.join(dicomweb_only)} go(es) with --dicomweb URL")
    summary = score_folder(ns.folder, ns.out, url=ns.url, package=ns.package,
                           token=ns.token or os.environ.get("TAFL_API_TOKEN"), model=ns.model,
                           concurrency=ns.concurrency, batch_size=ns.batch_size, resume=ns.resume, force=ns.force,
                           progress=False if ns.no_progress else None, prior=ns.prior, engine=ns.engine,
                           address=ns.address, workers=ns.workers, gpus_per_worker=ns.gpus_per_worker,
                           dicom_out=ns.dicom_out, dicom_heatmap=ns.dicom_heatmap, sr_processes=None,
                           site_mix=site_mix)
    print_summary(summary)
    return _score_status(summary)


def _score_status(summary: dict[str, Any]) -> int:
    """Rows that failed (and SRs refused by the PACS or not written) against rows predicted in this run."""
    failed = len(summary["failed"]) + len(summary.get("dicom_failed") or ()) + int(summary.get("sr_refused") or 0)
    return outcome(summary["predicted"], failed)


def cmd_retrain(ns: argparse.Namespace) -> int:
    from tafl.errors import PackageError
    from tafl.packaging import load_package
    from tafl.packaging.package import bump_minor
    from tafl.training.checkpoint import load_checkpoint
    from tafl.training.config import RunConfig
    from tafl.training.simulator import train

    pkg = load_package(ns.from_pkg)
    if pkg.checkpoint_path is None:
        raise PackageError(f"{pkg.path} carries no checkpoint.pt to continue training from")
    ck = load_checkpoint(pkg.checkpoint_path)
    changes: dict[str, Any] = {}
    if ns.config:
        import yaml

        try:
            changes = yaml.safe_load(Path(ns.config).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read --config {ns.config}: {exc}") from exc
    out = Path(ns.out or f"runs/retrain-{pkg.name}-{pkg.version}")
    ns.out = str(out)  # for the resume hint after Ctrl-C
    # --resume continues with the retraining run's own configuration; a fresh one starts from the package's
    cfg = (_resumed_config(ns, out, changes) if ns.resume else None) or \
        RunConfig.from_dict(ck["run_config"], "the package's training config").update(changes, str(ns.config)) \
        .update(config_overrides(ns), "command line")
    parent = {"name": pkg.name, "version": pkg.version, "path": str(pkg.path.resolve())}
    print(f"retraining {pkg.name} {pkg.version} ({ck['method']}) for {cfg.rounds} more round(s) on "
          f"{cfg.dataset} into {out}", flush=True)
    report = train(cfg.validate(), out, resume=ns.resume, force=ns.force,
                   progress=False if ns.no_progress else None, init_from=ck, parent_package=parent)
    _print_summary(report, out)
    print(f"next: tafl export {out / 'final.pt'} --out PKG_DIR   (becomes {pkg.name} {bump_minor(pkg.version)})")
    return 0


def cmd_compare(ns: argparse.Namespace) -> int:
    from tafl.training.compare import write_comparison

    labels = ns.labels.split(",") if ns.labels else None
    text = write_comparison(ns.runs, Path(ns.out) if ns.out else None, Path(ns.plot) if ns.plot else None, labels)
    print(text)
    return 0


def _print_summary(report: dict[str, Any], out: Path) -> None:
    from tafl.training.longtail import DISTRIBUTION_NAMES
    from tafl.training.report import SHORT, pct

    d = report["test_distributions"]
    print(f"\n{report['method']} on {report['dataset']}: mean prior-weighted accuracy "
          f"{pct(report['average_accuracy'])} % over the eleven test distributions")
    print("  " + "  ".join(f"{SHORT[n]} {pct(d[n]['accuracy'])}" for n in DISTRIBUTION_NAMES))
    print(f"  report: {out / 'report.md'}  model: {out / 'final.pt'}")


# ------------------------------------------------------------------ parser
def cmd_dicom_listen(ns: argparse.Namespace) -> int:
    from tafl.serving.dicom_listener import Destination, Listener, serve

    if ns.drain_seconds is not None and not ns.drain_seconds >= 0:
        raise ConfigError(f"--drain-seconds must be a number of seconds >= 0, got {ns.drain_seconds:g}")
    dest = Destination.parse(ns.dest, ns.out_dir)
    serve(Listener(ns.package, dest, ae_title=ns.ae_title, host=ns.host, port=ns.port, spool=ns.spool,
                   heatmap=ns.heatmap, max_queue=ns.max_queue, workers=ns.workers),
          **({} if ns.drain_seconds is None else {"drain_seconds": ns.drain_seconds}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tafl", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train federated medical-image classifiers that stay accurate when the case mix shifts, "
                    "package them as\nverified ONNX models, serve them over REST and DICOM, and score folders.",
        epilog="start with `tafl demo` (about three minutes on the embedded data); `tafl VERB --help` explains a verb")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="debug logging, library INFO lines, and the traceback behind an error")
    p.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")

    t = sub.add_parser("train", help="federated training (in-process simulator, or Flower with --engine flower)",
                       usage="tafl train --out DIR [--config FILE.yaml] [--resume | --force] [FLAG VALUE ...]",
                       description="Train a model over simulated or real federated clients. Every setting of "
                                   "configs/*.yaml is also a flag below; flags override the file.")
    t.add_argument("--config", help="YAML run configuration (configs/*.yaml)")
    t.add_argument("--out", required=True, help="run folder: checkpoints, final.pt, report.{json,md}, accuracy.png")
    t.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint, with its own "
                   "configuration (run.json); flags given beside it must match the run, but --rounds may grow")
    t.add_argument("--force", action="store_true", help="replace an earlier run in --out")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_config_flags(t)
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("eval", help="evaluate a checkpoint on the eleven test distributions")
    e.add_argument("checkpoint", help="a run's final.pt (or a checkpoint under its checkpoints/)")
    e.add_argument("--out", help="report folder (default: CHECKPOINT_DIR/eval)")
    e.add_argument("--data-root", help="where the dataset lies now, if it moved")
    e.add_argument("--labels", help="labels CSV for a folder dataset, if it moved")
    e.set_defaults(func=cmd_eval)

    c = sub.add_parser("compare", help="runs side by side in the papers' table layouts, and one plot")
    c.add_argument("runs", nargs="+", help="run folders (or report.json files)")
    c.add_argument("--labels", help="comma-separated labels, one per run (default: method and switches)")
    c.add_argument("--out", help="also write the tables to this Markdown file")
    c.add_argument("--plot", default="compare.png", help="plot file (default compare.png; '' for none)")
    c.set_defaults(func=cmd_compare)

    x = sub.add_parser("explain", help="heatmap of one image under a saved model, as an overlay PNG")
    x.add_argument("checkpoint", help="a run's final.pt")
    x.add_argument("image", help="a PNG, JPEG or DICOM file")
    x.add_argument("--out", default="overlay.png", help="the overlay PNG to write (default overlay.png)")
    x.add_argument("--kind", choices=("rollout", "grad"), default="rollout",
                   help="ViT: attention rollout or gradient-weighted rollout (CNNs get a class activation map; "
                        "default rollout)")
    x.set_defaults(func=cmd_explain)

    xp = sub.add_parser("export", help="checkpoint -> verified ONNX model package (and the BentoML store)")
    xp.add_argument("checkpoint", help="a run's final.pt (from tafl train or tafl retrain)")
    xp.add_argument("--out", required=True, help="package folder")
    xp.add_argument("--name", help="package name (default METHOD-DATASET, or the parent's name)")
    xp.add_argument("--parent", help="the package this checkpoint was retrained from: bumps its version")
    xp.add_argument("--images", help="folder of PNG/JPEG images to verify the graph on (default: the run's data)")
    xp.add_argument("--data-root", help="where the run's dataset lies now, for the verification images")
    xp.add_argument("--force", action="store_true", help="replace an existing package in --out")
    xp.add_argument("--to-bentoml", metavar="NAME", help="also store the package in the BentoML model store")
    xp.add_argument("--class-codes", metavar="JSON", help="class name -> {value, scheme, meaning} (e.g. SNOMED CT) "
                                                         "for DICOM SRs; other classes use the local scheme 99TAFL")
    xp.add_argument("--sign-key", metavar="KEY", help="Ed25519 private key (`tafl keys new`) that signs the package's "
                                                      "SHA256SUMS (default $TAFL_SIGNING_KEY; unset: unsigned)")
    xp.set_defaults(func=cmd_export)

    ky = sub.add_parser("keys", help="package signing keys (Ed25519)")
    kys = ky.add_subparsers(dest="keys_verb", required=True, metavar="ACTION")
    kn = kys.add_parser("new", help="a new key pair: DIR/NAME.key (private, 0600) and DIR/NAME.pub")
    kn.add_argument("--out", required=True, metavar="DIR", help="folder for the key files (created 0700)")
    kn.add_argument("--name", default="tafl-signing", help="file name stem (default tafl-signing)")
    kn.set_defaults(func=cmd_keys_new)

    pk = sub.add_parser("packages", help="model packages: list versions, metrics and lineage")
    pks = pk.add_subparsers(dest="packages_verb", required=True, metavar="ACTION")
    pl = pks.add_parser("list", help="every package under DIR")
    pl.add_argument("dir", help="a folder holding package folders (or one package)")
    pl.set_defaults(func=cmd_packages_list)

    pr = sub.add_parser("predict", help="send images to a running service and show the predictions")
    pr.add_argument("files", nargs="+", help="PNG, JPEG or DICOM files")
    pr.add_argument("--url", required=True, help="the service, e.g. http://127.0.0.1:3000")
    pr.add_argument("--model", help="package name (default: the service's first)")
    pr.add_argument("--heatmap", metavar="OUT_DIR", help="also save each heatmap overlay PNG into OUT_DIR")
    pr.add_argument("--json", action="store_true", help="JSON instead of a table")
    pr.add_argument("--token", help="bearer token (default $TAFL_API_TOKEN)")
    pr.add_argument("--prior", help="train (default), site (the site's own class mix the service was started with: "
                                    "tafl serve --site-mix), adaptive (the service's estimate of its served case "
                                    "mix), or comma-separated class probabilities")
    pr.set_defaults(func=cmd_predict)

    sc = sub.add_parser("score", help="score every image in a folder, or in a PACS over DICOMweb, into a CSV or "
                                      "JSONL file")
    sc.add_argument("folder", nargs="?", help="folder of PNG, JPEG and DICOM files (searched recursively)")
    sc.add_argument("--out", required=True, help="results.csv or results.jsonl")
    where = sc.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="score through a running service")
    where.add_argument("--package", help="score in-process with ONNX Runtime from a package folder")
    sc.add_argument("--model", help="package name on the service (default: its first)")
    sc.add_argument("--token", help="bearer token (default $TAFL_API_TOKEN)")
    sc.add_argument("--concurrency", type=int, default=4, help="requests in flight with --url (default 4)")
    sc.add_argument("--batch-size", type=int, default=16,
                    help="images per request (--url, at most 64) or per ONNX Runtime call (--package; default 16)")
    sc.add_argument("--resume", action="store_true", help="continue an interrupted job, scoring nothing twice")
    sc.add_argument("--force", action="store_true", help="replace an existing results file")
    sc.add_argument("--no-progress", action="store_true", help="no progress bar")
    sc.add_argument("--prior", default="train",
                    help="train (default); site: decide every image for this site's own class mix (--site-mix); "
                         "adaptive: estimate the folder's class mix from all its images (EM on the calibrated "
                         "posteriors) and re-decide every row for it, no second inference; or comma-separated class "
                         "probabilities")
    sc.add_argument("--site-mix", metavar="MIX",
                    help="this site's own class counts, CLASS=COUNT,... or a JSON file: the prior of --prior site, "
                         "or the centre of --prior adaptive's estimate where the model's estimate is centred on the "
                         "site's mix (default, with either: $TAFL_SITE_MIX)")
    sc.add_argument("--engine", choices=("local", "ray"), default="local",
                    help="local (default): this process; ray: a pool of actors on a Ray cluster (--package only; "
                         "pip install 'tafl[ray]')")
    sc.add_argument("--address", help="--engine ray: the cluster, `auto` (a `ray start --head` on this machine) or "
                                      "ray://HOST:10001 (default: a local Ray for this job)")
    sc.add_argument("--workers", type=int, help="--engine ray: scoring actors (default: one per CPU of the cluster, "
                                                "or as many as its GPUs hold at --gpus-per-worker)")
    sc.add_argument("--gpus-per-worker", type=float, default=0.0,
                    help="--engine ray: GPUs per actor (default 0: CPU; e.g. 0.25 puts four actors on each GPU)")
    sc.add_argument("--dicom-out", metavar="DIR", help="also write a DICOM SR per DICOM input into DIR (resumable)")
    sc.add_argument("--dicom-heatmap", action="store_true",
                    help="with --dicom-out or --store-sr: the heatmap as a secondary capture too")
    pacs = sc.add_argument_group("scoring from a PACS over DICOMweb (docs/pacs.md; credentials from "
                                 "TAFL_DICOMWEB_TOKEN or TAFL_DICOMWEB_USER/TAFL_DICOMWEB_PASSWORD)")
    pacs.add_argument("--dicomweb", metavar="URL", help="the PACS's DICOMweb base URL instead of a FOLDER, e.g. "
                                                       "http://pacs:8042/dicom-web")
    pacs.add_argument("--study", action="append", metavar="UID", help="a study to score (repeatable)")
    pacs.add_argument("--since", metavar="YYYY-MM-DD", help="every study from that date on (QIDO StudyDate)")
    pacs.add_argument("--modality", metavar="XX", help="only instances of that modality (e.g. CR, DX, XC)")
    pacs.add_argument("--store-sr", action="store_true",
                      help="file each image's DICOM SR back to the PACS (STOW-RS), before its row is written")
    sc.set_defaults(func=cmd_score)

    rt = sub.add_parser("retrain", help="continue training from a package's checkpoint on new or more data",
                        usage="tafl retrain --from PKG_DIR [--config FILE.yaml] [--out DIR] [FLAG VALUE ...]")
    rt.add_argument("--from", dest="from_pkg", required=True, metavar="PKG_DIR",
                    help="the package to continue from (its checkpoint.pt and training config)")
    rt.add_argument("--config", help="YAML with the keys to change (data, rounds, ...)")
    rt.add_argument("--out", help="run folder (default runs/retrain-NAME-VERSION)")
    rt.add_argument("--resume", action="store_true",
                    help="continue the retraining run in --out with its own configuration (its run.json)")
    rt.add_argument("--force", action="store_true", help="replace an earlier run in --out")
    rt.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_config_flags(rt)
    rt.set_defaults(func=cmd_retrain)

    sv = sub.add_parser("serve", help="serve model packages with BentoML (127.0.0.1 by default)")
    sv.add_argument("packages", nargs="+", help="package folders or BentoML model tags")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: all)")
    sv.add_argument("--port", type=int, default=3000, help="port to listen on (default 3000)")
    sv.add_argument("--token", help="require 'Authorization: Bearer TOKEN' (default: $TAFL_API_TOKEN or none)")
    sv.add_argument("--trusted-keys", metavar="KEYS", help="public key files or folders of *.pub files, "
                    "comma-separated: only packages signed by one of them load (default $TAFL_TRUSTED_KEYS)")
    sv.add_argument("--package-root", metavar="DIR", help="folders /admin/reload may load lie inside DIR "
                    "(default $TAFL_PACKAGE_ROOT; unset: BentoML tags only)")
    sv.add_argument("--site-mix", metavar="MIX", help="this site's own class counts, CLASS=COUNT,... or a JSON "
                    "file: prior=site decides for this mix, and where the model's case-mix estimator is centred on "
                    "the site's mix, prior=adaptive starts from it (default $TAFL_SITE_MIX; docs/guide.md)")
    sv.add_argument("--workers", type=int, metavar="N",
                    help="worker processes, each with every package and its own event loop (default: $TAFL_WORKERS, "
                         "else chosen at start from the packages' measured cost: 2 where every model is cheap (a "
                         "ViT-tiny), the machine has 2+ cores and the memory, and reloads are off; otherwise 1; "
                         "/models says which and why); /admin/reload needs 1")
    sv.add_argument("--drain-seconds", type=float, metavar="S",
                    help="on SIGTERM, SIGINT or SIGHUP: requests in flight get up to S-5 s to finish, and "
                         "whatever of the server still runs after S s is killed; a second signal kills at once "
                         "(default: $TAFL_DRAIN_SECONDS or 20)")
    sv.set_defaults(func=cmd_serve)

    dl = sub.add_parser("dicom-listen", help="a DICOM Storage SCP: classify every received instance and store its "
                                             "SR (C-STORE to a destination AE, or a folder)")
    dl.add_argument("--package", required=True, help="model package folder")
    dl.add_argument("--ae-title", default="TAFL", help="this listener's AE title (default TAFL)")
    dl.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    dl.add_argument("--port", type=int, default=11112, help="port to listen on (default 11112)")
    dl_to = dl.add_mutually_exclusive_group(required=True)
    dl_to.add_argument("--dest", metavar="AE@HOST:PORT", help="store SRs to this storage SCP (C-STORE, retried)")
    dl_to.add_argument("--out-dir", metavar="DIR", help="write SRs into DIR instead")
    dl.add_argument("--spool", default="tafl-dicom-spool", help="received instances wait here, durably, until "
                                                                "their SR is stored (default ./tafl-dicom-spool)")
    dl.add_argument("--heatmap", action="store_true", help="also store the heatmap as a secondary capture")
    dl.add_argument("--max-queue", type=int, default=1000,
                    help="instances waiting in the spool before C-STOREs are refused with 0xA700 (a sender may not "
                         "retry: Orthanc does not); default 1000, about 0.5 GB of CT slices on disk")
    dl.add_argument("--workers", type=int, default=2, help="classifying threads (each with its own association "
                                                           "to --dest; default 2)")
    dl.add_argument("--drain-seconds", type=float, metavar="S",
                    help="on SIGTERM or SIGINT: finish what the spool holds for up to S s, then stop (what is left "
                         "stays for the next start; a second signal stops at once; default 25)")
    dl.set_defaults(func=cmd_dicom_listen)

    d = sub.add_parser("demo", help="train GTAFL on the embedded digits, export, serve and call the service")
    d.add_argument("--out", default="runs/demo", help="demo folder (default runs/demo)")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    d.add_argument("--no-serve", action="store_true", help="stop after training and export")
    d.add_argument("--port", type=int, help="service port (default 3000, or a free one)")
    d.add_argument("--serve-seconds", type=float, metavar="S",
                   help="serve for S seconds, then stop (default: until Ctrl-C or SIGTERM)")
    d.set_defaults(func=cmd_demo)
    return p


# Modules of the training stack (the `train` extra): a verb that needs one, run on a deployment install, says so.
TRAINING_STACK = ("torch", "torchvision", "timm", "medmnist", "matplotlib", "sklearn", "onnx", "onnxscript")
# Libraries whose INFO lines (one per HTTP request, ...) are noise to a user: shown with -v only.
CHATTY_LOGGERS = ("httpx", "httpcore", "urllib3", "PIL", "matplotlib", "filelock", "asyncio", "bentoml",
                  "dicomweb_client", "highdicom")


def _verb_parser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The (sub)parser of the verb named in argv (`train`, `keys new` ...), for its usage line."""
    current = parser
    for word in argv:
        subs = [a for a in current._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            break
        if word in subs[0].choices:
            current = subs[0].choices[word]
    return current


def _unknown_arguments(parser: argparse.ArgumentParser, argv: list[str], extras: list[str]) -> None:
    """A mistyped flag: the verb's own usage and the closest flag it has, not the top-level usage."""
    import difflib

    verb = _verb_parser(parser, argv)
    flags = sorted({o for a in verb._actions for o in a.option_strings})
    bad = extras[0].split("=", 1)[0]
    close = difflib.get_close_matches(bad, flags, n=1, cutoff=0.6) if bad.startswith("-") else []
    hint = f"; did you mean {close[0]}?" if close else f"; see tafl {verb.prog.split(' ', 1)[-1]} --help"
    verb.error(f"unrecognized arguments: {' '.join(extras)}{hint}")


def main(argv: list[str] | None = None) -> int:
    import traceback

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    verb = _verb_parser(parser, argv)
    flags = [o for a in verb._actions for o in a.option_strings]
    typos = [w for w in argv if w.startswith("--") and len(w) > 2
             and not any(f.startswith(w.split("=", 1)[0]) for f in flags)]
    if typos:  # before argparse, whose "required: --out" would hide that --otu was meant
        _unknown_arguments(parser, argv, typos)
    ns, extras = parser.parse_known_args(argv)
    if extras:
        _unknown_arguments(parser, argv, extras)
    level = logging.DEBUG if ns.verbose else logging.WARNING if ns.quiet else logging.INFO
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("tafl").setLevel(level)
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.DEBUG if ns.verbose else logging.WARNING)

    def fail(message: str) -> int:
        if ns.verbose:
            traceback.print_exc()
        print(f"tafl: error: {message}", file=sys.stderr)
        return 2

    try:
        return int(ns.func(ns) or 0)
    except ServiceCallError as exc:
        hint = "; is the service running there? (start one with: tafl serve PKG_DIR)" if exc.status == 0 else ""
        return fail(exc.message + hint)
    except TaflError as exc:
        return fail(exc.message)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in TRAINING_STACK:
            raise
        return fail(f"tafl {ns.verb} needs the training stack, and {exc.name} is not installed here; install it "
                    "with: pip install 'tafl[train]'")
    except BrokenPipeError:  # output piped into `head` and closed early
        sys.stderr.close()
        return 0
    except OSError as exc:  # a file or folder the user named: missing, unreadable, a disk that is full
        return fail(f"{exc.filename}: {exc.strerror or exc}" if exc.filename else str(exc.strerror or exc))
    except KeyboardInterrupt:
        print(f"tafl: interrupted{_resume_hint(ns)}", file=sys.stderr)
        return 130


def _resume_hint(ns: argparse.Namespace) -> str:
    """How the interrupted verb continues, as a command to copy; nothing where there is nothing to continue."""
    import shlex

    out = getattr(ns, "out", None)
    if ns.verb in ("train", "retrain"):
        run = Path(out) if out else None
        if run is None or not (run / "run.json").is_file():
            return "; no round had finished, so nothing was kept: run the same command again"
        first = ["--from", ns.from_pkg] if ns.verb == "retrain" else []
        return f"; it continues with: tafl {ns.verb} {shlex.join([*first, '--out', str(out)])} --resume"
    if ns.verb == "score" and out and Path(out).exists():
        return "; every row written is complete: run the same command with --resume to finish"
    return ""


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

