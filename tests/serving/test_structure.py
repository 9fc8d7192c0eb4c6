"""The serving layer's shape (issue 36), read from its source: no module-level mutable state in tafl/serving (the
routes share one ServingState on the app), no import circle inside tafl/serving, and no `_private` name imported
across tafl's modules. Each rule is also run on a planted offender, so a rule that stopped seeing would fail."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TAFL = Path(__file__).resolve().parents[2] / "tafl"
SERVING = TAFL / "serving"

# module-level values that are state by design, each with its reason
ALLOWED_CALLS = {
    "logging.getLogger": "loggers are process-wide by logging's design",
    "re.compile": "a compiled pattern is immutable",
    "MappingProxyType": "a read-only view",
    "frozenset": "immutable",
    "tuple": "immutable",
    "create_app": "the ASGI app BentoML mounts: fixed routes; its state.tafl is the worker's ServingState",
    "bentoml.metrics.Counter": "Prometheus instruments are process-wide; the service declares them once",
    "bentoml.metrics.Gauge": "Prometheus instruments are process-wide; the service declares them once",
    "max_concurrency": "an int read once from the environment",
    "service_workers": "an int read once from the environment",
    "service_plan": "a frozen dataclass chosen once at start (tafl.serving.tuning.Plan), handed to the workers",
    "heatmap_legend": "the page's colour legend: an SVG string (Markup, a str)",
}
IMMUTABLE_NODES = (ast.Constant, ast.Tuple, ast.BinOp, ast.JoinedStr, ast.UnaryOp)


def _call_name(node: ast.Call) -> str:
    f = node.func
    parts = []
    while isinstance(f, ast.Attribute):
        parts.append(f.attr)
        f = f.value
    if isinstance(f, ast.Name):
        parts.append(f.id)
    return ".".join(reversed(parts))


def module_state(source: str) -> list[str]:
    """The module-level bindings of `source` that hold mutable state, and every `global` statement."""
    tree = ast.parse(source)
    found = []
    body = list(tree.body)
    while body:
        node = body.pop(0)
        if isinstance(node, (ast.If, ast.Try)):  # module-level blocks bind module names too
            body[:0] = node.body + getattr(node, "orelse", []) + [s for h in getattr(node, "handlers", [])
                                                                  for s in h.body]
            continue
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        for t in targets:
            names = [t.id] if isinstance(t, ast.Name) else [e.id for e in getattr(t, "elts", []) if isinstance(e, ast.Name)]
            for name in names:
                if name == "__all__" or isinstance(value, IMMUTABLE_NODES):
                    continue
                constant = name.isupper()
                if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
                    if not constant:  # an UPPER_CASE literal table is a constant by convention (schemas, headers)
                        found.append(f"{name} (a mutable {type(value).__name__.lower()})")
                elif isinstance(value, ast.Call):
                    if _call_name(value) not in ALLOWED_CALLS:
                        found.append(f"{name} = {_call_name(value)}(...)")
                elif isinstance(value, ast.Name) and not constant:
                    found.append(f"{name} = {value.id}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.append(f"global {', '.join(node.names)}")
    return found


def serving_imports(path: Path) -> set[str]:
    """The tafl.serving modules `path` imports, at any depth (function-level imports count)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "tafl.serving":
                out |= {f"tafl.serving.{a.name}" for a in node.names}
            elif node.module.startswith("tafl.serving."):
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("tafl.serving.")}
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(n: str, stack: list[str]) -> None:
        state[n] = 1
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                found.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m, stack + [m])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    return found


def private_imports(source: str) -> list[str]:
    return [f"from {n.module} import {a.name}" for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("tafl")
            for a in n.names if a.name.startswith("_") and not a.name.startswith("__")]


def _modules(folder: Path):
    return sorted(p for p in folder.rglob("*.py"))


@pytest.mark.parametrize("path", _modules(SERVING), ids=lambda p: p.name)
def test_no_module_level_mutable_state_in_serving(path):
    assert module_state(path.read_text()) == []


def test_the_state_rule_sees_a_planted_offender():
    src = ("import logging\nlog = logging.getLogger('x')\nLIMITS = {'a': 1}\nstate = State()\n_cache: dict = {}\n"
           "if True:\n    registry = []\ndef f():\n    global _cache\n")
    assert module_state(src) == ["state = State(...)", "_cache (a mutable dict)", "registry (a mutable list)",
                                 "global _cache"]


def test_no_import_circle_inside_serving():
    graph = {f"tafl.serving.{p.stem}": serving_imports(p) for p in _modules(SERVING) if p.stem != "__init__"}
    assert "tafl.serving.app" in graph and graph["tafl.serving.app"]  # the graph is really read
    assert cycles(graph) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


@pytest.mark.parametrize("path", _modules(TAFL), ids=lambda p: str(p.relative_to(TAFL)))
def test_no_private_name_is_imported_across_modules(path):
    assert private_imports(path.read_text()) == []


def test_the_private_rule_sees_a_planted_offender():
    assert private_imports("from tafl.serving.app import _frame_result, Settings\nfrom os import _exit\n") == [
        "from tafl.serving.app import _frame_result"]


def test_the_routes_reach_their_state_through_the_request():
    """The page, the REST routes and the OIP routes take the worker's ServingState from the app, not a module."""
    for name in ("app.py", "ui.py", "oip.py", "routing.py"):
        src = (SERVING / name).read_text()
        assert "state = State()" not in src and "api.state" not in src
    assert "of(request)" in (SERVING / "routing.py").read_text()
