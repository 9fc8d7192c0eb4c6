"""The training side's shape (issue 52), read from its source: no import circle inside tafl/training (imports inside
functions count), no method rule inside RunConfig (a method's rules live in its own config), the environment read
in the settings modules only, and no module over 800 lines nor function over 100 in tafl/training and tafl/cli.
Each rule also runs on a planted offender, so a rule that stopped seeing would fail."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.serving.test_structure import cycles

TAFL = Path(__file__).resolve().parents[2] / "tafl"
TRAINING = TAFL / "training"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(TAFL.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (TAFL.parent / rel).with_suffix(".py").is_file() or (TAFL.parent / rel / "__init__.py").is_file()


def imports_of(source: str, inside: str) -> set[str]:
    """The modules under `inside` (a dotted prefix) that `source` imports, at any depth: `from a.b import c` names
    a.b and, where c is a module, a.b.c."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names if is_module(f"{node.module}.{a.name}")}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m == inside or m.startswith(inside + ".")}


def training_graph() -> dict[str, set[str]]:
    graph = {}
    for path in sorted(TRAINING.rglob("*.py")):
        name = module_name(path)
        graph[name] = imports_of(path.read_text(), "tafl.training") - {name}
    return graph


def test_no_import_circle_inside_training():
    graph = training_graph()
    assert "tafl.training.contract" in graph["tafl.training.methods.base"]  # the graph is really read
    assert "tafl.training.models" in graph["tafl.training.explain"]  # a function-level import is an edge
    assert cycles(graph) == []


def test_the_import_rule_counts_imports_inside_functions():
    planted = {
        "tafl.training.a": imports_of("def f():\n    from tafl.training.b import g\n", "tafl.training"),
        "tafl.training.b": imports_of("from tafl.training import a\n", "tafl.training"),
    }
    planted["tafl.training.b"] |= {"tafl.training.a"}  # `from tafl.training import a`: a is no file here
    assert cycles(planted) == [["tafl.training.a", "tafl.training.b", "tafl.training.a"]]


def _names_a_method(node: ast.AST) -> bool:
    """A string constant, or a tuple/list/set of them: the name of a particular method."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_names_a_method(e) for e in node.elts)
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def method_comparisons(source: str) -> list[str]:
    """Comparisons of `method` with a particular method's name inside class RunConfig (`self.method == "lda"`,
    `method not in ("fedavg", "fedprox")`): a method's rule, which belongs in its own config
    (tafl.training.contract.MethodConfig). Asking the registry (`self.method in method_names()`) is no rule."""
    found = []
    for cls in ast.walk(ast.parse(source)):
        if not (isinstance(cls, ast.ClassDef) and cls.name == "RunConfig"):
            continue
        for node in ast.walk(cls):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(isinstance(s, ast.Attribute) and s.attr == "method" or isinstance(s, ast.Name)
                       and s.id == "method" for s in sides) and any(_names_a_method(s) for s in sides):
                    found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return sorted(found, key=lambda f: int(f.split()[1].rstrip(":")))


def test_run_config_holds_no_method_rule():
    source = (TRAINING / "config.py").read_text()
    assert "class RunConfig" in source
    assert method_comparisons(source) == []


def test_the_method_rule_sees_a_planted_offender():
    planted = ("class RunConfig:\n    def validate(self):\n        if self.method == 'lda' and x:\n            pass\n"
               "        y = 'head' if self.method not in ('dafl',) else 'all'\n"
               "        z = self.method in method_names()\n"
               "class Other:\n    def f(self):\n        return self.method == 'gtafl'\n")
    assert method_comparisons(planted) == ["line 3: self.method == 'lda'",
                                           "line 5: self.method not in ('dafl',)"]


def environ_reads(source: str) -> list[str]:
    """Every use of os.environ or os.getenv (reading and writing the environment)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv") \
                and isinstance(node.value, ast.Name) and node.value.id == "os":
            found.append(f"line {node.lineno}: os.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "os" \
                and any(a.name in ("environ", "getenv") for a in node.names):
            found.append(f"line {node.lineno}: from os import ...")
    return sorted(found, key=lambda f: int(f.split()[1].rstrip(":")))


SETTINGS_MODULES = {TAFL / "settings.py", TAFL / "serving" / "settings.py"}
ENV_SCOPE = sorted([*TRAINING.rglob("*.py"), *(TAFL / "cli").rglob("*.py")])


@pytest.mark.parametrize("path", ENV_SCOPE, ids=lambda p: str(p.relative_to(TAFL)))
def test_training_and_the_command_line_read_the_environment_through_tafl_settings(path):
    assert path not in SETTINGS_MODULES
    assert environ_reads(path.read_text()) == []


def test_the_environment_rule_sees_a_planted_offender():
    planted = "import os\nfrom os import environ\nx = os.environ.get('A')\ny = os.getenv('B')\n"
    assert environ_reads(planted) == ["line 2: from os import ...", "line 3: os.environ", "line 4: os.getenv"]


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 800, 100
SIZE_SCOPE = sorted([*TRAINING.rglob("*.py"), *(TAFL / "cli").rglob("*.py")])


def too_long(source: str, max_module: int = MAX_MODULE_LINES, max_function: int = MAX_FUNCTION_LINES) -> list[str]:
    """The module itself when it runs past `max_module` lines, and every function (nested ones too) past
    `max_function`: one job each, readable in one sitting."""
    found = []
    lines = len(source.splitlines())
    if lines > max_module:
        found.append(f"module: {lines} lines")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > max_function:
                found.append(f"{node.name} (line {node.lineno}): {n} lines")
    return found


@pytest.mark.parametrize("path", SIZE_SCOPE, ids=lambda p: str(p.relative_to(TAFL)))
def test_modules_and_functions_in_training_and_the_command_line_stay_short(path):
    assert too_long(path.read_text()) == []


def test_the_size_rule_sees_a_planted_offender():
    body = "".join(f"x{i} = {i}\n" for i in range(101))
    indent = lambda text, n: "".join(" " * n + line + "\n" for line in text.splitlines())  # noqa: E731
    planted = (f"def short():\n    return 1\n\n\ndef long():\n{indent(body, 4)}\n\n"
               f"class A:\n    def m(self):\n{indent(body, 8)}")
    assert too_long(planted, max_module=100) == [f"module: {len(planted.splitlines())} lines",
                                                 "long (line 5): 102 lines", "m (line 110): 102 lines"]
