// The page's only script (tafl/serving/ui.py): the token form, the authenticated fetch of the model panel,
// and the try-an-image form, which posts to the same POST /predict as any client. Every value from the API
// is put in the page with textContent, never as HTML; nothing of an upload is kept once the tab closes.
(function () {
  "use strict";
  var KEY = "tafl.api-token";

  function $(id) { return document.getElementById(id); }

  function token() {
    try { return window.sessionStorage.getItem(KEY); } catch (e) { return null; }
  }

  function setToken(value) {
    try {
      if (value) { window.sessionStorage.setItem(KEY, value); } else { window.sessionStorage.removeItem(KEY); }
    } catch (e) { /* storage off: the token lives only as long as this page */ }
  }

  function authHeaders() {
    var t = token();
    return t ? { "Authorization": "Bearer " + t } : {};
  }

  // The API's own message for a failed call, or the status line when the answer is not the API's JSON.
  function apiMessage(resp) {
    return resp.text().then(function (text) {
      try {
        var body = JSON.parse(text);
        if (body && body.error && body.error.message) { return body.error.message; }
        if (Array.isArray(body) && body[0] && body[0].error) { return String(body[0].error); }
      } catch (e) { /* not JSON */ }
      return "the service answered HTTP " + resp.status + (resp.statusText ? " " + resp.statusText : "");
    });
  }

  function show(el, text) {
    if (!el) { return; }
    el.textContent = text || "";
    el.hidden = !text;
  }

  // ---------------------------------------------------------------- token and panel
  function loadPanel() {
    var tokenError = $("token-error");
    show(tokenError, "");
    return fetch("ui/panel", { headers: authHeaders(), cache: "no-store", credentials: "omit" })
      .then(function (resp) {
        if (!resp.ok) {
          return apiMessage(resp).then(function (msg) {
            if (resp.status === 401) { setToken(null); }
            show(tokenError, msg);
            if ($("token-section")) { $("token-section").hidden = false; }
          });
        }
        return resp.text().then(function (html) {
          // the fragment is rendered and escaped by the service; scripts in innerHTML never run
          $("panel").innerHTML = html;
          if ($("token-section")) { $("token-section").hidden = true; }
          $("forget-token").hidden = false;
          document.body.setAttribute("data-panel", "loaded");
        });
      })
      .catch(function () { show(tokenError, "the service could not be reached"); });
  }

  function onTokenSubmit(ev) {
    ev.preventDefault();
    var value = $("token-input").value.trim();
    if (!value) { return; }
    setToken(value);
    $("token-input").value = "";
    loadPanel();
  }

  function forgetToken() {
    setToken(null);
    $("panel").textContent = "";
    $("forget-token").hidden = true;
    if ($("token-section")) { $("token-section").hidden = false; }
    document.body.removeAttribute("data-panel");
  }

  // ---------------------------------------------------------------- try an image
  function pct(v) { return (100 * v).toFixed(1) + "%"; }

  function cell(row, text, header) {
    var c = document.createElement(header ? "th" : "td");
    if (header) { c.scope = "row"; }
    c.textContent = text;
    row.appendChild(c);
    return c;
  }

  function fillTable(id, rows) {
    var body = $(id).querySelector("tbody");
    body.textContent = "";
    rows.forEach(function (r) {
      var tr = document.createElement("tr");
      r.forEach(function (v, i) {
        if (v instanceof Node) { var td = document.createElement("td"); td.appendChild(v); tr.appendChild(td); }
        else { cell(tr, v, i === 0); }
      });
      body.appendChild(tr);
    });
  }

  function meter(v) {
    var m = document.createElement("meter");
    m.min = 0; m.max = 1; m.value = v;
    m.textContent = pct(v);
    var wrap = document.createElement("span");
    wrap.className = "prob";
    wrap.appendChild(m);
    var t = document.createElement("span");
    t.textContent = " " + pct(v);
    wrap.appendChild(t);
    return wrap;
  }

  function showResult(b) {
    var dom = $("res-domain");
    if (b.abstained) {  // outside the model's domain: no finding, and why
      $("res-answer").textContent = "No finding: the model abstained.";
      dom.textContent = "Outside the model's domain: " + b.domain.reason + ".";
      dom.className = "domain outside";
      dom.hidden = false;
    } else {
      $("res-answer").textContent = "Label: ";
      var strong = document.createElement("strong");
      strong.id = "res-label";
      strong.textContent = b.class_name + " (class " + b.label + ")";
      $("res-answer").appendChild(strong);
      $("res-answer").appendChild(document.createTextNode(" with probability " + pct(b.probability)));
      if (b.domain) {
        dom.textContent = "Within the model's domain: " + b.domain.reason + ".";
        dom.className = "domain";
        dom.hidden = false;
      } else {
        dom.hidden = true;
      }
    }
    var set = $("res-set"), ps = b.prediction_set;
    if (ps) {  // the conformal set beside the label: the classes the model cannot rule out, in words
      var at = ps.calibrated_for && ps.calibrated_for !== "the federation" ?
        ", calibrated at " + ps.calibrated_for : "";
      set.textContent = "Plausible classes (" + Math.round(ps.coverage * 100) + "% set" + at + "): " +
        (ps.classes.length ? ps.classes.join(", ") : "none at this level") +
        ". The true class is in such a set for " + Math.round(ps.coverage * 100) +
        "% of images of each class, whatever the case mix.";
      set.hidden = false;
    } else {
      set.textContent = b.abstained && "prediction_set" in b ? "No prediction set: the image lies outside the " +
        "model's domain." : "";
      set.hidden = !set.textContent;
    }
    $("res-model").textContent = b.model.name + " " + b.model.version;
    $("res-prior").textContent = b.prior.used + (b.prior.fallback ? " (" + b.prior.fallback + ")" : "");
    // technical facts only; the API puts no patient data in its answer, and none is rendered here
    $("res-input").textContent = b.input.kind + ", " + b.input.size[1] + "\u00d7" + b.input.size[0] + " px" +
      (b.input.frames > 1 ? ", " + b.input.frames + " frames (frame 0 shown)" : "");
    var probs = Object.keys(b.probabilities || {}).map(function (k) { return [k, b.probabilities[k]]; });
    $("res-probs").hidden = !probs.length;
    probs.sort(function (x, y) { return y[1] - x[1]; });
    fillTable("res-probs", probs.map(function (p) { return [p[0], meter(p[1])]; }));
    fillTable("res-experts", (b.experts || []).map(function (e) {
      return [e.name, e.class_name + " (class " + e.label + ")", pct(e.probability)];
    }));
    $("res-experts").hidden = !(b.experts && b.experts.length);
    var img = $("res-heatmap");
    if (b.heatmap && b.heatmap.png_base64) {
      img.alt = "Heatmap (" + b.heatmap.kind + ") over the uploaded image, for the predicted class " + b.class_name;
      img.src = "data:image/png;base64," + b.heatmap.png_base64;
      $("res-caption").textContent = "Heatmap: " + b.heatmap.kind + ". A hint of where the model looked, not a segmentation.";
      $("res-figure").hidden = false;
    } else {
      img.removeAttribute("src");
      $("res-figure").hidden = true;
    }
    $("try-result").hidden = false;
    $("try-result").setAttribute("data-request-id", b.request_id || "");
  }

  function onTrySubmit(ev) {
    ev.preventDefault();
    var form = ev.target;
    var file = $("try-file").files[0];
    show($("try-error"), "");
    $("try-result").hidden = true;
    if (!file) { show($("try-error"), "choose an image file first"); return; }
    var data = new FormData();
    data.append("file", file, "upload");  // the file's own name is not sent: it can carry patient data
    data.append("heatmap", "true");
    data.append("model", form.elements.model.value);
    data.append("prior", form.elements.prior.value);
    $("try-submit").disabled = true;
    $("try-status").textContent = "Classifying…";
    fetch("predict", { method: "POST", body: data, headers: authHeaders(), cache: "no-store", credentials: "omit" })
      .then(function (resp) {
        if (!resp.ok) {
          return apiMessage(resp).then(function (msg) { show($("try-error"), msg); $("try-status").textContent = ""; });
        }
        return resp.json().then(function (b) {
          showResult(b);
          $("try-status").textContent = "Done in " + Math.round(b.timing_ms.total) + " ms.";
        });
      })
      .catch(function () { show($("try-error"), "the service could not be reached"); $("try-status").textContent = ""; })
      .then(function () { $("try-submit").disabled = false; });
  }

  document.addEventListener("submit", function (ev) {
    if (ev.target.id === "token-form") { onTokenSubmit(ev); }
    else if (ev.target.id === "try-form") { onTrySubmit(ev); }
  });

  document.addEventListener("DOMContentLoaded", function () {
    $("forget-token").addEventListener("click", forgetToken);
    if (document.body.getAttribute("data-protected") === "true") {
      if (token()) { loadPanel(); }
    } else {
      document.body.setAttribute("data-panel", "loaded");
    }
  });
})();
