"""The shape of the code a newcomer reads: no import cycle inside tafl (imports inside functions count), no module
over MAX_MODULE_LINES lines and no function over MAX_FUNCTION_LINES. Each rule is checked against a planted offender,
so a rule that sees nothing fails too. (The import direction, the environment read only in the settings modules and
package metadata read by attribute are tests/test_layers.py's rules.)"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.serving.test_structure import cycles
from tests.test_layers import ROOT, _module_name

MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 100


def modules() -> list[Path]:
    return sorted(ROOT.rglob("*.py"))


def imports_of(tree: ast.AST, here: str, names: set[str]) -> set[str]:
    """The modules of `names` that a module's tree imports, at any depth (function bodies included): `import a.b`
    and `from a.b import c` name a.b, and a.b.c too where that is a module; a package's own __init__, met on the
    way to its modules, is no edge of the code's making."""
    deps = set()
    for node in ast.walk(tree):
        found = []
        if isinstance(node, ast.Import):
            found = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        for mod in found:
            while mod and mod not in names:
                mod = mod.rsplit(".", 1)[0] if "." in mod else ""
            if mod and mod != here and not here.startswith(mod + "."):
                deps.add(mod)
    return deps


def graph() -> dict[str, set[str]]:
    """Module -> the tafl modules it imports."""
    paths = {_module_name(p): p for p in modules()}
    return {name: imports_of(ast.parse(p.read_text(), str(p)), name, set(paths)) for name, p in paths.items()}


def long_functions(src: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    return [f"{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(ast.parse(src))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > limit]


def test_no_import_cycle_inside_tafl():
    g = graph()
    assert "tafl.serving.app" in g and g["tafl.serving.app"]  # the graph is really read
    assert cycles(g) == []


def test_the_cycle_rule_sees_a_planted_offender():
    names = {"tafl.a", "tafl.b", "tafl.c"}
    sources = {"tafl.a": "def f():\n    from tafl.b import g\n",  # an import inside a function is an edge
               "tafl.b": "import tafl.a.x\n", "tafl.c": "from tafl import a\n"}
    planted = {n: imports_of(ast.parse(src), n, names) for n, src in sources.items()}
    assert planted == {"tafl.a": {"tafl.b"}, "tafl.b": {"tafl.a"}, "tafl.c": {"tafl.a"}}
    assert cycles(planted) == [["tafl.a", "tafl.b", "tafl.a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_is_over_the_limit():
    big = [f"{_module_name(p)} ({n} lines)" for p in modules()
           if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert big == []


def test_no_function_is_over_the_limit():
    long = [f"{_module_name(p)}.{f}" for p in modules() for f in long_functions(p.read_text())]
    assert long == []


def test_the_function_rule_sees_a_planted_offender():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"def f():\n{body}\n") == [f"f ({MAX_FUNCTION_LINES + 1} lines)"]
    assert long_functions("def g():\n    return 1\n") == []
