"""Imports run one way. Walks every module of the package with `ast` (function-level imports too)
and fails on an edge that runs against the layering:

    cli                                   on top: may import anything
    clients    -> packaging (in-process scoring), the leaves
    serving    -> packaging, the leaves
    packaging  -> training (export.py only: it needs the model), the leaves
    training   -> the leaves
    leaves     tafl.errors, tafl.files, tafl.procs, tafl.prior, tafl.privacy_text, tafl.imaging: each other only
"""

from __future__ import annotations

import ast
from pathlib import Path

import tafl

ROOT = Path(tafl.__file__).resolve().parent
LEAVES = {"errors", "files", "procs", "prior", "privacy_text", "settings", "imaging", "__init__", "__main__"}
ALLOWED = {
    "leaf": {"leaf"},
    "training": {"leaf", "training"},
    "packaging": {"leaf", "packaging"},
    "serving": {"leaf", "serving", "packaging"},
    "clients": {"leaf", "clients", "packaging"},
    "cli": {"leaf", "training", "packaging", "serving", "clients", "cli"},
}
# module-specific extra edges, each with its reason
EXTRA = {"tafl.packaging.export": {"training"}}  # export builds the torch model to trace it


def _component(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "tafl":
        raise ValueError(module)
    if len(parts) == 1 or parts[1] in LEAVES:
        return "leaf"
    return parts[1] if parts[1] in ALLOWED else "cli" if parts[1] == "cli" else parts[1]


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), str(path))
    here = _module_name(path)
    package = here if path.name == "__init__.py" else here.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "tafl"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against the package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] == "tafl":
                out.append((mod, node.lineno))
    return out


def edges() -> list[tuple[str, str, int]]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        src = _module_name(path)
        for dst, line in _imports(path):
            found.append((src, dst, line))
    return found


def violations(found: list[tuple[str, str, int]]) -> list[str]:
    wrong = []
    for src, dst, line in found:
        a, b = _component(src), _component(dst)
        allowed = ALLOWED.get(a, set()) | EXTRA.get(src, set())
        if b not in allowed:
            wrong.append(f"{src}:{line} imports {dst} ({a} -> {b})")
    return wrong


def test_imports_run_one_way():
    wrong = violations(edges())
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_the_walk_sees_function_level_and_known_edges():
    found = {(s, d) for s, d, _ in edges()}
    assert ("tafl.packaging.export", "tafl.training.models") in found  # the one allowed upward reach
    assert ("tafl.serving.decoding", "tafl.imaging") in found
    assert any(s.startswith("tafl.cli") and d.startswith("tafl.training") for s, d in found)  # function-level imports


def test_the_rule_rejects_wrong_edges():
    bad = [("tafl.training.flower_local", "tafl.serving.launch", 1), ("tafl.imaging.decode", "tafl.training.data", 2),
           ("tafl.packaging.package", "tafl.training.models", 3), ("tafl.clients.score", "tafl.serving.app", 4),
           ("tafl.serving.app", "tafl.training.simulator", 5)]
    assert len(violations(bad)) == len(bad)
    good = [("tafl.packaging.export", "tafl.training.models", 1), ("tafl.cli", "tafl.serving.launch", 2),
            ("tafl.training.data", "tafl.imaging", 3), ("tafl.serving.runtime", "tafl.packaging.package", 4)]
    assert violations(good) == []
