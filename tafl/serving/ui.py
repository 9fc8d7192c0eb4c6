"""The service's page for people (issue 19): `GET /` and `/ui/...`, server-rendered with Jinja2.

Per loaded model it opens with a plain-language summary for a clinician (tafl.packaging.summary, the same
text that opens the model card: which findings it recognises and misses, how often it is right when the case
mix is like training and when rare findings become common, what it must not be used for), then the detail:
name, version, lineage, checksum and signature status, the eleven-distribution accuracy chart and per-class
table from the package's metadata, the class mix it has predicted since the worker started (the same
`tafl_predicted_class` counter `/metrics` reads) beside the training mix (each class's share of the training
images, as `tafl score` prints it; not the source prior, which for a balanced ensemble is uniform), the
case-mix estimate with its distance from the source prior, and the model card. A
"try an image" form posts to the same `/predict` route as any client (ui/static/ui.js), so the limits, the
auth and the error messages are the API's own.

Charts are SVG strings drawn here, every text escaped. The model card is Markdown rendered with raw HTML
off (markdown-it-py; unsafe link schemes refused), so nothing a package carries runs in the browser; a
Content-Security-Policy allows only this service's script and styles as a second line.

Auth: with TAFL_API_TOKEN set, `GET /` returns the shell with a token form and nothing about the models; the
script keeps the token in sessionStorage and fetches `GET /ui/panel` (the models and the form, as an HTML
fragment) with `Authorization: Bearer`. Without the token the panel route answers the API's 401.
Static parts of a model's panel (card, accuracy chart, checksums) are rendered once per package content.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from types import MappingProxyType
from typing import Any

import jinja2
from markupsafe import Markup, escape
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tafl.imaging.heatmap import jet, overlay
from tafl.packaging.summary import DISTRIBUTIONS_NOTE, SITES_NOTE, plain_summary, site_rows, training_shares
from tafl.packaging.summary import finite as _num
from tafl.intervals import with_interval
from tafl.packaging.card import detector_line, sets_line
from tafl.errors import TaflError
from tafl.privacy_text import privacy_summary
from tafl.serving.context import STATIC_CACHE_MAX, ServingState, of
from tafl.serving.http import error_response, request_id
from tafl.serving.routing import Call, endpoint

log = logging.getLogger("tafl.serving")

HERE = Path(__file__).resolve().parent / "ui"
DISTRIBUTIONS = ("forward50", "forward25", "forward10", "forward5", "forward2", "uniform", "backward2",
                 "backward5", "backward10", "backward25", "backward50")  # tafl.packaging.card.ORDER
ASSET_TYPES = {".css": "text/css; charset=utf-8", ".js": "text/javascript; charset=utf-8"}
# only this service's own script and styles; uploads' heatmaps come back as data: URLs
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                    "Referrer-Policy": "no-referrer", "Cache-Control": "no-store"}
# a source prior this far (largest per-class gap) from the training mix gets its own column: the drift distance
# is measured from it, so a reader must see which mix that is
ASSUMED_GAP = 0.005
COLOURS = {"train": "#7a869a", "served": "#1f77b4", "estimate": "#d95f02", "bar": "#2b6cb0"}

def _templates(st: ServingState) -> jinja2.Environment:
    """The page's Jinja2 environment (its template cache), one per worker's state."""
    if st.templates is None:
        st.templates = jinja2.Environment(loader=jinja2.FileSystemLoader(str(HERE / "templates")),
                                          autoescape=jinja2.select_autoescape(["html"], default=True),
                                          undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    return st.templates


def _load_assets() -> dict[str, tuple[bytes, str, str]]:
    """name -> (bytes, content type, short digest for cache-busting URLs); read once at import."""
    out = {}
    for p in sorted((HERE / "static").iterdir()):
        if p.suffix in ASSET_TYPES:
            data = p.read_bytes()
            out[p.name] = (data, ASSET_TYPES[p.suffix], hashlib.sha256(data).hexdigest()[:12])
    return out


ASSETS = MappingProxyType(_load_assets())  # read-only: the files ship with tafl


# ------------------------------------------------------------------ formatting
def pct(v: Any, digits: int = 1) -> str:
    f = _num(v)
    return "—" if f is None else f"{100 * f:.{digits}f}%"


def _markdown():
    from markdown_it import MarkdownIt

    # "js-default": CommonMark with tables, raw HTML off (it is shown as text), no linkify/typographer;
    # markdown-it's link validation drops javascript:, vbscript:, file: and data: (but images) URLs
    return MarkdownIt("js-default")


def render_card(st: ServingState, text: str) -> Markup:
    """A model card (Markdown) as safe HTML: raw HTML in it is escaped, not passed through."""
    with st.page_lock:
        if st.markdown is None:
            st.markdown = _markdown()
        try:
            return Markup(st.markdown.render(text))
        except Exception:  # noqa: BLE001 - a card the renderer chokes on is still shown, as text
            log.warning("model card could not be rendered as Markdown; shown as text", exc_info=True)
            return Markup("<pre>") + escape(text) + Markup("</pre>")


# ------------------------------------------------------------------ charts (SVG strings, every text escaped)
def _svg_open(width: int, height: int, uid: str, title: str, desc: str, cls: str = "chart", svg_id: str = "") -> str:
    ident = f' id="{svg_id}"' if svg_id else ""
    return (f'<svg xmlns="http://www.w3.org/2000/svg"{ident} class="{cls}" viewBox="0 0 {width} {height}" '
            f'width="{width}" height="{height}" role="img" aria-labelledby="{uid}-t {uid}-d" '
            f'aria-label="{escape(title)}"><title id="{uid}-t">{escape(title)}</title>'
            f'<desc id="{uid}-d">{escape(desc)}</desc>')


def accuracy_chart(accuracy: dict[str, Any], average: Any, uid: str, what: str) -> Markup:
    """Bars of the accuracy on the eleven test distributions (forward50 … backward50), 0–100 %.

    The dashed mean line spans the bars and its label sits in a margin of its own right of them: drawn over
    the plot it covered the last bars and their values."""
    W, H, left, right, top, bottom = 700, 270, 48, 82, 22, 78
    pw, ph = W - left - right, H - top - bottom
    step = pw / len(DISTRIBUTIONS)
    vals = [_num(accuracy.get(k)) for k in DISTRIBUTIONS]
    desc = "; ".join(f"{k} {pct(v)}" for k, v in zip(DISTRIBUTIONS, vals)) + f". Mean {pct(average)}."
    parts = [_svg_open(W, H, uid, f"Accuracy of {what} on the eleven test distributions", desc)]
    for t in (0, 25, 50, 75, 100):
        y = top + ph * (1 - t / 100)
        parts.append(f'<line x1="{left}" x2="{W - right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#d0d7de" '
                     f'stroke-width="1"/><text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="11" '
                     f'fill="#444">{t}%</text>')
    for i, (k, v) in enumerate(zip(DISTRIBUTIONS, vals)):
        x = left + i * step + step * 0.15
        bw = step * 0.7
        cx = x + bw / 2
        if v is None:
            parts.append(f'<text x="{cx:.1f}" y="{top + ph - 4:.1f}" text-anchor="middle" font-size="11" '
                         f'fill="#666">n/a</text>')
        else:
            h = ph * min(max(v, 0.0), 1.0)
            fill = COLOURS["bar"]
            parts.append(f'<rect x="{x:.1f}" y="{top + ph - h:.1f}" width="{bw:.1f}" height="{h:.1f}" '
                         f'fill="{fill}"><title>{escape(k)}: {pct(v)}</title></rect>'
                         f'<text x="{cx:.1f}" y="{top + ph - h - 4:.1f}" text-anchor="middle" font-size="10" '
                         f'fill="#222">{100 * v:.0f}</text>')
        parts.append(f'<text x="{cx:.1f}" y="{top + ph + 12:.1f}" font-size="11" fill="#222" text-anchor="end" '
                     f'transform="rotate(-40 {cx:.1f} {top + ph + 12:.1f})">{escape(k)}</text>')
    avg = _num(average)
    if avg is not None:
        y = top + ph * (1 - min(max(avg, 0.0), 1.0))
        parts.append(f'<line x1="{left}" x2="{W - right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#222" '
                     f'stroke-dasharray="5 4" stroke-width="1.2"/><text class="mean-label" x="{W - right + 6}" '
                     f'y="{y + 4:.1f}" text-anchor="start" font-size="11" fill="#222">mean {pct(avg)}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


def mix_chart(classes: list[str], series: list[tuple[str, str, list[float | None]]], uid: str,
              what: str) -> Markup:
    """Grouped horizontal bars, one group per class: each series' share of that class (0–100 %)."""
    label_w, W, right, bar, gap, top = 150, 660, 56, 9, 10, 30
    pw = W - label_w - right
    group = bar * len(series) + gap
    H = top + group * len(classes) + 6
    desc = " ".join(f"{c}: " + ", ".join(f"{name} {pct(vals[i])}" for name, _, vals in series) + "."
                    for i, c in enumerate(classes))
    parts = [_svg_open(W, H, uid, f"Class mix of {what}: " + ", ".join(n for n, _, _ in series), desc)]
    x = label_w
    for name, colour, _ in series:  # legend
        parts.append(f'<rect x="{x}" y="6" width="12" height="12" fill="{colour}"/>'
                     f'<text x="{x + 16}" y="16" font-size="11" fill="#222">{escape(name)}</text>')
        x += 30 + 7 * len(name)
    for i, c in enumerate(classes):
        y0 = top + i * group
        shown = c if len(c) <= 22 else c[:21] + "…"
        parts.append(f'<text x="{label_w - 6}" y="{y0 + bar * len(series) / 2 + 4:.1f}" text-anchor="end" '
                     f'font-size="11" fill="#222">{escape(shown)}</text>')
        for j, (name, colour, vals) in enumerate(series):
            v = vals[i]
            y = y0 + j * bar
            w = 0.0 if v is None else pw * min(max(v, 0.0), 1.0)
            parts.append(f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="{bar - 1}" fill="{colour}">'
                         f'<title>{escape(c)}, {escape(name)}: {pct(v)}</title></rect>'
                         f'<text x="{label_w + w + 3:.1f}" y="{y + bar - 1.5}" font-size="9" fill="#333">'
                         f'{pct(v, 0) if v is not None else "n/a"}</text>')
    parts.append(f'<line x1="{label_w}" x2="{label_w}" y1="{top - 2}" y2="{H - 4}" stroke="#888"/></svg>')
    return Markup("".join(parts))


def heatmap_legend() -> Markup:
    """The heatmap's colour scale, low to high attention: stops sampled from the very colour map the overlay is
    drawn with (tafl.imaging.heatmap), and its blend with the image, so the legend cannot drift from it."""
    import inspect

    import numpy as np

    W, H, left, right, bar_y, bar_h = 360, 40, 8, 8, 4, 14
    stops = jet(np.linspace(0.0, 1.0, 11)[None, :])[0]
    alpha = inspect.signature(overlay).parameters["alpha"].default
    grad = "".join(f'<stop offset="{i / (len(stops) - 1):.2f}" stop-color="#{r:02x}{g:02x}{b:02x}"/>'
                   for i, (r, g, b) in enumerate(stops.tolist()))
    desc = (f"Colour scale of the heatmap, blended at {alpha:.0%} over the image: dark blue is where the model "
            "paid the least attention, through cyan, green and yellow, to dark red where it paid the most (each "
            "heatmap is scaled to its own strongest spot, so the colours compare places within one image only).")
    parts = [_svg_open(W, H, "heatmap-legend", "Heatmap colours: low to high attention", desc, "chart legend",
                       "heatmap-legend"),
             f'<defs><linearGradient id="heatmap-legend-g" x1="0" x2="1" y1="0" y2="0">{grad}</linearGradient></defs>',
             f'<rect x="{left}" y="{bar_y}" width="{W - left - right}" height="{bar_h}" fill="url(#heatmap-legend-g)" '
             'stroke="#888" stroke-width="0.5"/>',
             f'<text x="{left}" y="{bar_y + bar_h + 14}" font-size="11" fill="#222">low attention</text>',
             f'<text x="{W - right}" y="{bar_y + bar_h + 14}" font-size="11" fill="#222" text-anchor="end">'
             'high attention</text>',
             f'<text x="{W / 2:.0f}" y="{bar_y + bar_h + 14}" font-size="10" fill="#57606a" text-anchor="middle">'
             f'blended {alpha:.0%} over the image</text></svg>']
    return Markup("".join(parts))


HEATMAP_LEGEND = heatmap_legend()


# ------------------------------------------------------------------ what the panel shows
def predicted_counts(st: ServingState, name: str, version: str) -> dict[str, float]:
    """Predictions per class of one model version since the worker started: the samples of the
    `tafl_predicted_class` counter that /metrics exports (this worker's; the service runs one)."""
    counter = st.counter
    if counter is None:
        return {}
    out: dict[str, float] = {}
    try:
        for family in counter.collect():
            for s in family.samples:
                if (s.name.endswith("_total") and s.labels.get("model") == name
                        and s.labels.get("version") == version):
                    out[s.labels.get("class_name", "")] = float(s.value)
    except Exception:  # noqa: BLE001 - the page still renders without the live mix
        log.warning("predicted-class counter could not be read", exc_info=True)
    return out


def _source_label(source: str) -> str:
    """Where the package came from, without a host path: a BentoML tag or a reload's label as is, a folder by
    its last name only."""
    if "/" in source or "\\" in source:
        return f"package folder …/{Path(source).name}"
    return source


def _signature(pkg) -> str:
    if pkg.signed_by:
        return f"verified: signed by trusted key {pkg.signed_by}"
    try:
        has_sig = (Path(pkg.path) / "SHA256SUMS.sig").is_file()
    except OSError:
        has_sig = False
    if has_sig:
        return "signed, but not verified here: the service has no trusted keys (TAFL_TRUSTED_KEYS)"
    return "unsigned; signatures are not required here (no TAFL_TRUSTED_KEYS)"


def _or(v: Any) -> Any:
    """A recorded value, or "?" where the package does not say."""
    return "?" if v is None else v


def _static_view(st: ServingState, model, index: int) -> dict[str, Any]:
    """The parts of a model's panel that change only with the package: rendered once per loaded package."""
    pkg = model.package
    # by content (the verified digests), not object identity: a reload of the same version with other files
    # renders anew, and a freed package's id reused by another cannot bring back its view
    key = (index, pkg.name, pkg.version, tuple(sorted(pkg.files.items())), pkg.signed_by)
    with st.page_lock:
        hit = st.page_cache.get(key)
    if hit is not None:
        return hit
    meta = pkg.meta
    names = pkg.class_names
    uid = f"m{index}-{hashlib.sha1(f'{pkg.name}:{pkg.version}'.encode()).hexdigest()[:8]}"
    met = meta.metrics
    acc = met.accuracy
    per_class = met.per_class_accuracy or [None] * len(names)
    counts = meta.training.train_class_counts or [None] * len(names)
    source = (meta.prior.source_prior if meta.prior else None) or []
    # the training mix is the training images' class shares, by the same rule as `tafl score`'s training share;
    # the source prior (the mix the probabilities assume) is shown beside it only where it differs
    shares = training_shares(meta) or [None] * len(names)
    assumed = [_num(source[i]) if i < len(source) else None for i in range(len(names))]
    differs = any(a is not None and (t is None or abs(a - t) > ASSUMED_GAP) for a, t in zip(assumed, shares))
    parent = meta.parent
    lineage = []
    if meta.parent_version:
        lineage.append(f"retrained from {parent.name or pkg.name} {meta.parent_version}"
                       + (f" (model.onnx sha256 {parent.model_sha256[:16]}…)" if parent.model_sha256 else ""))
    else:
        lineage.append("first version (no parent package)")
    run = meta.training.run
    view = {
        "uid": uid, "name": pkg.name, "version": pkg.version, "method": meta.method,
        "backbone": meta.backbone, "created": meta.created, "tafl_version": meta.tafl_version,
        "task": meta.task, "lineage": lineage,
        "training": (f"{_or(run.dataset)}, {_or(run.clients)} clients, {_or(run.rounds)} rounds, "
                     f"model from round {_or(meta.training.round)}") if run else None,
        "privacy": privacy_summary(meta.privacy.to_json()),
        "domain_check": detector_line(meta.domain.detector).replace("`", ""),
        "sets": sets_line(meta.sets).replace("`", ""),
        "checksums": sorted(pkg.files.items()), "model_sha256": pkg.files.get("model.onnx", "?"),
        "signature": _signature(pkg), "heatmap": meta.heatmap,
        "experts": meta.expert_names,
        "vote_rule": meta.vote.rule if meta.vote else None,
        "metrics_source": met.source, "has_metrics": bool(acc),
        "average": with_interval(met.average_accuracy, met.test_images, 1),  # with its 95% interval (Wilson)
        "accuracy_rows": [(k, pct(acc.get(k))) for k in DISTRIBUTIONS],
        "accuracy_svg": accuracy_chart(acc, met.average_accuracy, f"{uid}-acc",
                                       f"{pkg.name} {pkg.version}") if acc else None,
        "uniform_metrics": [(k.replace("_", " "), pct(v)) for k, v in met.uniform_metrics.items()
                            if _num(v) is not None],
        "classes": names, "class_rows": [
            {"index": i, "name": c, "train_images": counts[i] if i < len(counts) and counts[i] is not None else "—",
             "accuracy": pct(per_class[i] if i < len(per_class) else None),
             "train_share": shares[i], "assumed": assumed[i]} for i, c in enumerate(names)],
        "card": render_card(st, pkg.card),
        "intended_use": meta.intended_use,
        "summary": plain_summary(meta), "distributions_note": DISTRIBUTIONS_NOTE, "assumed_differs": differs,
        "site_rows": [{**r, **{k: pct(r[k]) for k in ("own", "own_balanced", "site_mix", "adapted", "oracle")}}
                      for r in site_rows(meta)], "sites_note": SITES_NOTE,
    }
    with st.page_lock:
        if len(st.page_cache) > STATIC_CACHE_MAX:  # reloads leave old versions behind
            st.page_cache.clear()
        st.page_cache[key] = view
    return view


def _live_view(st: ServingState, model, static: dict[str, Any]) -> dict[str, Any]:
    """The served case mix: predicted-class shares from the counter, and the EM estimate with its drift."""
    pkg = model.package
    names = pkg.class_names
    counts = predicted_counts(st, pkg.name, pkg.version)
    total = sum(counts.values())
    served = [counts.get(c, 0.0) / total if total else None for c in names]
    train = [r["train_share"] for r in static["class_rows"]]
    est_prior: list[float | None] = [None] * len(names)
    prior: dict[str, Any] = {"aware": model.monitor is not None}
    if model.monitor is not None:
        q, n, why = model.monitor.current()
        d = model.monitor.describe()
        est = d.get("estimate")
        prior.update(images_in_window=d["images_in_window"], window=d["window"], min_images=d["min_images"],
                     updated_at=d.get("updated_at"), fallback=why)
        if est:
            est_prior = [_num(v) for v in est["prior"]]
            prior.update(shift=_num(est.get("shift_from_source")), images=est.get("images"),
                         usable=q is not None)
    series = [("training mix", COLOURS["train"], train)]
    if total:
        series.append(("predicted since start", COLOURS["served"], served))
    if any(v is not None for v in est_prior):
        series.append(("estimated case mix", COLOURS["estimate"], est_prior))
    rows = [{**r, "served": pct(served[i]), "served_count": int(counts.get(r["name"], 0)),
             "estimate": pct(est_prior[i]), "train_pct": pct(r["train_share"]), "assumed_pct": pct(r["assumed"])}
            for i, r in enumerate(static["class_rows"])]
    dom = model.describe_domain()
    outside = dom["refused"] + dom["abstained"]
    return {"predicted_total": int(total), "rows": rows, "prior": prior,
            "outside": {"images": outside, "share": pct(dom["outside_share"]), "sent": dom["answered"] + outside},
            "shift": pct(prior.get("shift")) if prior.get("shift") is not None else None,
            "mix_svg": mix_chart(names, series, f"{static['uid']}-mix", f"{pkg.name} {pkg.version}")}


def panel_html(st: ServingState) -> str:
    """The models and the try-an-image form, as an HTML fragment."""
    registry = st.registry
    with registry.lock:
        loaded = [registry.models[n] for n in registry.order]
    models = []
    for i, m in enumerate(loaded):
        static = _static_view(st, m, i)
        models.append({**static, **_live_view(st, m, static), "providers": ", ".join(m.providers),
                       "source": _source_label(m.source), "site_prior": m.site_prior is not None,
                       "loaded_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(m.loaded_at))})
    s = st.settings
    return _templates(st).get_template("panel.html").render(models=models, max_mb=f"{s.max_upload_bytes / 2**20:g}",
                                                  max_frames=s.max_frames, pct=pct, legend=HEATMAP_LEGEND)


# ------------------------------------------------------------------ routes
def _html(body: str, start: float, status: int = 200) -> Response:
    headers = {**SECURITY_HEADERS, "Server-Timing": f"render;dur={1000 * (time.perf_counter() - start):.2f}"}
    return Response(body, status_code=status, media_type="text/html; charset=utf-8", headers=headers)


def _page_context(protected: bool, panel: str | None) -> dict[str, Any]:
    return {"protected": protected, "panel": Markup(panel) if panel is not None else None,
            "css": f"ui/static/ui.css?v={ASSETS['ui.css'][2]}", "js": f"ui/static/ui.js?v={ASSETS['ui.js'][2]}"}


async def page(request: Request) -> Response:
    """GET /: the whole page; with TAFL_API_TOKEN set, only the shell and the token form."""
    start = time.perf_counter()
    rid = request_id()
    try:
        st = of(request)
        protected = st.settings.token is not None
        panel = None if protected else panel_html(st)
        return _html(_templates(st).get_template("page.html").render(**_page_context(protected, panel)), start)
    except Exception as exc:  # noqa: BLE001 - the API's JSON error, never a traceback
        if not isinstance(exc, TaflError):
            log.error("page %s failed: %s", rid, type(exc).__name__, exc_info=exc)
        return error_response(exc, rid)


@endpoint("/ui/panel", audited=False, what="the page's model panel")
async def panel(request: Request, call: Call) -> Response:
    """GET /ui/panel: the models and the form as an HTML fragment; with a token, only for its bearer."""
    return _html(panel_html(call.state), call.start)


async def asset(request: Request) -> Response:
    """GET /ui/static/NAME: the page's stylesheet and script (public: they hold no model data)."""
    hit = ASSETS.get(request.path_params["name"])
    if hit is None:
        from tafl.errors import NotFound

        return error_response(NotFound("no such page asset; the page uses ui/static/ui.css and ui/static/ui.js"),
                              request_id())
    data, ctype, _ = hit
    return Response(data, media_type=ctype, headers={"Cache-Control": "public, max-age=86400",
                                                     "X-Content-Type-Options": "nosniff"})


def routes() -> list[Route]:
    return [Route("/", page, methods=["GET"]), Route("/ui/panel", panel, methods=["GET"]),
            Route("/ui/static/{name}", asset, methods=["GET"])]
