"""The training verbs: train, eval, retrain, compare, explain and the demo. Each is a thin call into tafl.training (and,
for the demo, tafl.packaging and tafl.serving); the training stack is imported inside them, so the command line
itself runs on a deployment install."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tafl.cli.flags import config_overrides
from tafl.errors import ConfigError, TaflError

DEMO_CONFIG: dict[str, Any] = {
    # the embedded default: scikit-learn digits, a long tail of IF 10, 10 clients; about 3 minutes on 2 cores
    "method": "gtafl", "dataset": "digits", "img_size": 16, "imbalance_factor": 10.0, "clients": 10,
    "frac": 0.5, "alpha": 0.5, "rounds": 30, "local_epochs": 5, "batch_size": 16, "lr": 0.05, "momentum": 0.9,
    "backbone": "resnet8", "width": 0.25, "seed": 7, "threads": 2,
    "retrain_epochs": 100, "simclr_steps": 5, "simclr_batch": 64,
}


def cmd_train(ns: argparse.Namespace) -> int:
    from tafl.training.config import load_config
    from tafl.training.simulator import train

    cfg = (_resumed_config(ns, Path(ns.out)) if ns.resume and not ns.config else None) \
        or load_config(ns.config, config_overrides(ns))
    if cfg.engine == "flower":
        report = _flower_simulation()(cfg, ns.out, resume=ns.resume, force=ns.force)
    else:
        report = train(cfg, ns.out, resume=ns.resume, force=ns.force, progress=None if not ns.no_progress else False)
    print_summary(report, Path(ns.out))
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
    print_summary(report, out)
    return 0


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
    print_summary(report, out)
    print(f"next: tafl export {out / 'final.pt'} --out PKG_DIR   (becomes {pkg.name} {bump_minor(pkg.version)})")
    return 0


def cmd_compare(ns: argparse.Namespace) -> int:
    from tafl.training.compare import write_comparison

    labels = ns.labels.split(",") if ns.labels else None
    text = write_comparison(ns.runs, Path(ns.out) if ns.out else None, Path(ns.plot) if ns.plot else None, labels)
    print(text)
    return 0


def cmd_explain(ns: argparse.Namespace) -> int:
    from tafl.training.explain import explain_checkpoint

    res = explain_checkpoint(ns.checkpoint, ns.image, ns.out, ns.kind)
    print(f"{res['class_name']} (class {res['label']}, p={res['probability']:.3f}); {res['heatmap']} written to "
          f"{res['out']}")
    return 0


def print_summary(report: dict[str, Any], out: Path) -> None:
    from tafl.training.longtail import DISTRIBUTION_NAMES
    from tafl.training.report import SHORT, pct

    d = report["test_distributions"]
    print(f"\n{report['method']} on {report['dataset']}: mean prior-weighted accuracy "
          f"{pct(report['average_accuracy'])} % over the eleven test distributions")
    print("  " + "  ".join(f"{SHORT[n]} {pct(d[n]['accuracy'])}" for n in DISTRIBUTION_NAMES))
    print(f"  report: {out / 'report.md'}  model: {out / 'final.pt'}")


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
    print_summary(report, run)
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
            if body.get("abstained"):  # the in-domain detector put it outside the model's domain: no label
                wrong += 1
                print(f"  {sample.name} (a {truth}) -> no finding: {body['reason']}")
                continue
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
