"""RunConfig holds no method rule (issue 52): a comparison of `method` with a particular method's name inside
class RunConfig is a rule that belongs in that method's own config (tafl.training.contract.MethodConfig). The rule
also runs on a planted offender, so a rule that stopped seeing would fail. The tafl-wide rules (no import circle,
short modules and functions, the environment read in the settings modules) are tests/test_shape.py."""

from __future__ import annotations

import ast
from pathlib import Path

TRAINING = Path(__file__).resolve().parents[2] / "tafl" / "training"


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
