"""The validation report (tafl.clients.validate) as one self-contained HTML file and its JSON: the verdict first, in
plain words, then the criteria, per-class sensitivity and specificity with intervals against the card's claims, the
three rules, calibration with its reliability diagram, ROC curves and the confusion matrix (inline SVG, so the file
needs nothing else and prints to PDF with its charts), the refused share and the prediction sets, the package's
identity and the data's description. Standard library only."""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#7f7f7f",
           "#bcbd22")
CSS = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #111; margin: 2rem auto;
       max-width: 60rem; padding: 0 1rem; }
h1 { font-size: 1.5rem; margin-bottom: .3rem; } h2 { font-size: 1.15rem; margin-top: 2rem; }
.verdict { font-size: 1.15rem; padding: .8rem 1rem; border-radius: 6px; border: 2px solid; }
.pass { background: #e8f5e9; border-color: #2e7d32; } .fail { background: #fdecea; border-color: #c62828; }
.none { background: #f3f4f6; border-color: #6b7280; }
table { border-collapse: collapse; margin: .5rem 0; } th, td { padding: .25rem .6rem; border-bottom: 1px solid #ddd;
text-align: left; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.flag { color: #b71c1c; font-weight: 600; } .muted { color: #555; }
figure { display: inline-block; margin: .5rem 1.5rem .5rem 0; vertical-align: top; max-width: 440px; }
figcaption { font-size: .9rem; color: #333; }
@media print { body { margin: 0; max-width: none; } h2 { break-after: avoid; } figure, table { break-inside: avoid; } }
"""


def _pct(v: Any) -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:.1f}%"


def _ci(t: Any) -> str:
    est, lo, hi = t
    return "—" if est is None or (isinstance(est, float) and math.isnan(est)) else \
        f"{100 * est:.1f}% ({100 * lo:.1f}–{100 * hi:.1f}%)"


def _e(v: Any) -> str:
    return html.escape(str(v))


def _ticks(pad: int, w: float) -> str:
    """0, 0.5 and 1 on both axes of a unit square drawn at (pad, 10) with side w."""
    out = []
    for v in (0.0, 0.5, 1.0):
        x, y = pad + v * w, 10 + (1 - v) * w
        out.append(f'<text x="{x:.1f}" y="{10 + w + 13:.1f}" text-anchor="middle" font-size="10">{v:g}</text>'
                   f'<text x="{pad - 4}" y="{y + 3:.1f}" text-anchor="end" font-size="10">{v:g}</text>')
    return "".join(out)


def roc_svg(roc: dict[str, dict[str, Any]], size: int = 320) -> str:
    pad = 40
    w = size - pad - 10
    parts = [f'<svg role="img" aria-labelledby="roc-title" width="{size}" height="{size}" '
             f'viewBox="0 0 {size} {size}" xmlns="http://www.w3.org/2000/svg" class="chart roc">',
             '<title id="roc-title">ROC curves, one class against the rest</title>',
             f'<rect x="{pad}" y="10" width="{w}" height="{w}" fill="none" stroke="#999"/>',
             f'<line x1="{pad}" y1="{10 + w}" x2="{pad + w}" y2="10" stroke="#bbb" stroke-dasharray="4 3"/>',
             _ticks(pad, w),
             f'<text x="{pad + w / 2}" y="{size - 5}" text-anchor="middle" font-size="12">false positive rate</text>',
             f'<text x="12" y="{10 + w / 2}" text-anchor="middle" font-size="12" '
             f'transform="rotate(-90 12 {10 + w / 2})">true positive rate</text>']
    for i, (name, r) in enumerate(roc.items()):
        if not r["fpr"]:
            continue
        pts = " ".join(f"{pad + x * w:.1f},{10 + (1 - t) * w:.1f}" for x, t in zip(r["fpr"], r["tpr"]))
        parts.append(f'<polyline class="curve" data-class="{_e(name)}" points="{pts}" fill="none" '
                     f'stroke="{PALETTE[i % len(PALETTE)]}" stroke-width="1.6"/>')
    parts.append("</svg>")
    legend = "".join(f'<span style="color:{PALETTE[i % len(PALETTE)]}">■</span> {_e(n)} (AUC {r["auc"]:.3f}) '
                     if not math.isnan(r["auc"]) else f'<span class="muted">{_e(n)}: no positives</span> '
                     for i, (n, r) in enumerate(roc.items()))
    return "".join(parts) + f"<figcaption>{legend}</figcaption>"


def reliability_svg(cal: dict[str, Any], size: int = 320) -> str:
    pad = 40
    w = size - pad - 10
    parts = [f'<svg role="img" aria-labelledby="rel-title" width="{size}" height="{size}" '
             f'viewBox="0 0 {size} {size}" xmlns="http://www.w3.org/2000/svg" class="chart reliability">',
             '<title id="rel-title">Reliability diagram: accuracy against the stated probability</title>',
             f'<rect x="{pad}" y="10" width="{w}" height="{w}" fill="none" stroke="#999"/>',
             f'<line x1="{pad}" y1="{10 + w}" x2="{pad + w}" y2="10" stroke="#bbb" stroke-dasharray="4 3"/>',
             _ticks(pad, w),
             f'<text x="{pad + w / 2}" y="{size - 5}" text-anchor="middle" font-size="12">stated probability</text>',
             f'<text x="12" y="{10 + w / 2}" text-anchor="middle" font-size="12" '
             f'transform="rotate(-90 12 {10 + w / 2})">accuracy</text>']
    bw = w / cal["bins"]
    for p in cal["points"]:
        b = min(int(p["confidence"] * cal["bins"]), cal["bins"] - 1)
        h = p["accuracy"] * w
        parts.append(f'<rect class="bar" x="{pad + b * bw + 1:.1f}" y="{10 + w - h:.1f}" width="{bw - 2:.1f}" '
                     f'height="{h:.1f}" fill="#1f77b4" opacity=".75"><title>{p["count"]} images: stated '
                     f'{100 * p["confidence"]:.0f}%, right {100 * p["accuracy"]:.0f}%</title></rect>')
    parts.append("</svg>")
    return "".join(parts) + f"<figcaption>Expected calibration error {_pct(cal['ece'])}</figcaption>"


def confusion_svg(cm: list[list[int]], names: list[str], cell: int = 34) -> str:
    C = len(names)
    pad = 90
    size = pad + C * cell + 10
    top = max(max(r) for r in cm) or 1
    parts = [f'<svg role="img" aria-labelledby="cm-title" width="{size}" height="{size}" '
             f'viewBox="0 0 {size} {size}" xmlns="http://www.w3.org/2000/svg" class="chart confusion">',
             '<title id="cm-title">Confusion matrix: true class (rows) against the answer (columns)</title>']
    for i in range(C):
        parts.append(f'<text x="{pad - 4}" y="{pad + i * cell + cell / 2 + 4}" text-anchor="end" '
                     f'font-size="11">{_e(names[i][:12])}</text>')
        parts.append(f'<text x="{pad + i * cell + cell / 2}" y="{pad - 6}" font-size="11" text-anchor="start" '
                     f'transform="rotate(-45 {pad + i * cell + cell / 2} {pad - 6})">{_e(names[i][:12])}</text>')
        for j in range(C):
            v = cm[i][j]
            shade = int(255 - 200 * v / top)
            parts.append(f'<rect class="cell" x="{pad + j * cell}" y="{pad + i * cell}" width="{cell}" '
                         f'height="{cell}" fill="rgb({shade},{shade},255)" stroke="#fff"/>'
                         f'<text x="{pad + j * cell + cell / 2}" y="{pad + i * cell + cell / 2 + 4}" font-size="11" '
                         f'text-anchor="middle" fill="{"#fff" if shade < 120 else "#111"}">{v}</text>')
    parts.append("</svg>")
    return "".join(parts) + "<figcaption>Rows: the true class; columns: the model's answer.</figcaption>"


def render(r: dict[str, Any]) -> str:
    """The report as one HTML page."""
    pkg, data = r["package"], r["data"]
    kind = "none" if not r["criteria"] else "pass" if r["passed"] else "fail"
    out = ["<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">",
           f"<title>Validation of {_e(pkg['name'])} {_e(pkg['version'])}</title><style>{CSS}</style></head><body>",
           f"<h1>Validation of {_e(pkg['name'])} {_e(pkg['version'])} on this site's images</h1>",
           f"<p class=\"verdict {kind}\" id=\"verdict\">{_e(r['verdict'])}</p>",
           f"<p class=\"muted\">{data['answered']} of {data['images']} labelled images answered "
           f"({r['refused']['images']} outside the model's domain, {len(r['not_scored'])} not readable). "
           f"Created {_e(r['created'])} by tafl {_e(r['tafl_version'])}.</p>"]
    if r["criteria"]:
        out += ["<h2>Acceptance criteria</h2><table><tr><th>criterion</th><th>estimate (95% interval)</th>"
                "<th>judged on</th><th>result</th></tr>"]
        for c in r["criteria"]:
            out.append(f"<tr><td>{_e(c['criterion'])}</td><td class=\"num\">"
                       f"{_ci([c['estimate'], *c['interval']])}</td><td class=\"num\">{_pct(c['judged_on'])}</td>"
                       f"<td class=\"{'' if c['passed'] else 'flag'}\">{'met' if c['passed'] else 'NOT met'}</td></tr>")
        out.append("</table>")
    out += ["<h2>Per class (the package's default rule)</h2><table><tr><th>class</th><th>images</th>"
            "<th>sensitivity (95% interval)</th><th>the card's claim</th><th>specificity (95% interval)</th></tr>"]
    for name, v in r["per_class"].items():
        flag = ' <span class="flag">below the claim</span>' if v["below_claim"] else ""
        out.append(f"<tr><td>{_e(name)}</td><td class=\"num\">{v['support']}</td><td class=\"num\">"
                   f"{_ci(v['sensitivity'])}{flag}</td><td class=\"num\">{_pct(v['claim'])}</td>"
                   f"<td class=\"num\">{_ci(v['specificity'])}</td></tr>")
    out += ["</table>", "<h2>Accuracy by decision rule</h2><table><tr><th>rule</th><th>accuracy</th>"
            "<th>balanced accuracy</th></tr>"]
    words = {"default": "the package's default rule", "site": "this site's own mix (prior=site, from the labels)",
             "adapted": "adapted (the package's case-mix estimate on these images)"}
    for name, v in r["rules"].items():
        out.append(f"<tr><td>{_e(words.get(name, name))}</td><td class=\"num\">{_ci(v['accuracy'])}</td>"
                   f"<td class=\"num\">{_ci(v['balanced_accuracy'])}</td></tr>")
    out += ["</table>", "<h2>Calibration, discrimination and errors</h2>",
            f"<figure>{reliability_svg(r['calibration'])}</figure>", f"<figure>{roc_svg(r['roc'])}</figure>",
            f"<figure>{confusion_svg(r['confusion'], r['classes'])}</figure>",
            "<h2>Outside the model's domain, and the prediction sets</h2>",
            f"<p>Refused: {_ci(r['refused']['share'])} of {r['refused']['of']} images ({r['refused']['by_header']} "
            f"by their DICOM header, {r['refused']['by_detector']} by the in-domain detector).</p>"]
    if r.get("sets"):
        s = r["sets"]
        out.append(f"<p>Prediction sets at {_pct(s['level'])}: the true class was in the set for "
                   f"{_ci(s['coverage'])} of the answered images; mean set size {s['size']:.2f} classes.</p>")
    out += ["<h2>What was validated</h2><table>",
            f"<tr><th>package</th><td>{_e(pkg['name'])} {_e(pkg['version'])} ({_e(pkg['method'])}, exported "
            f"{_e(pkg['created'])})</td></tr>",
            f"<tr><th>model.onnx sha256</th><td><code>{_e(pkg['model_sha256'])}</code></td></tr>",
            f"<tr><th>signature</th><td>{_e('verified, key ' + pkg['signed_by'] if pkg['signed_by'] else 'unsigned')}"
            "</td></tr>",
            f"<tr><th>images</th><td>{_e(data['root'])} ({data['images']} labelled: "
            + ", ".join(f"{_e(n)} {k}" for n, k in data["per_class"].items()) + ")</td></tr>",
            f"<tr><th>labels</th><td>{_e(data['labels'])}</td></tr>",
            f"<tr><th>claims</th><td>{_e(pkg['claims_from'] or 'none recorded in the package')}</td></tr>",
            "</table>", "<h2>How the numbers were computed</h2><ul>"]
    out += [f"<li>{_e(k.replace('_', ' '))}: {_e(v)}</li>" for k, v in r["method_notes"].items()]
    if r["not_scored"]:
        out.append("<li>not readable: " + "; ".join(f"{_e(x['id'])} ({_e(x['why'])})" for x in r["not_scored"][:20])
                   + "</li>")
    out.append("</ul></body></html>")
    return "\n".join(out)


def _plain(v: Any) -> Any:
    if isinstance(v, float) and math.isnan(v):
        return None
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def write(report: dict[str, Any], out: str | Path) -> tuple[Path, Path]:
    """OUT/validation.html and OUT/validation.json (NaN as null)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    h, j = out / "validation.html", out / "validation.json"
    j.write_text(json.dumps(_plain(report), indent=1, allow_nan=False) + "\n", encoding="utf-8")
    h.write_text(render(report), encoding="utf-8")
    return h, j
