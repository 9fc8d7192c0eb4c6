"""The README is for users: its quick start fits a screen, no paragraph runs past 8 lines, every link resolves,
and its recipes run as written. The shell blocks marked `<!-- readme-test -->` (the ones that claim to run in
seconds to a minute) are executed in order in a fresh folder that holds only the repository's configs/, the way
a stranger's clone runs them; the block marked `<!-- readme-test: serve -->` is started in the background and
the later blocks talk to it. Port 3000 becomes a free port."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BLOCK = re.compile(r"<!-- readme-test(?::\s*(\w+))? -->\n```(\w+)\n(.*?)```", re.S)


def blocks() -> list[tuple[str, str, str]]:
    """(kind, language, body) of every marked block: bash, or python run by this interpreter."""
    return [(kind or "run", lang, body) for kind, lang, body in BLOCK.findall(README.read_text())]


def section(text: str, title: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index(title)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def test_the_quick_start_fits_a_screen_and_no_paragraph_runs_past_eight_lines():
    text = README.read_text()
    assert len(section(text, "## Quick start")) <= 30
    paragraph: list[str] = []
    in_code = False
    for line in text.splitlines() + [""]:
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code or line.startswith("|"):
            continue
        if line.strip():
            paragraph.append(line)
            continue
        assert len(paragraph) <= 8, "\n".join(paragraph)
        paragraph = []
    assert max(len(line) for line in text.splitlines() if not line.startswith("|")) <= 120


def test_the_readme_speaks_to_users_and_its_links_resolve():
    text = README.read_text()
    for internal in ("Starlette", ".venv-core", "protobuf", "../shared"):
        assert internal not in text, f"{internal}: CI material belongs in CONTRIBUTING.md"
    for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not link.startswith("http"):
            assert (REPO / link).exists(), link
    assert "tafl demo" in text and '.[train,dev,reference,federated,ray]' in text
    assert len(blocks()) >= 7 and [k for k, _, _ in blocks()].count("serve") == 1
    assert {lang for _, lang, _ in blocks()} == {"bash", "python"}


@pytest.mark.slow
def test_the_readme_recipes_run_as_written(tmp_path):
    pytest.importorskip("torch", reason="the recipes train: the train extra (pip install -e '.[train]')")
    import httpx

    from tafl.procs import free_port, stop_group, wait_http

    work = tmp_path / "clone"
    work.mkdir()
    shutil.copytree(REPO / "configs", work / "configs")
    port = str(free_port())
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "BENTOML_HOME": str(tmp_path / "bentoml"), "TAFL_CACHE": str(tmp_path / "cache")}
    server = None
    try:
        for kind, lang, body in blocks():
            body = body.replace("3000", port)
            if kind == "serve":
                server = subprocess.Popen(["bash", "-c", body], cwd=work, env=env, start_new_session=True,
                                          stdout=open(tmp_path / "serve.log", "w"), stderr=subprocess.STDOUT)
                wait_http(f"http://127.0.0.1:{port}/readyz", timeout=180, proc=server, name="the README's service")
                assert httpx.get(f"http://127.0.0.1:{port}/", timeout=30).status_code == 200
                continue
            cmd = ["bash", "-euo", "pipefail", "-c", body] if lang == "bash" else [sys.executable, "-c", body]
            res = subprocess.run(cmd, cwd=work, env=env, capture_output=True,
                                 text=True, timeout=900)
            assert res.returncode == 0, (body, res.stdout[-2000:], res.stderr[-3000:])
            assert "Traceback" not in res.stderr and "tafl: error" not in res.stderr, (body, res.stderr[-3000:])
        # what the last blocks did: the SR is an SR, and the service now serves the retrained version
        models = httpx.get(f"http://127.0.0.1:{port}/models", timeout=30).json()["models"]
        assert [m["version"] for m in models] == ["1.1.0"], models
        assert (work / "result-sr.dcm").stat().st_size > 0 and (work / "results.csv").is_file()
        written = sorted(p.name + ("/" if p.is_dir() else "") for p in work.iterdir() if p.name != "configs")
        if shutil.which("git") and (REPO / ".git").exists():  # in a clone, git does not show what they wrote
            res = subprocess.run(["git", "check-ignore", "--no-index", *written], cwd=REPO, capture_output=True,
                                 text=True)
            assert sorted(res.stdout.split()) == written, (written, res.stdout, res.stderr)
    finally:
        stop_group(server, 30)  # SIGTERM drains it; what is left of its tree after 30 s is killed
