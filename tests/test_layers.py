"""Imports run one way. Walks every module of the package with `ast` (function-level imports too)
and fails on an edge that runs against the layering:

    cli                                   on top: may import anything
    clients    -> packaging (in-process scoring), the leaves
    serving    -> packaging, the leaves
    packaging  -> training (export.py only: it needs the model), the leaves
    training   -> the leaves
    leaves     tafl.errors, tafl.files, tafl.procs, tafl.prior, tafl.privacy_text, tafl.imaging, tafl.conformal,
               tafl.intervals: each other only
"""

from __future__ import annotations

import ast
from pathlib import Path

import tafl

ROOT = Path(tafl.__file__).resolve().parent
LEAVES = {"errors", "files", "procs", "prior", "privacy_text", "settings", "imaging", "conformal", "intervals",
          "__init__", "__main__"}
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


# ------------------------------------------------------------------ package metadata is read by attribute
# A package's metadata is typed (tafl.packaging.metadata.PackageMetadata): its parts cannot be read by string key.
# What can is raw JSON: metadata.json's text, the `.metadata` dict a package keeps for GET /models, the /models
# answer's "metadata", and a record's `.fields` / `.to_json()`. So the rule follows those, and what is bound from
# them, to any string-key read (`x["prior"]`, `x.get("prior")`, `"prior" in x`) outside the schema module.
SCHEMA_MODULE = "tafl/packaging/metadata.py"
META_NAMES = {"meta", "metadata"}  # a name or attribute so called is package metadata ...
NOT_PACKAGE_META = {  # ... except in these folders, each with the reason
    "tafl/training/": "a checkpoint's state.meta (the round state), not a package's metadata",
    "tafl/imaging/": "pydicom's file meta and decoder info (dicom_sr.py, which reads a package's, is checked)",
}
META_KEYS = {"metadata", "metadata.json"}  # a value read under these keys, or from that file, is raw metadata
RAW_METADATA_OK = {  # where the raw `.metadata` dict may be used, with the reason
    "tafl/packaging/package.py": "ModelPackage keeps it; `tafl list` hands it to metadata.listing",
    "tafl/serving/runtime.py": "GET /models returns metadata.json as written",
}


def _is_meta(node: ast.AST, tainted: set[str]) -> bool:
    """`node` is package metadata or a part of it: `meta`, `x.metadata`, `meta.prior`, `meta.get("prior") or {}`,
    `rec.fields`, `rec.to_json()`, `served["metadata"]`, `json.loads(... "metadata.json" ...)`, or a name bound
    to one of them."""
    if isinstance(node, ast.BoolOp):
        return any(_is_meta(v, tainted) for v in node.values)
    if isinstance(node, ast.IfExp):
        return _is_meta(node.body, tainted) or _is_meta(node.orelse, tainted)
    if isinstance(node, ast.Await):
        return _is_meta(node.value, tainted)
    if isinstance(node, ast.Name):
        return node.id in META_NAMES or node.id in tainted
    if isinstance(node, ast.Attribute):
        return node.attr in META_NAMES | {"fields"} or _is_meta(node.value, tainted)
    if isinstance(node, ast.Subscript):
        key = node.slice
        return (isinstance(key, ast.Constant) and key.value in META_KEYS) or _is_meta(node.value, tainted)
    if isinstance(node, ast.Call):
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in ("get", "to_json", "items", "values", "copy"):
            return _is_meta(f.value, tainted)
        return any(isinstance(n, ast.Constant) and n.value in META_KEYS for n in ast.walk(node))
    return False


def _own_nodes(scope: ast.AST):
    """The nodes of a module or function, without the bodies of the functions and classes inside it."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        n = todo.pop()
        yield n
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(n))


def _bound_names(target: ast.AST) -> list[str]:
    """The names an assignment binds (`x`, `x, y`); not `self.x` or `d[k]`, which bind no name."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [name for e in target.elts for name in _bound_names(e)]
    if isinstance(target, ast.Starred):
        return _bound_names(target.value)
    return []


def _string_key_read(node: ast.AST) -> ast.AST | None:
    """The object `node` reads a constant string key of, or None."""
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and isinstance(node.slice, ast.Constant) \
            and isinstance(node.slice.value, str):
        return node.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "pop") \
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
        return node.func.value
    if isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) and isinstance(node.left.value, str) \
            and isinstance(node.ops[0], (ast.In, ast.NotIn)):
        return node.comparators[0]
    return None


def metadata_key_reads(source: str) -> list[str]:
    """'line: code' for each string-key read of package metadata in `source`; in each function (and the module) a
    name bound to metadata or a part of it (=, :=, a tuple) is metadata too."""
    tree = ast.parse(source)
    found: set[tuple[int, str]] = set()
    scopes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for scope in scopes:
        nodes = list(_own_nodes(scope))
        binds = [n for n in nodes if isinstance(n, (ast.Assign, ast.AnnAssign, ast.NamedExpr))]
        tainted: set[str] = set()
        for _ in range(len(binds) + 1):  # until nothing new is bound to metadata (a chain of aliases)
            before = len(tainted)
            for b in binds:
                targets = b.targets if isinstance(b, ast.Assign) else [b.target]
                if b.value is not None and _is_meta(b.value, tainted):
                    tainted.update(name for t in targets for name in _bound_names(t))
            if len(tainted) == before:
                break
        for n in nodes:
            obj = _string_key_read(n)
            if obj is not None and _is_meta(obj, tainted):
                found.add((n.lineno, ast.unparse(n)[:80]))
    return [f"{line}: {code}" for line, code in sorted(found)]


def raw_metadata_uses(source: str) -> list[str]:
    """'line: code' for each use of a package's raw `.metadata` dict in `source`."""
    return [f"{n.lineno}: {ast.unparse(n)[:80]}" for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Attribute) and n.attr == "metadata"]


def _tafl_files() -> dict[str, str]:
    return {path.relative_to(ROOT.parent).as_posix(): path.read_text() for path in sorted(ROOT.rglob("*.py"))}


def _checked(rel: str) -> bool:
    if rel == SCHEMA_MODULE:
        return False
    return not any(rel.startswith(folder) for folder in NOT_PACKAGE_META) or rel == "tafl/imaging/dicom_sr.py"


def test_package_metadata_is_read_by_attribute_outside_the_schema_module():
    found = {}
    for rel, text in _tafl_files().items():
        hits = (metadata_key_reads(text) + ([] if rel in RAW_METADATA_OK else raw_metadata_uses(text))
                if _checked(rel) else [])
        if hits:
            found[rel] = hits
    wrong = {rel: hits for rel, hits in found.items()}
    assert not wrong, "package metadata read by string key (use pkg.meta's attributes):\n" + "\n".join(
        f"{rel}:{hit}" for rel, hits in wrong.items() for hit in hits)


def test_the_metadata_rule_sees_string_key_reads_through_aliases():
    planted = '''
def f(pkg, served, folder, k):
    a = pkg.metadata["name"]
    b = pkg.meta.metrics.fields.get("source")
    if "prior" in pkg.metadata:
        pass
    prior = pkg.metadata.get("prior") or {}
    c = prior["source_prior"]
    raw = json.loads((folder / "metadata.json").read_text())
    d = raw["class_names"]
    e = served["metadata"]["version"]
    rec = pkg.meta.privacy.to_json()
    g = rec["epsilon"]
'''
    lines = [int(hit.split(":")[0]) for hit in metadata_key_reads(planted)]
    assert lines == [3, 4, 5, 7, 8, 10, 11, 13]
    clean = '''
def f(pkg, out, k, models, name):
    a = pkg.meta.prior.source_prior
    b = pkg.meta.metrics.accuracy.get(k)
    c = out["label"]
    served = next(m for m in models if m["name"] == name)
    d = {"metadata": 1}
'''
    assert metadata_key_reads(clean) == []
    assert raw_metadata_uses("x = pkg.metadata\ny = pkg.meta.name\n") == ["1: pkg.metadata"]


# ------------------------------------------------------------------ settings come from the settings modules
SETTINGS_MODULES = {"tafl/settings.py", "tafl/serving/settings.py"}


def environment_reads(source: str) -> list[str]:
    """'line: code' for each use of `os.environ`, `os.getenv` or `environ` imported from os in `source`."""
    out = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "os" \
                and n.attr in ("environ", "getenv", "putenv", "environb"):
            out.append(f"{n.lineno}: {ast.unparse(n)}")
        elif isinstance(n, ast.ImportFrom) and n.module == "os" and any(a.name in ("environ", "getenv")
                                                                        for a in n.names):
            out.append(f"{n.lineno}: from os import ...")
    return sorted(out, key=lambda hit: int(hit.split(":")[0]))


def test_the_environment_is_read_in_the_settings_modules_only():
    found = {rel: hits for rel, text in _tafl_files().items()
             if rel not in SETTINGS_MODULES and (hits := environment_reads(text))}
    wrong = {rel: hits for rel, hits in found.items()}
    assert not wrong, "os.environ outside tafl/settings.py and tafl/serving/settings.py (add a function there):\n" + \
        "\n".join(f"{rel}:{hit}" for rel, hits in wrong.items() for hit in hits)


def test_the_environment_rule_sees_every_way_in():
    planted = "import os\nfrom os import environ\na = os.environ.get('X')\nb = os.getenv('Y')\nc = dict(os.environ)\n"
    assert [int(h.split(":")[0]) for h in environment_reads(planted)] == [2, 3, 4, 5]
    assert environment_reads("import os\np = os.path.join('a', 'b')\n") == []

