"""The `tafl` command: one verb per job, each a thin call into a component.

Every run setting is also a flag (`--local-epochs 2`), so a YAML config and the command
line share one vocabulary; flags override the file. Errors a user can cause print one line
(`tafl: error: ...`) and exit 2; Ctrl-C exits 130 and says how to resume.

Exit status, the same for every verb (README, "Verbs"): 0 when everything asked was done; 1 when some inputs were
answered and others not (`predict`, `score`, `packages list`: each failure is reported beside the answers); 2 when
nothing could be done (a mistake to fix: a bad flag, file, config or URL, a service that cannot be reached, or no
input answered at all); 130 after Ctrl-C.

The parts: `parser` (the verbs and their flags), `flags` (run settings as flags), `training` (train, eval, retrain,
compare, explain, demo), `deploy` (export, keys, packages, serve, predict, score, dicom-listen); `python -m tafl.cli`
runs `main`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from tafl.cli.deploy import (cmd_dicom_listen, cmd_export, cmd_keys_new, cmd_packages_list,  # noqa: F401  (the verbs)
                             cmd_predict, cmd_score, cmd_serve, outcome)
from tafl.cli.flags import add_config_flags, config_overrides  # noqa: F401
from tafl.cli.parser import build_parser
from tafl.cli.training import (DEMO_CONFIG, cmd_compare, cmd_demo, cmd_eval, cmd_explain,  # noqa: F401
                               cmd_retrain, cmd_train)
from tafl.errors import ServiceCallError, TaflError

log = logging.getLogger("tafl.cli")

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
