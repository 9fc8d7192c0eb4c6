"""The results CSV of `tafl score` never hands a spreadsheet a formula (OWASP CSV injection), and
`--resume` still recognises the escaped paths; JSONL keeps the raw values."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from tafl.clients.score import ResultsFile, Row, csv_cell, csv_uncell, score_folder
from tests.conftest import digit_png

NASTY = ['=HYPERLINK("evil.example","open").png', "+cmd.png", "-2+3.png", "@SUM(A1).png", "\tTab.png",
         "\rCR.png", "'quoted.png", "=1+1"]


@pytest.mark.parametrize("value, stored", [
    ('=HYPERLINK("x")', '\'=HYPERLINK("x")'), ("+1+1", "'+1+1"), ("-2+3", "'-2+3"), ("@A1", "'@A1"),
    ("\tx", "'\tx"), ("\rx", "'\rx"), ("'x", "''x"), ("-", "'-"),
    ("-1.5", "-1.5"), ("+3", "+3"), ("-2e-3", "-2e-3"), ("-.5", "-.5"),  # plain numbers stay numbers
    ("a=b", "a=b"), ("scan-1.png", "scan-1.png"), ("", ""),
    (-0.25, -0.25), (-3, -3), (None, None),  # not strings: untouched
])
def test_csv_cell_escapes_formulas_only(value, stored):
    assert csv_cell(value) == stored
    if isinstance(value, str):
        assert csv_uncell(stored) == value


def _read(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def test_results_file_escapes_every_string_cell_and_resume_knows_the_paths(tmp_path):
    out = tmp_path / "r.csv"
    f = ResultsFile(out, ["forward"], resume=False, force=False)
    for p in NASTY:
        f.write(Row(p, label=1, class_name="=evil", probability=0.5, experts={"forward": "-x"}, model="@m",
                    model_version="1.0.0", error=""))
    f.write(Row("plain.png", label=0, class_name="-1", probability=-0.0, error="400 DataError: +bad"))
    f.close()
    rows = _read(out)
    assert [r["path"] for r in rows] == [csv_cell(p) for p in NASTY] + ["plain.png"]
    for r in rows:
        for col, v in r.items():
            assert v[:1] not in ("=", "+", "@", "\t", "\r") or v == "", (col, v)
            assert not v.startswith("-") or v in ("-1", "-0.0"), (col, v)  # numbers only
    assert rows[0]["class_name"] == "'=evil" and rows[0]["expert_forward"] == "'-x" and rows[0]["model"] == "'@m"
    assert rows[-1]["class_name"] == "-1" and rows[-1]["probability"] == "-0.0" and rows[-1]["error"].startswith("400")
    again = ResultsFile(out, ["forward"], resume=True, force=False)
    assert again.done == set(NASTY) | {"plain.png"}
    again.close()


def test_a_carriage_return_inside_a_value_keeps_its_row_whole(tmp_path):
    out = tmp_path / "r.csv"
    f = ResultsFile(out, [], resume=False, force=False)
    f.write(Row("a\rb.png", label=0))
    f.write(Row("c\nd.png", label=1))
    f.close()
    assert out.read_bytes().count(b"\n") == 4  # header, two rows (one with a quoted newline)
    assert [r["path"] for r in _read(out)] == ["a\rb.png", "c\nd.png"]
    again = ResultsFile(out, [], resume=True, force=False)
    assert again.done == {"a\rb.png", "c\nd.png"}
    again.close()


def test_jsonl_keeps_raw_values(tmp_path):
    out = tmp_path / "r.jsonl"
    f = ResultsFile(out, [], resume=False, force=False)
    f.write(Row(NASTY[0], label=1, class_name="=evil", probability=0.5))
    f.close()
    rec = json.loads(out.read_text())
    assert rec["path"] == NASTY[0] and rec["class_name"] == "=evil"


@pytest.mark.slow
def test_scoring_a_folder_of_formula_named_files_then_resuming(gtafl_pkg, tmp_path):
    folder = tmp_path / "hospital"
    (folder / "=sub").mkdir(parents=True)
    names = [*NASTY, "=sub/-x.png", "mid\rline.png", "ok.png"]
    for i, n in enumerate(names):
        (folder / n).write_bytes(digit_png(i % 10))
    out = tmp_path / "results.csv"
    first = score_folder(folder, out, package=str(gtafl_pkg), progress=False)
    assert first["scored_now"] == len(names) and not first["failed"]
    rows = _read(out)
    assert sorted(csv_uncell(r["path"]) for r in rows) == sorted(names)
    assert all(r["path"][:1] not in ("=", "+", "-", "@", "\t") for r in rows)
    (folder / "=new.png").write_bytes(digit_png(4))
    again = score_folder(folder, out, package=str(gtafl_pkg), progress=False, resume=True)
    assert again["scored_now"] == 1 and again["already_done"] == len(names)
    assert [csv_uncell(r["path"]) for r in _read(out)].count("=new.png") == 1
    adaptive = tmp_path / "adaptive"
    shutil.copytree(folder, adaptive)
    score_folder(adaptive, tmp_path / "a.csv", package=str(gtafl_pkg), progress=False, prior="adaptive")
    rows = _read(tmp_path / "a.csv")  # rewritten by the adaptive re-decision: escaped once, not twice
    assert sorted(csv_uncell(r["path"]) for r in rows) == sorted([*names, "=new.png"])
    assert all(not r["path"].startswith("''") or r["path"] == "''quoted.png" for r in rows)
