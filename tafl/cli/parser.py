"""The `tafl` command's parser: one subcommand per verb, each with its own flags and help. The training verbs take
every run setting as a flag (`flags.add_config_flags`); each verb's function is set as its `func` default."""

from __future__ import annotations

import argparse

from tafl.cli.deploy import (cmd_dicom_listen, cmd_export, cmd_keys_new, cmd_packages_list, cmd_predict, cmd_score,
                             cmd_serve, cmd_validate)
from tafl.cli.flags import add_config_flags
from tafl.cli.training import cmd_compare, cmd_demo, cmd_eval, cmd_explain, cmd_retrain, cmd_train


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
    _training_verbs(sub)
    _package_verbs(sub)
    _client_verbs(sub)
    _retrain_verb(sub)
    _service_verbs(sub)
    _demo_verb(sub)
    return p


def _training_verbs(sub) -> None:
    """train, eval, compare, explain: the training stack's verbs."""
    t = sub.add_parser("train", help="federated training (in-process simulator, or Flower with --engine flower)",
                       usage="tafl train --out DIR [--config FILE.yaml] [--resume | --force] [FLAG VALUE ...]",
                       description="Train a model over simulated or real federated clients. Every setting of "
                                   "configs/*.yaml is also a flag below; flags override the file.")
    t.add_argument("--config", help="YAML run configuration (configs/*.yaml)")
    t.add_argument("--out", required=True, help="run folder: checkpoints, final.pt, report.{json,md}, accuracy.png")
    t.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint, with its "
                   "own configuration (run.json); flags given beside it must match the run, but --rounds may grow")
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


def _package_verbs(sub) -> None:
    """export, keys, packages: making and listing model packages."""
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
    xp.add_argument("--domain", metavar="KEY=VALUE", action="append", default=[],
                    help="the input domain beside what the training data say, repeatable: modality=XC,DMS | "
                         "sop-class=NAME_OR_UID,... | colour=colour|greyscale (KEY=any: decides nothing) | "
                         "detector=off (no learned in-domain score: every image gets a label). A DICOM whose header "
                         "contradicts it is refused before the model runs (default: none, only what the training data "
                         "say, and the detector training fitted)")
    xp.add_argument("--coverage", type=float, default=0.9, metavar="LEVEL",
                    help="the prediction set's coverage in every answer: the true class is in the set for at least "
                         "this share of each class's images (default 0.9; 0.8 and 0.95 are kept too, for a request's "
                         "coverage option)")
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


def _client_verbs(sub) -> None:
    """predict, validate, score: a client of a running service, or of a package in-process."""
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
    pr.add_argument("--label-outside-domain", action="store_true",
                    help="show the label even for an image the model's in-domain detector puts outside its domain, "
                         "marked (default: off: the model abstains and says why)")
    pr.add_argument("--site", metavar="NAME", help="a training site whose own thresholds make the prediction set "
                                                   "(default: the service's)")
    pr.add_argument("--coverage", metavar="LEVEL",
                    help="the prediction set's coverage, one of the package's levels (default: the one chosen at "
                         "export, usually 0.9)")
    pr.set_defaults(func=cmd_predict)

    va = sub.add_parser("validate", help="validate a package on this site's own labelled images: one HTML report "
                                         "(and its JSON) a review board can file, and a verdict on acceptance "
                                         "criteria (exit 0 pass, 1 fail, 2 could not run)")
    va.add_argument("package", help="the model package folder")
    va.add_argument("data", nargs="?", help="the folder the labelled images lie in (or --dicomweb)")
    va.add_argument("--dicomweb", metavar="URL", help="validate on a PACS's studies over DICOMweb instead of a folder "
                                                      "(the labels name instances by SOP Instance UID; default: none)")
    va.add_argument("--study", action="append", default=[], metavar="UID",
                    help="with --dicomweb: a study to validate on (repeat it; default: none)")
    va.add_argument("--labels", required=True, metavar="CSV",
                    help="one row per image: its path under DATA (an id without suffix finds .png, .jpg, .dcm) and "
                         "its true class")
    va.add_argument("--path-column", default="path", help="the CSV column of the image paths (default path)")
    va.add_argument("--label-column", default="label", help="the CSV column of the true classes (default label)")
    va.add_argument("--require", action="append", default=[], metavar="CRITERION",
                    help="an acceptance criterion, judged on the 95%% interval, such as 'sensitivity(mel)>=0.8' or "
                         "'balanced_accuracy>=0.6' (repeat it; default: none)")
    va.add_argument("--criteria", metavar="YAML", help="a file of criteria kept beside the package (a list, or "
                                                       "require: [...]; default: none)")
    va.add_argument("--out", required=True, metavar="DIR", help="folder for validation.html and validation.json")
    va.add_argument("--batch-size", type=int, default=64, help="images per ONNX Runtime call (default 64)")
    va.set_defaults(func=cmd_validate)

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
    sc.add_argument("--not-assessed-sr", action="store_true",
                    help="with --dicom-out or --store-sr: an image outside the model's domain gets an SR that says "
                         "'not assessed: outside the model's domain' (default: no SR for it; its row has "
                         "in_domain false and no label)")
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


def _retrain_verb(sub) -> None:
    """retrain: continue from a package's checkpoint."""
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


def _service_verbs(sub) -> None:
    """serve, dicom-listen: the long-running services."""
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
    sv.add_argument("--site", metavar="NAME", help="the training site this service answers for: its prediction sets "
                    "use that site's own thresholds (default $TAFL_SITE; unset: the federation's)")
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
    dl.add_argument("--not-assessed-sr", action="store_true",
                    help="an image outside the model's domain gets an SR that says 'not assessed: outside the model's "
                         "domain' (default: no SR; the instance goes to the spool's failed/ with the reason)")
    dl.add_argument("--max-queue", type=int, default=1000,
                    help="instances waiting in the spool before C-STOREs are refused with 0xA700 (a sender may not "
                         "retry: Orthanc does not); default 1000, about 0.5 GB of CT slices on disk")
    dl.add_argument("--workers", type=int, default=2, help="classifying threads (each with its own association "
                                                           "to --dest; default 2)")
    dl.add_argument("--drain-seconds", type=float, metavar="S",
                    help="on SIGTERM or SIGINT: finish what the spool holds for up to S s, then stop (what is left "
                         "stays for the next start; a second signal stops at once; default 25)")
    dl.set_defaults(func=cmd_dicom_listen)


def _demo_verb(sub) -> None:
    """demo: the whole path on the embedded data."""
    d = sub.add_parser("demo", help="train GTAFL on the embedded digits, export, serve and call the service")
    d.add_argument("--out", default="runs/demo", help="demo folder (default runs/demo)")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    d.add_argument("--no-serve", action="store_true", help="stop after training and export")
    d.add_argument("--port", type=int, help="service port (default 3000, or a free one)")
    d.add_argument("--serve-seconds", type=float, metavar="S",
                   help="serve for S seconds, then stop (default: until Ctrl-C or SIGTERM)")
    d.set_defaults(func=cmd_demo)
