// ctl dashboard: renders the server's snapshots (server-sent events) and a run's detail (JSON).
// Every string from the server may come from a container (run names, log lines, crash signatures, reasons):
// it reaches the page through textContent or an attribute value, never as markup (no innerHTML anywhere).
"use strict";
(() => {
  const SVG = "http://www.w3.org/2000/svg";
  const VERDICTS = new Set(["ok", "finished", "slow", "stalled", "unreachable", "crashed", "warmup",
                            "no-baseline", "pending"]);
  const $ = (id) => document.getElementById(id);
  let selected = null;        // the run shown in detail (its id)
  let detailAsked = 0;        // when its detail was last fetched (ms)
  let snapshotTime = null;

  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }

  function svg(tag, attrs) {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
    return e;
  }

  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }

  function isNum(v) { return typeof v === "number" && isFinite(v); }

  function fixed(v, digits) { return isNum(v) ? v.toFixed(digits) : (v === null || v === undefined ? "-" : String(v)); }

  // 4600 -> 4.6K, 12800 -> 12.8K, 950 -> 950: as ctl status prints rates
  function rate(v) {
    if (!isNum(v)) return v === null || v === undefined ? "-" : String(v);
    const sign = v < 0 ? "-" : "";
    const a = Math.abs(v);
    for (const [suffix, scale] of [["", 1], ["K", 1e3], ["M", 1e6], ["G", 1e9], ["T", 1e12]]) {
      const s = a / scale;
      const text = scale === 1 || s >= 99.95 ? s.toFixed(0) : s.toFixed(1);
      if (parseFloat(text) < 1000 || suffix === "T") return sign + text + suffix;
    }
    return sign + a.toFixed(0);
  }

  function age(t) {
    if (!isNum(t) || !isNum(snapshotTime)) return "-";
    const d = Math.max(0, snapshotTime - t);
    if (d >= 86400) return (d / 86400).toFixed(0) + "d ago";
    if (d >= 3600) return (d / 3600).toFixed(0) + "h ago";
    if (d >= 60) return (d / 60).toFixed(0) + "m ago";
    return d.toFixed(0) + "s ago";
  }

  function clock(t) {
    if (!isNum(t)) return "-";
    return new Date(t * 1000).toLocaleString(undefined, { hour12: false });
  }

  function badge(verdict) {
    const name = VERDICTS.has(verdict) ? verdict : "pending";
    return el("span", String(verdict).toUpperCase(), "verdict v-" + name);
  }

  function cell(tr, text, cls) { const td = el("td", text, cls); tr.appendChild(td); return td; }

  // --- the runs table ----------------------------------------------------------------------------

  function spark(history, baseline) {
    const s = svg("svg", { class: "spark", viewBox: "0 0 120 22", preserveAspectRatio: "none" });
    const ys = history.filter(isNum);
    if (!ys.length) return s;
    let lo = Math.min(...ys), hi = Math.max(...ys);
    if (isNum(baseline)) { lo = Math.min(lo, baseline); hi = Math.max(hi, baseline); }
    if (hi === lo) { hi += 1; lo -= 1; }
    const y = (v) => 20 - ((v - lo) / (hi - lo)) * 18;
    const step = history.length > 1 ? 118 / (history.length - 1) : 0;
    const pts = [];
    history.forEach((v, i) => { if (isNum(v)) pts.push((1 + i * step).toFixed(1) + "," + y(v).toFixed(1)); });
    if (isNum(baseline)) {
      s.appendChild(svg("line", { x1: 0, x2: 120, y1: y(baseline).toFixed(1), y2: y(baseline).toFixed(1) }));
    }
    s.appendChild(svg("polyline", { points: pts.join(" "), "data-count": pts.length }));
    return s;
  }

  function renderRuns(snap) {
    const body = $("runs").tBodies[0];
    clear(body);
    for (const r of snap.runs) {
      const tr = el("tr");
      tr.dataset.id = String(r.id);
      tr.dataset.run = r.ct + "/" + r.run;
      tr.dataset.verdict = r.verdict;
      if (r.id === selected) tr.classList.add("selected");
      cell(tr, r.ct);
      cell(tr, r.run + (r.good ? " *" : ""), "run");
      cell(tr, r.host);
      cell(tr, r.state);
      cell(tr, r.step === null ? "-" : r.step, "num step");
      cell(tr, fixed(r.loss, 4), "num loss");
      cell(tr, rate(r.tok_s), "num");
      const vs = cell(tr, isNum(r.ratio) ? r.ratio.toFixed(2) + "x of " + rate(r.baseline_tok_s) : (r.no_ratio_why || "-"),
                      isNum(r.ratio) ? "num" : undefined);
      if (r.baseline) vs.title = "baseline " + r.baseline;
      cell(tr, r.eta, "num");
      cell(tr, "").appendChild(spark(r.history || [], r.baseline_tok_s));
      cell(tr, "", "verdict-cell").appendChild(badge(r.verdict));
      cell(tr, r.reason + (r.parent ? " (restarted from " + r.parent + ")" : ""), "why");
      tr.addEventListener("click", () => { location.hash = "run=" + r.id; });
      body.appendChild(tr);
    }
    $("no-runs").hidden = snap.runs.length > 0;
  }

  function renderHosts(snap) {
    const box = $("hosts");
    clear(box);
    for (const h of snap.hosts) {
      let text = h.name + ": ";
      if (h.state === "first poll") text += "first poll (" + fixed(h.polling_for, 0) + "s)";
      else if (h.state === "unreachable") text += "UNREACHABLE";
      else if (h.state === "error") text += "poll failed";
      else text += "answered " + age(h.polled_at) + " in " + fixed(h.seconds, 1) + "s";
      const div = el("div", text, "host " + (h.state === "unreachable" ? "unreachable" : h.state === "error" ? "error" : ""));
      div.dataset.host = h.name;
      div.dataset.state = h.state;
      if (h.error) div.title = h.error;
      else if (h.warnings && h.warnings.length) div.title = h.warnings.join("\n");
      box.appendChild(div);
    }
  }

  function renderRecent(snap) {
    const body = $("recent").tBodies[0];
    clear(body);
    const names = new Map(snap.recent.map((r) => [r.id, r.ct + "/" + r.run]));
    for (const r of snap.recent) {
      const tr = el("tr");
      tr.dataset.run = r.ct + "/" + r.run;
      cell(tr, r.ct);
      cell(tr, r.run + (r.good ? " *" : ""));
      cell(tr, r.state);
      cell(tr, r.exit_status === null ? "" : r.exit_status, "num");
      cell(tr, age(r.started));
      cell(tr, r.commit ? r.commit + (r.dirty ? "+dirty" : "") : "-");
      let lineage = "";
      if (r.parent_id !== null) {
        lineage = "from " + (names.get(r.parent_id) || "#" + r.parent_id);
        if (r.resumed_step !== null) lineage += " at step " + r.resumed_step;
      }
      cell(tr, lineage);
      tr.addEventListener("click", () => { location.hash = "run=" + r.id; });
      body.appendChild(tr);
    }
  }

  function renderEvents(list, ul) {
    clear(ul);
    for (const e of list.slice().reverse()) {
      const li = el("li");
      li.appendChild(el("time", clock(e.time)));
      li.appendChild(document.createTextNode(e.summary + (e.action && e.action !== "none" && e.action !== "logged"
        ? "  -> " + e.action : "")));
      ul.appendChild(li);
    }
  }

  function render(snap) {
    snapshotTime = snap.time;
    renderHosts(snap);
    renderRuns(snap);
    renderRecent(snap);
    renderEvents(snap.events, $("events"));
    $("no-events").hidden = snap.events.length > 0;
    $("updated").textContent = "updated " + clock(snap.time) + " (each host polled every " + snap.interval_s + "s)";
    document.body.dataset.version = String(snap.version);
    if (selected !== null && Date.now() - detailAsked > 1500) loadDetail(selected);
  }

  // --- one run -----------------------------------------------------------------------------------

  function chart(box, points, key, baseline) {
    clear(box);
    const W = 640, H = 220, L = 56, R = 12, T = 10, B = 24;
    const pts = points.filter((p) => isNum(p.step) && isNum(p[key]));
    box.dataset.count = String(pts.length);
    box.appendChild(svg("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }));
    box.appendChild(svg("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
    if (!pts.length) {
      const t = svg("text", { x: L + 10, y: H / 2 });
      t.textContent = "no points yet";
      box.appendChild(t);
      return;
    }
    const xs = pts.map((p) => p.step), ys = pts.map((p) => p[key]);
    let x0 = Math.min(...xs), x1 = Math.max(...xs);
    if (x1 === x0) x1 = x0 + 1;
    let y0 = key === "tok_s" ? 0 : Math.min(...ys), y1 = Math.max(...ys);
    if (baseline && isNum(baseline.tok_s)) y1 = Math.max(y1, baseline.tok_s);
    if (y1 === y0) y1 = y0 + 1;
    y1 += (y1 - y0) * 0.05;
    const X = (v) => L + ((v - x0) / (x1 - x0)) * (W - L - R);
    const Y = (v) => H - B - ((v - y0) / (y1 - y0)) * (H - T - B);
    const fmt = key === "tok_s" ? rate : (v) => v.toFixed(3);
    for (const [v, anchor] of [[y0, H - B], [y1, T + 8]]) {
      const t = svg("text", { x: 4, y: anchor });
      t.textContent = fmt(v);
      box.appendChild(t);
    }
    for (const [v, x, a] of [[x0, L, "start"], [x1, W - R, "end"]]) {
      const t = svg("text", { x: x, y: H - 6, "text-anchor": a });
      t.textContent = "step " + v;
      box.appendChild(t);
    }
    if (baseline && isNum(baseline.tok_s) && key === "tok_s") {
      const y = Y(baseline.tok_s).toFixed(1);
      box.appendChild(svg("line", { class: "baseline", x1: L, x2: W - R, y1: y, y2: y }));
      const t = svg("text", { x: W - R, y: Number(y) - 4, "text-anchor": "end" });
      t.textContent = "baseline " + rate(baseline.tok_s) + " (" + baseline.run + ")";
      box.appendChild(t);
    }
    box.appendChild(svg("polyline", {
      class: "series", "data-count": pts.length,
      points: pts.map((p) => X(p.step).toFixed(1) + "," + Y(p[key]).toFixed(1)).join(" "),
    }));
  }

  function renderDetail(d) {
    $("detail").hidden = false;
    $("detail").dataset.run = d.ct + "/" + d.run;
    $("detail-title").textContent = d.ct + "/" + d.run;
    chart($("chart-tok"), d.points, "tok_s", d.baseline);
    chart($("chart-loss"), d.points, "loss", null);
    const log = $("log");
    const atEnd = log.dataset.run !== d.ct + "/" + d.run || log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
    log.textContent = d.lines.length ? d.lines.join("\n") : "(no log lines read yet)";
    log.dataset.run = d.ct + "/" + d.run;
    if (atEnd) log.scrollTop = log.scrollHeight;  // follow the end, unless the reader scrolled up
    const dl = $("provenance");
    clear(dl);
    for (const [k, v] of Object.entries(d.provenance)) {
      if (v === null || v === undefined || v === "" || (typeof v === "object" && !Object.keys(v).length)) continue;
      dl.appendChild(el("dt", k));
      let text;
      if (k === "files") text = Object.entries(v).map(([dest, sha]) => String(sha).slice(0, 16) + "  " + dest).join("\n");
      else if (["created", "started", "ended"].includes(k)) text = clock(v);
      else text = typeof v === "object" ? JSON.stringify(v) : String(v);
      dl.appendChild(el("dd", text));
    }
    if (d.diff) {
      $("diff-title").textContent = "ctl diff " + d.diff.run + " " + d.ct + "/" + d.run + " (its " + d.diff.against + ")";
      $("diff").textContent = d.diff.text;
    } else {
      $("diff-title").textContent = "diff";
      $("diff").textContent = "no parent and no baseline to compare with";
    }
    renderEvents(d.events, $("run-events"));
  }

  async function loadDetail(id) {
    detailAsked = Date.now();
    try {
      const r = await fetch("api/run/" + encodeURIComponent(id), { credentials: "same-origin", cache: "no-store" });
      if (!r.ok) { $("detail").hidden = true; return; }
      const d = await r.json();
      if (d.id === selected) renderDetail(d);
    } catch (e) {
      // the next snapshot asks again
    }
  }

  function fromHash() {
    const m = /^#run=(\d+)$/.exec(location.hash);
    selected = m ? Number(m[1]) : null;
    for (const tr of $("runs").tBodies[0].rows) tr.classList.toggle("selected", Number(tr.dataset.id) === selected);
    if (selected === null) $("detail").hidden = true;
    else loadDetail(selected);
  }

  // --- live --------------------------------------------------------------------------------------

  function connect() {
    const live = $("live");
    const es = new EventSource("api/stream");
    es.addEventListener("snapshot", (e) => {
      live.textContent = "live";
      live.classList.remove("off");
      render(JSON.parse(e.data));
    });
    es.addEventListener("error", () => {
      live.textContent = "reconnecting";
      live.classList.add("off");
    });
  }

  window.addEventListener("hashchange", fromHash);
  fromHash();
  connect();
})();
