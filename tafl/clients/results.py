"""A scoring job's inputs and results file: which files are images (`sniff`, `walk`), one `Row` per input, and the
append-only results file (`ResultsFile`, CSV or JSONL) that `tafl score` writes for a folder and for a PACS.

Each result is one line appended with a single write and flushed, so the file is valid at every instant;
`--resume` repairs a torn last line, skips every path already in the file and appends the rest.

A CSV cell a spreadsheet would run as a formula (a string starting with =, +, -, @, tab or
carriage return: OWASP's CSV injection; a file in a hospital folder can be named
`=HYPERLINK(...).png`) is written with a leading `'`, and so is one already starting with `'`, so
that `csv_uncell` restores every value exactly and `--resume` still recognises the paths; a
string that is a plain number (-1.5) and numeric cells stay as they are. JSONL keeps raw values.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tafl.errors import ConfigError


def sniff(path: Path) -> str | None:
    """'dicom', 'png', 'jpeg' or None (skip)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(132)
    except OSError:
        return "unreadable"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if head[128:132] == b"DICM" or path.suffix.lower() in (".dcm", ".dicom"):
        return "dicom"
    return None


def walk(folder: Path) -> tuple[list[Path], list[Path]]:
    """(images, skipped), both sorted, recursively."""
    images, skipped = [], []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            p = Path(root) / name
            (images if sniff(p) else skipped).append(p)
    return images, skipped


@dataclass
class Row:
    path: str
    label: int | None = None
    class_name: str = ""
    probability: float | None = None
    experts: dict[str, str] = field(default_factory=dict)  # expert name -> class name
    model: str = ""
    model_version: str = ""
    error: str = ""
    posteriors: list[float] | None = None  # calibrated, under the source prior (--prior adaptive)
    in_domain: bool | None = None  # the package's in-domain detector's verdict; None: the package has none
    domain_distance: float | None = None
    prediction_set: list[str] | None = None  # the conformal set's classes; None: no set (outside the domain, or none)
    set_coverage: float | None = None

    @property
    def abstained(self) -> bool:
        """Outside the model's domain: no label (the row's class columns are empty)."""
        return self.in_domain is False


ADAPTIVE_COLUMNS = ["adaptive_label", "adaptive_class_name"]

FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")


def csv_cell(value: Any) -> Any:
    """`value` as the results CSV stores it: a string that a spreadsheet would run as a formula gets a
    leading `'` (also one that starts with `'` already, so that the escape can be undone exactly);
    plain numbers, written as strings or not, and every other value stay as they are."""
    if isinstance(value, str) and value[:1] in (*FORMULA_START, "'") and not _PLAIN_NUMBER.fullmatch(value):
        return "'" + value
    return value


def csv_uncell(text: str) -> str:
    """The value `csv_cell` escaped (the CSV's text when it did not)."""
    return text[1:] if text.startswith("'") else text


class ResultsFile:
    """Append-only CSV or JSONL whose every line is complete (one write per row, then flush)."""

    def __init__(self, path: Path, expert_names: list[str], *, resume: bool, force: bool, num_posteriors: int = 0,
                 domain: bool = False, sets: bool = False):
        self.path, self.expert_names = path, expert_names
        self.jsonl = path.suffix.lower() == ".jsonl"
        if path.suffix.lower() not in (".csv", ".jsonl"):
            raise ConfigError(f"--out {path}: use a .csv or .jsonl file")
        self.post_cols = [f"p{c}" for c in range(num_posteriors)]
        # domain: the package has an in-domain detector; in_domain false is a row the model abstained on (no label)
        self.domain_cols = ["in_domain", "domain_distance"] if domain else []
        # sets: the package has conformal prediction sets; the cell lists the set's classes, separated by |
        self.set_cols = ["prediction_set", "set_coverage"] if sets else []
        self.columns = (["path", "label", "class_name", "probability"] + [f"expert_{e}" for e in expert_names]
                        + self.domain_cols + self.set_cols + ["model", "model_version", "error"] + self.post_cols)
        self.done: set[str] = set()
        self.done_counts: dict[str, int] = {}  # resume: the class names already predicted in the file
        if path.exists() and path.stat().st_size > 0:
            if not resume and not force:
                raise ConfigError(f"{path} exists; pass --resume to continue it or --force to replace it")
            if resume:
                self._repair_and_read()
            else:
                path.unlink()
        path.parent.mkdir(parents=True, exist_ok=True)
        new = not path.exists() or path.stat().st_size == 0
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if new and not self.jsonl:
            self._write_line(self._csv_line(self.columns))

    def _repair_and_read(self) -> None:
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):  # a kill tore the last line: drop it, it will be scored again
            cut = data.rfind(b"\n") + 1
            with open(self.path, "r+b") as fh:
                fh.truncate(cut)
            data = data[:cut]
        text = data.decode("utf-8")
        if self.jsonl:
            for line in text.splitlines():
                if line.strip():
                    rec = json.loads(line)
                    self.done.add(rec["path"])
                    self._count(rec)
        else:
            reader = csv.DictReader(io.StringIO(text))
            if reader.fieldnames and reader.fieldnames not in (self.columns, self.columns + ADAPTIVE_COLUMNS):
                raise ConfigError(f"{self.path} has columns {reader.fieldnames}; this model writes {self.columns} "
                                  "(a different model?); use another --out")
            for r in reader:
                self.done.add(csv_uncell(r["path"]))
                self._count({**r, "class_name": csv_uncell(r.get("class_name") or "")})

    def _count(self, rec: dict[str, Any]) -> None:
        if not rec.get("error") and rec.get("class_name"):
            self.done_counts[rec["class_name"]] = self.done_counts.get(rec["class_name"], 0) + 1

    @staticmethod
    def _csv_line(values: list[Any]) -> str:
        buf = io.StringIO()
        # "\r\n" so that the csv module quotes a \r inside a value too (with "\n" it quotes only \n, and
        # a file name holding a \r split its row in two); the line itself ends in "\n" as before
        csv.writer(buf, lineterminator="\r\n").writerow(values)
        return buf.getvalue()[:-2] + "\n"

    def _write_line(self, line: str) -> None:
        os.write(self.fd, line.encode("utf-8"))  # one write of a whole line: O_APPEND keeps it intact

    def write(self, row: Row) -> None:
        experts = {f"expert_{e}": row.experts.get(e, "") for e in self.expert_names}
        rec = {"path": row.path, "label": row.label, "class_name": row.class_name, "probability": row.probability,
               **experts, **({"in_domain": row.in_domain, "domain_distance": row.domain_distance}
                             if self.domain_cols else {}),
               **({"prediction_set": row.prediction_set if self.jsonl or row.prediction_set is None else
                   "|".join(row.prediction_set), "set_coverage": row.set_coverage} if self.set_cols else {}),
               "model": row.model, "model_version": row.model_version, "error": row.error,
               **{c: (row.posteriors[i] if row.posteriors else None) for i, c in enumerate(self.post_cols)}}
        if self.jsonl:
            self._write_line(json.dumps(rec) + "\n")
        else:
            self._write_line(self._csv_line(["" if rec[c] is None else csv_cell(rec[c]) for c in self.columns]))
        self.done.add(row.path)

    def close(self) -> None:
        os.fsync(self.fd)
        os.close(self.fd)
