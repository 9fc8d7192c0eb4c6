"""The docs stay navigable: a citation of a doc section names a heading that exists, no section is cited by a bare
§ number, every relative link and its anchor resolve, and a measurement is dated rather than told by who ran it when.

A citation is `docs/results.md, "Serving defaults"` (in the docs also `[results.md](results.md), "Serving
defaults"`; several names: `"A", "B" and "C"`), or a heading anchor (`results.md#serving-defaults-...`). The name is
a heading of that file, its order number (`## 3.`) and backticks aside, or the heading's start up to a colon,
semicolon, comma or parenthesis, and it must name exactly one heading: renumbering or reordering sections never
breaks a citation, and renaming one shows here. Scanned: tafl/, tests/, benchmarks/, configs/, docs/, README.md,
CONTRIBUTING.md and pyproject.toml. `test_the_checker_catches_a_planted_offender` runs the same checks on a small
tree with one offender of each kind.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()

SCANNED_DIRS = ("tafl", "tests", "benchmarks", "configs", "docs")
SCANNED_FILES = ("README.md", "CONTRIBUTING.md", "pyproject.toml")
TEXT_SUFFIXES = {".py", ".sh", ".yaml", ".yml", ".toml", ".md", ".txt", ".html", ".js", ".css", ".cfg"}
SKIPPED_PARTS = {"__pycache__", "out", "node_modules"}  # benchmarks/out: run folders, not sources
# Hand-written docs whose Markdown links (and anchors) must resolve.
LINKED = ("docs/*.md", "README.md", "CONTRIBUTING.md")

# Strings that are output, not comments: a package's metadata (export), report.md and the served OpenAPI document
# carry them, and changing them changes what tafl writes. They name design.md's sections by their order numbers,
# which design.md keeps; the allowance is exact, and each must still be there (and still resolve).
RUNTIME_SECTION_NUMBERS = {
    ("tafl/packaging/export.py", "docs/design.md §3"),
    ("tafl/training/report.py", "docs/design.md §3"),
    ("tafl/serving/openapi.py", "docs/design.md §7"),
}

MD_FILE = r"(?:\.\./)?(?:docs/)?[A-Za-z0-9_-]+\.md"
NAMES = r'"[^"\n]+"(?:\s*(?:,\s*and|,|and)\s*"[^"\n]+")*'
CITATION = re.compile(rf"(?P<file>{MD_FILE})`?(?:\]\((?P<target>[^)\s]+)\))?`?,\s*(?P<names>{NAMES})")
LINK = re.compile(r"\[[^\]\n]*\]\((?P<target>[^)\s]+)\)")
SECTION_SIGN = re.compile(r"§\s*(?P<num>\d+(?:\.\d+)*)?")
WHO_WHEN = re.compile(r"\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|this|last|earlier|"
                      r"previous|next) session", re.I)
ORDER_NUMBER = re.compile(r"^\d+(?:\.\d+)*\.?\s+")


def headings(path: Path) -> list[str]:
    """The titles of a Markdown file's headings, outside fenced code blocks."""
    out, fence = [], None
    for line in path.read_text(encoding="utf-8").splitlines():
        marker = line.lstrip()[:3]
        if marker in ("```", "~~~"):
            fence = None if fence == marker else fence or marker
            continue
        m = None if fence else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            out.append(m.group(1))
    return out


def slugs(path: Path) -> set[str]:
    """GitHub's anchors for a file's headings: lower case, punctuation dropped, spaces to hyphens, -1, -2 ... on
    repeats."""
    seen: dict[str, int] = {}
    out = set()
    for title in headings(path):
        base = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def matches(name: str, title: str) -> bool:
    norm = ORDER_NUMBER.sub("", title).replace("`", "")
    if norm == name:
        return True
    rest = norm[len(name):]
    return norm.startswith(name) and (rest[:1] in (":", ";", ",") or rest.startswith(" ("))


def resolve(root: Path, citing: Path, cited: str, target: str | None) -> Path | None:
    """The Markdown file a citation names: relative to the citing file's folder, then to the repository and its
    docs/ folder (code cites `docs/results.md`, the docs cite `results.md`)."""
    for candidate in ([citing.parent / target.split("#")[0]] if target and not target.startswith("#") else []) + \
            [citing.parent / cited, root / cited, root / "docs" / cited]:
        if candidate.is_file() and candidate.suffix == ".md":
            return candidate.resolve()
    return None


def files(root: Path) -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--",
                                 *SCANNED_DIRS, *SCANNED_FILES], cwd=root, capture_output=True, text=True,
                                check=True).stdout.split("\n")
        paths = [root / p for p in listed if p]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an unpacked sdist, the planted tree)
        paths = [p for d in SCANNED_DIRS for p in (root / d).rglob("*")] + [root / f for f in SCANNED_FILES]
    return sorted(p for p in paths if p.is_file() and p.suffix in TEXT_SUFFIXES and p.resolve() != THIS
                  and not SKIPPED_PARTS & set(p.relative_to(root).parts))


def _strip_code(text: str) -> str:
    """Markdown without fenced blocks and inline code spans: what a reader sees as links."""
    text = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def problems(root: Path) -> list[str]:
    root = root.resolve()
    found: list[str] = []
    allowed = set()
    for path in files(root):
        rel = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8", errors="replace")
        line_of = lambda pos: text.count("\n", 0, pos) + 1  # noqa: E731
        for m in CITATION.finditer(text):
            cited = resolve(root, path, m.group("file"), m.group("target"))
            if cited is None:
                found.append(f"{rel}:{line_of(m.start())}: cites {m.group('file')}, which the repository does not hold")
                continue
            titles = headings(cited)
            for name in re.findall(r'"([^"\n]+)"', m.group("names")):
                hits = [t for t in titles if matches(name, t)]
                if len(hits) != 1:
                    what = "no heading" if not hits else f"{len(hits)} headings ({'; '.join(hits)})"
                    found.append(f'{rel}:{line_of(m.start())}: "{name}" names {what} of '
                                 f"{cited.relative_to(root).as_posix()}")
        for m in SECTION_SIGN.finditer(text):
            line = text[text.rfind("\n", 0, m.start()) + 1:text.find("\n", m.end()) % (len(text) + 1)]
            allowance = next((a for a in RUNTIME_SECTION_NUMBERS if a[0] == rel and a[1] in line), None)
            if allowance:
                allowed.add(allowance)
                continue
            found.append(f"{rel}:{line_of(m.start())}: a section cited by a bare § number, not by its name: "
                         f"{line.strip()[:100]}")
        if rel.startswith("docs/") or rel in ("README.md", "CONTRIBUTING.md"):
            for m in WHO_WHEN.finditer(text):
                found.append(f"{rel}:{line_of(m.start())}: '{m.group(0)}': date the measurement and name its command")
    for rel, cite in sorted(RUNTIME_SECTION_NUMBERS):
        if (rel, cite) not in allowed:
            if (root / rel).is_file():
                found.append(f"{rel}: the allowance for '{cite}' is no longer used: remove it from this test")
            continue
        number = cite.split("§")[1].strip()
        if not any(re.match(rf"{re.escape(number)}\.?\s", t) for t in headings(root / cite.split()[0])):
            found.append(f"{rel}: '{cite}': {cite.split()[0]} has no section numbered {number}")
    for pattern in LINKED:
        for path in sorted(root.glob(pattern)):
            rel = path.relative_to(root).as_posix()
            text = _strip_code(path.read_text(encoding="utf-8"))
            for m in LINK.finditer(text):
                target = m.group("target")
                if re.match(r"[a-z]+:", target):
                    continue
                file_part, _, anchor = target.partition("#")
                dest = (path.parent / file_part).resolve() if file_part else path
                if not dest.exists():
                    found.append(f"{rel}: links {target}, which the repository does not hold")
                elif anchor and dest.suffix == ".md" and anchor not in slugs(dest):
                    found.append(f"{rel}: links {target}: {dest.name} has no heading with that anchor")
    return found


def test_every_citation_of_a_doc_section_resolves_and_none_is_a_bare_number():
    assert problems(REPO) == []


def test_the_checker_catches_a_planted_offender(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "tafl").mkdir()
    (tmp_path / "docs" / "results.md").write_text(
        "# Results\n\n## Today's numbers\n\n## 2. Serving defaults: workers and lanes chosen at start\n\n"
        "### Model lanes\n\n### Soak\n\n### Soak, again\n\n```bash\n# not a heading\n```\n")
    (tmp_path / "docs" / "design.md").write_text("# Design\n\n## 3. Data and the evaluation protocol\n")
    (tmp_path / "docs" / "guide.md").write_text(
        "See [results.md](results.md), \"Serving defaults\" and \"Model lanes\"; [lanes](results.md#model-lanes);\n"
        "[the 2. section](results.md#2-serving-defaults-workers-and-lanes-chosen-at-start); [top](#guide).\n\n"
        "# Guide\n\n"
        "Broken: [gone](results.md#no-such-anchor), [missing](missing.md), measured in the third session.\n")
    (tmp_path / "README.md").write_text("# readme\n\nHow it works: [docs/design.md](docs/design.md), \"Data and "
                                        "the evaluation protocol\".\n")
    (tmp_path / "tafl" / "mod.py").write_text(
        '"""Fine: docs/results.md, "Serving defaults"; docs/design.md, "Data and the evaluation protocol"."""\n'
        '# docs/results.md, "No such section"\n'
        "# docs/results.md \u00a7 19.5\n"
        '# docs/FIELD-NOTES.md, "preload"\n'
        '# docs/results.md, "Soak"\n'
        '# docs/results.md, "Model" (a start that is not up to a colon)\n')
    found = problems(tmp_path)
    expected = [
        'tafl/mod.py:2: "No such section" names no heading of docs/results.md',
        "tafl/mod.py:3: a section cited by a bare § number",
        "tafl/mod.py:4: cites docs/FIELD-NOTES.md, which the repository does not hold",
        'tafl/mod.py:5: "Soak" names 2 headings (Soak; Soak, again) of docs/results.md',
        'tafl/mod.py:6: "Model" names no heading of docs/results.md',
        "docs/guide.md:6: 'third session': date the measurement",
        "docs/guide.md: links results.md#no-such-anchor: results.md has no heading with that anchor",
        "docs/guide.md: links missing.md, which the repository does not hold",
    ]
    for want in expected:
        assert sum(p.startswith(want) for p in found) == 1, (want, found)
    assert len(found) == len(expected), found
