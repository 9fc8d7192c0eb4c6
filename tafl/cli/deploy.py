"""The verbs around packages and services: export, keys, packages list, serve, predict, score and dicom-listen. Each
is a thin call into tafl.packaging, tafl.serving or tafl.clients; none needs the training stack except export."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tafl.errors import ConfigError, DataError
from tafl.settings import env_str, set_env

def outcome(answered: int, failed: int) -> int:
    """The exit status of a verb over many inputs: 0 all answered, 1 some answered and some not, 2 none answered."""
    if not failed:
        return 0
    return 1 if answered else 2


def cmd_export(ns: argparse.Namespace) -> int:
    from tafl.packaging.domain import describe
    from tafl.packaging.export import export_checkpoint

    pkg = export_checkpoint(ns.checkpoint, ns.out, name=ns.name, parent=ns.parent, images=ns.images,
                            data_root=ns.data_root, force=ns.force, to_bentoml=ns.to_bentoml,
                            sign_key=ns.sign_key, class_codes=ns.class_codes, domain=ns.domain,
                            coverage=ns.coverage)
    v = pkg.meta.verification
    print(f"{pkg.name} {pkg.version} -> {pkg.path} (parent {pkg.meta.parent_version or 'none'}); "
          f"ONNX Runtime vs PyTorch: max |dprob| {v.max_abs_prob_diff:.1e}, max |dheatmap| "
          f"{v.max_abs_heatmap_diff:.1e}")
    print(f"input domain: {describe(pkg.meta.domain)}" + ("; a DICOM whose header contradicts it is refused"
                                                           if pkg.meta.domain else ""))
    sets = pkg.meta.sets
    print(f"prediction sets: {100 * sets.coverage:g}% coverage per class"
          f"{f' with {100 * sets.confidence:g}% confidence' if sets.confidence else ' on average'} (also "
          f"{', '.join(f'{v:g}' for v in sorted(sets.thresholds) if v != sets.coverage)} on request)" if sets.fitted
          else f"prediction sets: none ({sets.why})" if sets else "prediction sets: none (a run from before them)")
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
    print(f"{'name':24} {'version':8} {'parent':8} {'method':7} {'avg':>6} {'F50':>6} {'B50':>6}  {'created':25} "
          "status")
    for r in sorted(rows, key=lambda r: (str(r.get("name")), str(r.get("version")))):
        print(f"{str(r.get('name'))[:24]:24} {str(r.get('version')):8} {str(r.get('parent_version') or '-'):8} "
              f"{str(r.get('method')):7} {pct(r.get('average_accuracy')):>6} {pct(r.get('forward50')):>6} "
              f"{pct(r.get('backward50')):>6}  {str(r.get('created')):25} {r['status']}  {r['path']}")
    return outcome(sum(r["status"] == "ok" for r in rows), sum(r["status"] != "ok" for r in rows))


def cmd_serve(ns: argparse.Namespace) -> int:
    from tafl.serving.launch import drain_seconds_from_env, serve

    # the service reads these from its environment, which `serve` hands on; its own pre-check reads them too
    if ns.trusted_keys:
        from tafl.packaging.signing import load_trusted_keys

        load_trusted_keys(ns.trusted_keys)  # a bad key path fails here, not in the worker
        set_env("TAFL_TRUSTED_KEYS", ns.trusted_keys)
    if ns.package_root:
        set_env("TAFL_PACKAGE_ROOT", str(Path(ns.package_root).resolve()))
    if ns.site_mix:  # a JSON file travels as its absolute path: the server's working folder may differ
        set_env("TAFL_SITE_MIX", str(Path(ns.site_mix).resolve()) if Path(ns.site_mix).is_file() else ns.site_mix)
    if ns.site:
        set_env("TAFL_SITE", ns.site)
    if ns.workers is not None:  # checked with the other TAFL_* settings by serve's preflight
        set_env("TAFL_WORKERS", str(ns.workers))
    drain = ns.drain_seconds if ns.drain_seconds is not None else drain_seconds_from_env()
    def announce() -> None:  # after serve's preflight: the packages, the TAFL_* settings and the port are good
        print(f"serving {', '.join(ns.packages)} on http://{ns.host}:{ns.port} (the page for people: "
              f"http://{ns.host}:{ns.port}/; Ctrl-C or SIGTERM stops it within {drain:g} s)", flush=True)

    return serve(ns.packages, ns.host, ns.port, ns.token, drain_seconds=drain, on_checked=announce)


def cmd_predict(ns: argparse.Namespace) -> int:
    """Every readable file is answered; each file that fails (unreadable here, or refused by the service) is its own
    `tafl: error:` line on stderr. The exit status is 1 when some files were answered and 2 when none was. A service
    that cannot be reached or refuses the token stops the command (exit 2) after printing what was answered before."""
    from tafl.clients.client import Client, ServiceCallError

    token = ns.token or env_str("TAFL_API_TOKEN")
    heat_dir = Path(ns.heatmap) if ns.heatmap else None
    if heat_dir:
        heat_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    fatal: ServiceCallError | None = None
    with Client(ns.url, token=token) as client:
        for f in ns.files:
            try:
                p = client.predict(f, model=ns.model, heatmap=heat_dir is not None, prior=ns.prior,
                                   abstain=not ns.label_outside_domain, coverage=_coverage(ns.coverage),
                                   site=ns.site)
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


def _coverage(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"--coverage {value!r}: expected a level such as 0.9") from None


def _prediction_row(f: str, p, heat_dir: Path | None) -> dict[str, Any]:
    row = {"file": f, "label": p.label, "class_name": p.class_name, "probability": p.probability,
           "experts": {e.name: e.class_name for e in p.experts}, "model": p.model,
           "request_id": p.request_id, "prior": p.prior, "abstained": p.abstained}
    if p.domain is not None:
        row["domain"] = {"in_domain": p.domain.in_domain, "distance": p.domain.distance,
                         "threshold": p.domain.threshold, "reason": p.domain.reason}
    if p.prediction_set is not None:
        row["prediction_set"] = {"coverage": p.prediction_set.coverage, "classes": p.prediction_set.classes,
                                 "calibrated_for": p.prediction_set.calibrated_for}
    if p.abstained:
        row["reason"] = p.reason
    if p.frames:
        row["frames"] = [{"frame": fr.frame, "class_name": fr.class_name, "probability": fr.probability,
                          "abstained": fr.abstained} for fr in p.frames]
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
        if r["abstained"]:  # no finding: what the model says instead
            print(f"{r['file']}: no finding: {r['reason']}  [{r['model']['name']} {r['model']['version']}]")
            continue
        ex = " ".join(f"{k}={v}" for k, v in r["experts"].items())
        pr = r.get("prior") or {}
        note = f" prior={pr.get('used')}" + (f" (fallback: {pr['fallback']})" if pr.get("fallback") else "") \
            if pr.get("used") not in (None, "train") or pr.get("fallback") else ""
        print(f"{r['file']}: {r['class_name']} (p={r['probability']:.3f}) {ex}  "
              f"[{r['model']['name']} {r['model']['version']}]{note}" +
              (f" heatmap {r['heatmap']}" if "heatmap" in r else "") +
              ("  OUTSIDE THE MODEL'S DOMAIN: not a finding" if not r.get("domain", {}).get("in_domain", True)
               else ""))
        if r.get("prediction_set"):
            ps = r["prediction_set"]
            where = "" if ps["calibrated_for"] == "the federation" else f", calibrated at {ps['calibrated_for']}"
            print(f"    plausible ({100 * ps['coverage']:g}% set{where}): "
                  f"{', '.join(ps['classes']) or 'none at this level'}")
        for fr in r.get("frames", [])[1:]:
            print(f"    frame {fr['frame']}: " + ("no finding (outside the model's domain)" if fr["abstained"] else
                                                  f"{fr['class_name']} (p={fr['probability']:.3f})"))


def cmd_validate(ns: argparse.Namespace) -> int:
    """0: every acceptance criterion met (or none given); 1: some not met; 2: no report could be made (main's
    handler prints the reason)."""
    import tempfile

    from tafl.clients.validate import fetch_dicomweb, read_criteria_file, validate
    from tafl.clients.validate_report import write

    if bool(ns.data) == bool(ns.dicomweb):
        raise ConfigError("give the images' folder (DATA) or --dicomweb URL --study UID, one of them")
    criteria = list(ns.require) + (read_criteria_file(ns.criteria) if ns.criteria else [])
    with tempfile.TemporaryDirectory(prefix="tafl-validate-") as tmp:
        data = ns.data or fetch_dicomweb(ns.dicomweb, ns.study, Path(tmp))
        report = validate(ns.package, data, ns.labels, criteria=criteria, path_column=ns.path_column,
                          label_column=ns.label_column, batch_size=ns.batch_size)
    if ns.dicomweb:
        report["data"]["root"] = f"{ns.dicomweb} (studies {', '.join(ns.study)})"
    html_path, json_path = write(report, ns.out)
    print(report["verdict"])
    print(f"report: {html_path} (and {json_path.name})")
    return 0 if report["passed"] else 1


def cmd_score(ns: argparse.Namespace) -> int:
    from tafl.clients.score import print_summary, score_folder

    takes_mix = (ns.prior or "").strip().lower() in ("adaptive", "site")  # the site's mix: a centre or the prior
    site_mix = ns.site_mix or (env_str("TAFL_SITE_MIX") if takes_mix else None)
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
                                     token=ns.token or env_str("TAFL_API_TOKEN"), model=ns.model,
                                     studies=ns.study, since=ns.since, modality=ns.modality, store_sr=ns.store_sr,
                                     heatmap=ns.dicom_heatmap, not_assessed_sr=ns.not_assessed_sr,
                                     concurrency=ns.concurrency, batch_size=ns.batch_size,
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
                           token=ns.token or env_str("TAFL_API_TOKEN"), model=ns.model,
                           concurrency=ns.concurrency, batch_size=ns.batch_size, resume=ns.resume, force=ns.force,
                           progress=False if ns.no_progress else None, prior=ns.prior, engine=ns.engine,
                           address=ns.address, workers=ns.workers, gpus_per_worker=ns.gpus_per_worker,
                           dicom_out=ns.dicom_out, dicom_heatmap=ns.dicom_heatmap, sr_processes=None,
                           site_mix=site_mix, not_assessed_sr=ns.not_assessed_sr)
    print_summary(summary)
    return _score_status(summary)


def _score_status(summary: dict[str, Any]) -> int:
    """Rows that failed (and SRs refused by the PACS or not written) against rows predicted in this run."""
    failed = len(summary["failed"]) + len(summary.get("dicom_failed") or ()) + int(summary.get("sr_refused") or 0)
    return outcome(summary["predicted"], failed)


def cmd_dicom_listen(ns: argparse.Namespace) -> int:
    from tafl.serving.dicom_listener import Destination, Listener, serve

    if ns.drain_seconds is not None and not ns.drain_seconds >= 0:
        raise ConfigError(f"--drain-seconds must be a number of seconds >= 0, got {ns.drain_seconds:g}")
    dest = Destination.parse(ns.dest, ns.out_dir)
    serve(Listener(ns.package, dest, ae_title=ns.ae_title, host=ns.host, port=ns.port, spool=ns.spool,
                   heatmap=ns.heatmap, max_queue=ns.max_queue, workers=ns.workers,
                   not_assessed_sr=ns.not_assessed_sr),
          **({} if ns.drain_seconds is None else {"drain_seconds": ns.drain_seconds}))
    return 0
