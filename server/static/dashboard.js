// kvtier cache server dashboard: polls /api/stats and draws plain SVG charts.
// No dependencies, no build step.
"use strict";

const PALETTE = ["#58a6ff", "#3fb950", "#d29922", "#f778ba", "#a371f7", "#39c5cf", "#f85149", "#8b949e"];
const SVG_NS = "http://www.w3.org/2000/svg";
const params = new URLSearchParams(location.search);
const POLL_MS = Math.max(250, Number(params.get("interval_ms") || 1000));

function $(id) { return document.getElementById(id); }

function fmtBytes(n) {
  if (n === null || n === undefined || !isFinite(n)) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? n.toFixed(0) : n.toFixed(1)) + " " + units[i];
}
function fmtRate(r) { return r === null || r === undefined ? "–" : (100 * r).toFixed(1) + " %"; }
function fmtNum(n) {
  if (n === null || n === undefined || !isFinite(n)) return "–";
  if (Math.abs(n) >= 1e6) return (n / 1e6).toFixed(1) + " M";
  if (Math.abs(n) >= 1e3) return (n / 1e3).toFixed(1) + " k";
  return Math.abs(n) < 10 && n % 1 ? n.toFixed(2) : n.toFixed(0);
}
function ratio(hits, asked) { return asked > 0 ? hits / asked : null; }
function fmtDuration(s) {
  s = Math.floor(s);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  return (h ? h + " h " : "") + (h || m ? m + " min " : "") + sec + " s";
}

// Sets text and a machine-readable data-value (tests read it from the DOM).
function setValue(id, value, text) {
  const el = $(id);
  if (!el) return;
  el.textContent = text;
  el.dataset.value = value === null || value === undefined ? "" : String(value);
}

function el(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

// series: [{name, color, points: [[t, value|null], ...]}]; opts: {yMax, format}
function lineChart(svg, series, opts) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const box = svg.getBoundingClientRect();
  const W = Math.max(260, box.width || 600), H = Math.max(150, box.height || 210);
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const left = 62, right = 10, top = 22, bottom = 20;
  const pts = series.flatMap(s => s.points.filter(p => p[1] !== null));
  let drawn = 0;
  if (pts.length === 0) {
    svg.appendChild(el("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, "no data yet"));
    svg.dataset.points = "0";
    return;
  }
  const t0 = Math.min(...series.flatMap(s => s.points.map(p => p[0])));
  const t1 = Math.max(...series.flatMap(s => s.points.map(p => p[0])), t0 + 1);
  let yMax = opts.yMax !== undefined ? opts.yMax : Math.max(...pts.map(p => p[1]));
  if (!(yMax > 0)) yMax = 1;
  const x = t => left + (W - left - right) * (t - t0) / (t1 - t0);
  const y = v => top + (H - top - bottom) * (1 - v / yMax);
  for (let i = 0; i <= 4; i++) {
    const v = yMax * i / 4, yy = y(v);
    svg.appendChild(el("line", { x1: left, x2: W - right, y1: yy, y2: yy, class: "grid" }));
    svg.appendChild(el("text", { x: left - 6, y: yy + 3, "text-anchor": "end", class: "axis-label" }, opts.format(v)));
  }
  svg.appendChild(el("text", { x: left, y: H - 4, class: "axis-label" }, "-" + Math.round(t1 - t0) + " s"));
  svg.appendChild(el("text", { x: W - right, y: H - 4, "text-anchor": "end", class: "axis-label" }, "now"));
  let lx = left;
  series.forEach((s, i) => {
    const color = s.color || PALETTE[i % PALETTE.length];
    let d = "", pen = false;
    for (const [t, v] of s.points) {
      if (v === null) { pen = false; continue; }
      d += (pen ? "L" : "M") + x(t).toFixed(1) + "," + y(Math.min(v, yMax)).toFixed(1);
      pen = true; drawn++;
    }
    if (d) svg.appendChild(el("path", { d, class: "series", stroke: color }));
    const label = el("text", { x: lx + 12, y: 12, class: "legend", fill: color }, s.name);
    svg.appendChild(el("rect", { x: lx, y: 4, width: 9, height: 9, fill: color }));
    svg.appendChild(label);
    lx += 22 + 6.5 * s.name.length;
  });
  svg.dataset.points = String(drawn);
}

function tierNames(data) { return data.tiers.map(t => t.name); }

function render(data) {
  const recent = data.recent;
  const st = $("status");
  st.textContent = data.ready ? "serving" : "draining";
  st.className = "badge " + (data.ready ? "ok" : "warn");
  $("address").textContent = data.address + (data.data_port ? " · data plane :" + data.data_port : "");
  $("version").textContent = "v" + data.version + (data.open ? " · open" : " · tokens required");
  $("uptime").textContent = "up " + fmtDuration(data.uptime_s);
  $("updated").textContent = "updated " + new Date(data.t * 1000).toLocaleTimeString();

  const T = data.totals;
  setValue("kpi-lookup-hit-rate", recent ? recent.lookup_hit_rate : null, fmtRate(recent && recent.lookup_hit_rate));
  setValue("kpi-get-hit-rate", recent ? recent.get_hit_rate : null, fmtRate(recent && recent.get_hit_rate));
  setValue("kpi-bytes-in", recent ? recent.bytes_in_per_s : null, recent ? fmtBytes(recent.bytes_in_per_s) : "–");
  setValue("kpi-bytes-out", recent ? recent.bytes_out_per_s : null, recent ? fmtBytes(recent.bytes_out_per_s) : "–");
  setValue("kpi-requests", recent ? recent.requests_per_s : null, recent ? fmtNum(recent.requests_per_s) : "–");
  setValue("kpi-errors", recent ? recent.errors_per_s : null, recent ? fmtNum(recent.errors_per_s) : "–");
  const lhr = ratio(T.lookup_hits, T.lookup_keys), ghr = ratio(T.get_hits, T.get_keys);
  setValue("total-lookup-hit-rate", lhr, fmtRate(lhr));
  setValue("total-get-hit-rate", ghr, fmtRate(ghr));
  $("total-bytes-in").textContent = fmtBytes(T.bytes_in);
  $("total-bytes-out").textContent = fmtBytes(T.bytes_out);
  $("total-requests").textContent = fmtNum(T.requests);
  $("total-errors").textContent = fmtNum(T.errors);

  const S = data.series;
  const names = tierNames(data);
  const hitSeries = [
    { name: "lookup", points: S.map(p => [p.t - data.t, p.lookup_hit_rate]) },
    { name: "get", points: S.map(p => [p.t - data.t, p.get_hit_rate]) },
  ];
  for (const n of names) {
    hitSeries.push({ name: n + " get", points: S.map(p => [p.t - data.t, p.tiers[n] ? p.tiers[n].get_hit_rate : null]) });
  }
  lineChart($("chart-hit-rates"), hitSeries, { yMax: 1, format: v => (100 * v).toFixed(0) + "%" });
  lineChart($("chart-bytes"), [
    { name: "in", points: S.map(p => [p.t - data.t, p.bytes_in_per_s]) },
    { name: "out", points: S.map(p => [p.t - data.t, p.bytes_out_per_s]) },
  ], { format: v => fmtBytes(v) + "/s" });
  lineChart($("chart-used"), names.map(n => ({
    name: n, points: S.map(p => [p.t - data.t, p.tiers[n] ? p.tiers[n].used_bytes : null]),
  })), { format: fmtBytes });
  const evSeries = [];
  for (const n of names) {
    evSeries.push({ name: n + " evictions", points: S.map(p => [p.t - data.t, p.tiers[n] ? p.tiers[n].evictions_per_s : null]) });
  }
  evSeries.push({ name: "request errors", color: "#f85149", points: S.map(p => [p.t - data.t, p.errors_per_s]) });
  lineChart($("chart-evictions"), evSeries, { format: v => fmtNum(v) });

  const tb = $("tiers").tBodies[0];
  tb.innerHTML = "";
  for (const t of data.tiers) {
    const fill = t.capacity_bytes ? t.used_bytes / t.capacity_bytes : null;
    const row = tb.insertRow();
    row.dataset.tier = t.name;
    const cells = [t.name, fmtBytes(t.used_bytes), t.capacity_bytes ? fmtBytes(t.capacity_bytes) : "–", "",
      t.blocks === null ? "–" : fmtNum(t.blocks), fmtRate(ratio(t.get_hits, t.get_hits + t.get_misses)),
      fmtRate(ratio(t.contains_hits, t.contains_hits + t.contains_misses)), fmtNum(t.evictions), fmtNum(t.errors)];
    cells.forEach((c, i) => { row.insertCell().textContent = c; });
    if (fill !== null) {
      const bar = document.createElement("div");
      bar.className = "bar";
      const inner = document.createElement("div");
      inner.style.width = Math.min(100, 100 * fill).toFixed(1) + "%";
      if (fill > 0.9) inner.style.background = "var(--warn)";
      bar.appendChild(inner);
      row.cells[3].appendChild(bar);
    }
  }
  const nb = $("tenants").tBodies[0];
  nb.innerHTML = "";
  for (const t of data.tenants) {
    const row = nb.insertRow();
    row.dataset.tenant = t.name;
    [t.name, fmtNum(t.requests_per_s), fmtBytes(t.bytes_per_s) + "/s", fmtNum(t.requests), fmtNum(t.errors),
      fmtBytes(t.bytes_in), fmtBytes(t.bytes_out), fmtRate(ratio(t.lookup_hits, t.lookup_keys)),
      fmtRate(ratio(t.get_hits, t.get_keys))].forEach(c => { row.insertCell().textContent = c; });
  }
  document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
}

// With server.http_require_token the browser asked for a name and password when the page
// loaded (password: a tenant token); it sends them again with these same-origin polls.
const REFUSED = {
  401: "token required: reload and sign in (any user name, a tenant token as password)",
  403: "this token's role may not read the dashboard (server.http_role)",
};

async function poll() {
  try {
    // location.origin, not a relative URL: a page opened as http://user:token@host/ has
    // credentials in its URL, and fetch refuses URLs that carry them
    const resp = await fetch(location.origin + "/api/stats", { cache: "no-store", credentials: "same-origin" });
    if (!resp.ok) throw new Error(REFUSED[resp.status] || "HTTP " + resp.status);
    render(await resp.json());
  } catch (e) {
    const st = $("status");
    st.textContent = "unreachable (" + e.message + ")";
    st.className = "badge bad";
  } finally {
    setTimeout(poll, POLL_MS);
  }
}
poll();
