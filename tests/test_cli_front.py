"""The front door of the `tafl` command: help on every flag, choices from the one registry, a mistyped flag answered
with its verb's usage and the closest flag, and one `tafl: error:` line (exit 2, no traceback) for the failures a
user causes. Nothing here trains or needs torch, so it runs on the deployment install too."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from tafl.cli import build_parser, main

TAFL = [sys.executable, "-m", "tafl.cli"]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*TAFL, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def one_error_line(res: subprocess.CompletedProcess, pattern: str, status: int = 2) -> str:
    assert res.returncode == status, (res.returncode, res.stdout[-1000:], res.stderr[-2000:])
    assert "Traceback" not in res.stderr, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("tafl: error:")]
    assert len(errors) == 1 and pattern in errors[0], res.stderr
    return errors[0]


def leaf_parsers(parser: argparse.ArgumentParser, prefix: str = "tafl"):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield prefix, parser
        return
    for name, sub in subs[0].choices.items():
        yield from leaf_parsers(sub, f"{prefix} {name}")


VERBS = sorted(name for name, _ in leaf_parsers(build_parser()))


def test_every_verb_is_reached():
    assert {"tafl train", "tafl serve", "tafl predict", "tafl score", "tafl export", "tafl demo", "tafl keys new",
            "tafl packages list", "tafl dicom-listen", "tafl retrain", "tafl eval", "tafl explain",
            "tafl compare"} <= set(VERBS)


@pytest.mark.parametrize("verb", VERBS)
def test_every_flag_of_every_verb_has_help_and_its_default(verb):
    parser = dict(leaf_parsers(build_parser()))[verb]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help and len(action.help) > 8, f"{verb} {name} has no help"
        default = action.default
        if action.option_strings and default not in (None, False, argparse.SUPPRESS):
            assert "default" in action.help, f"{verb} {name}: the help does not give the default {default!r}"
    text = parser.format_help()  # every help formats (a stray % would raise here)
    assert text.startswith("usage: " + verb)


def test_train_flags_take_their_help_from_the_config_fields_comments():
    from tafl.training.config import choices, field_docs, flat_keys

    docs = field_docs()
    fields = set(flat_keys())  # the shared settings and every method's
    assert set(docs) == fields and all(docs.values()), sorted(fields - {k for k, v in docs.items() if v})
    assert docs["imbalance_factor"].startswith("IF of the exponential long tail")
    assert "pseudo-images" in docs["prior_smoothing"]  # a comment of several lines above its field
    assert "---" not in " ".join(docs.values())  # section headers belong to no field
    train = dict(leaf_parsers(build_parser()))["tafl train"]
    by_dest = {a.dest: a for a in train._actions}
    for name in fields:
        assert docs[name].replace("%", "%%") in by_dest[name].help
    for name, allowed in choices().items():
        assert tuple(by_dest[name].choices) == tuple(allowed), name
    from tafl.training.methods import method_names

    assert tuple(by_dest["method"].choices) == method_names()  # methods come from the one registry
    assert "(default: 50.0)" in by_dest["imbalance_factor"].help and "(default: on)" in by_dest["augment"].help
    # --help groups the settings by method: each method's own after the shared ones
    groups = {g.title: {act.dest for act in g._group_actions} for g in train._action_groups}
    of = "settings of method {} (ignored by the other methods)".format
    assert {"gff_m", "vote", "simclr_steps"} <= groups[of("creff and gtafl")]
    assert {"gamma_init", "dafl_scale"} <= groups[of("dafl")]
    assert groups[of("fedavg and fedprox")] == {"mu", "local_adjust"}
    shared = next(v for k, v in groups.items() if k.startswith("run configuration"))
    assert {"lr", "rounds", "simclr_pool"} <= shared and not {"gff_m", "mu", "loss"} & shared


def test_a_bad_choice_names_the_allowed_values(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--out", "x", "--vote", "majority"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'majority'" in err and "'hard', 'soft', 'confidence', 'learned'" in err


@pytest.mark.parametrize("argv,verb,suggestion", [
    (["train", "--out", "x", "--metod", "gtafl"], "tafl train", "--method"),
    (["train", "--otu", "x"], "tafl train", "--out"),  # not hidden behind "required: --out"
    (["serve", "pkg", "--prot", "3000"], "tafl serve", "--port"),
    (["keys", "new", "--otu", "k"], "tafl keys new", "--out"),
    (["score", "dir", "--out", "r.csv", "--package", "p", "--batchsize", "3"], "tafl score", "--batch-size"),
])
def test_a_mistyped_flag_prints_its_verbs_usage_and_the_closest_flag(capsys, argv, verb, suggestion):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: " + verb), err
    assert f"did you mean {suggestion}?" in err and "unrecognized arguments" in err


def test_a_url_without_scheme_is_one_line_for_predict_and_score(tmp_path):
    img = tmp_path / "x.png"
    img.write_bytes(b"\x89PNG\r\n\x1a\n")
    one_error_line(run("predict", str(img), "--url", "127.0.0.1:3150"), "needs http:// or https:// in front, e.g. "
                                                                         "http://127.0.0.1:3150")
    one_error_line(run("score", str(tmp_path), "--out", str(tmp_path / "r.csv"), "--url", "127.0.0.1:3150"),
                   "http://127.0.0.1:3150")


def test_an_unreachable_service_is_one_line_that_says_what_to_check(tmp_path):
    from tafl.procs import free_port

    img = tmp_path / "x.png"
    img.write_bytes(b"\x89PNG\r\n\x1a\n")
    line = one_error_line(run("predict", str(img), "--url", f"http://127.0.0.1:{free_port()}"), "cannot reach")
    assert "is the service running there?" in line


def test_missing_files_are_one_line_each(tmp_path):
    one_error_line(run("packages", "list", str(tmp_path / "nope")), "nope")
    one_error_line(run("score", str(tmp_path / "nope"), "--out", str(tmp_path / "r.csv"), "--package",
                       str(tmp_path / "pkg")), "nope")


def test_verbose_shows_the_traceback_behind_an_error(tmp_path):
    res = run("-v", "predict", "x.png", "--url", "127.0.0.1:1")
    assert res.returncode == 2 and "Traceback" in res.stderr and "tafl: error:" in res.stderr


# every verb, given a mistake that leaves it nothing to do: exit 2 and one `tafl: error:` line (the README's
# sentence on exit status; without torch the training verbs fail the same way, naming the train extra)
NOTHING_TO_DO = {
    "tafl train": ["train", "--out", "o", "--config", "missing.yaml"],
    "tafl eval": ["eval", "missing.pt"],
    "tafl compare": ["compare", "no-run"],
    "tafl explain": ["explain", "missing.pt", "x.png"],
    "tafl export": ["export", "missing.pt", "--out", "pkg"],
    "tafl keys new": ["keys", "new", "--out", "a-file"],
    "tafl packages list": ["packages", "list", "empty"],
    "tafl predict": ["predict", "x.png", "--url", "http://127.0.0.1:3000/predict"],
    "tafl score": ["score", "empty", "--out", "r.csv", "--package", "pkg"],
    "tafl validate": ["validate", "no-pkg", "empty", "--labels", "l.csv", "--out", "o"],
    "tafl retrain": ["retrain", "--from", "no-pkg"],
    "tafl serve": ["serve", "no-pkg", "--port", "1"],
    "tafl dicom-listen": ["dicom-listen", "--package", "no-pkg", "--out-dir", "srs"],
    "tafl demo": ["demo", "--out", "a-file/demo"],
}


def test_every_verb_has_its_nothing_to_do_case():
    assert set(NOTHING_TO_DO) == set(VERBS)


@pytest.mark.parametrize("verb", sorted(NOTHING_TO_DO))
def test_every_verb_exits_2_when_nothing_could_be_done(tmp_path, verb):
    (tmp_path / "empty").mkdir()
    (tmp_path / "a-file").write_text("")
    (tmp_path / "x.png").write_text("not an image")
    res = subprocess.run([*TAFL, *NOTHING_TO_DO[verb]], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         stdin=subprocess.DEVNULL)
    one_error_line(res, "")
    assert not (tmp_path / "o").exists() and not (tmp_path / "pkg").exists()


def test_a_url_that_names_a_route_says_to_give_the_root(tmp_path):
    img = tmp_path / "x.png"
    img.write_bytes(b"\x89PNG\r\n\x1a\n")
    for url, root in (("http://127.0.0.1:3150/predict", "http://127.0.0.1:3150"),
                      ("http://host:3000/tafl/predict/batch/", "http://host:3000/tafl"),
                      ("http://host:3000/v2/models/derm/infer", "http://host:3000")):
        one_error_line(run("predict", str(img), "--url", url), f"give the service's root, {root} ")
    one_error_line(run("score", str(tmp_path), "--out", str(tmp_path / "r.csv"), "--url",
                       "http://127.0.0.1:3150/models"), "give the service's root, http://127.0.0.1:3150 ")


def test_a_url_that_is_not_a_tafl_service_says_what_the_url_must_be(tmp_path):
    """A real HTTP server that is not tafl (a proxy's other site, a wrong port): its bare 404 is explained."""
    import http.server
    import threading

    img = tmp_path / "x.png"
    img.write_bytes(b"\x89PNG\r\n\x1a\n")
    class NotTafl(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # what BentoML or a proxy says for a path it does not have
            self.send_response(404)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", "9")
            self.end_headers()
            self.wfile.write(b"Not Found")

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotTafl)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/tafl"
        line = one_error_line(run("predict", str(img), "--url", url), "must be the service's root")
        assert f"{url}/predict answered 404 Not Found" in line, line
    finally:
        httpd.shutdown()


def test_help_and_top_level_usage_name_the_demo():
    res = run("--help")
    assert res.returncode == 0 and "tafl demo" in res.stdout
    res = run("train", "--help")
    assert res.returncode == 0 and "--imbalance-factor FLOAT" in res.stdout and "IF of the exponential" in res.stdout


def test_a_training_verb_without_the_training_stack_names_the_extra(monkeypatch, capsys):
    """On a deployment install (`pip install tafl`, no torch) `tafl train` says which extra to install."""
    import tafl.cli

    def no_torch(ns):
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    monkeypatch.setattr(tafl.cli, "cmd_train", no_torch)
    parser = build_parser
    monkeypatch.setattr(tafl.cli, "build_parser", lambda: _with_train(parser(), no_torch))
    assert main(["train", "--out", "x"]) == 2
    err = capsys.readouterr().err
    assert "tafl train needs the training stack" in err and "pip install 'tafl[train]'" in err


def _with_train(parser: argparse.ArgumentParser, func) -> argparse.ArgumentParser:
    dict(leaf_parsers(parser))["tafl train"].set_defaults(func=func)
    return parser


@pytest.mark.skipif(__import__("importlib").util.find_spec("torch") is not None,
                    reason="torch is installed: the deployment install (no torch) is what this checks")
@pytest.mark.parametrize("argv", [["train", "--config", "configs/smoke.yaml", "--out", "{tmp}/run"],
                                  ["demo", "--out", "{tmp}/demo"],
                                  ["export", "{tmp}/final.pt", "--out", "{tmp}/pkg"]])
def test_without_torch_training_verbs_say_which_extra_to_install(tmp_path, argv):
    repo = Path(__file__).resolve().parents[1]
    res = subprocess.run([*TAFL, *(a.format(tmp=tmp_path) for a in argv)], capture_output=True, text=True,
                         timeout=120, cwd=repo, stdin=subprocess.DEVNULL)
    one_error_line(res, "pip install 'tafl[train]'")
    assert not (tmp_path / "run").exists()
