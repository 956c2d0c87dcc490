// The operator's page (control/src/rollout/operator.html): polls the rollout controller's admin
// API and draws it. Every value from the API goes into the page as text (textContent, SVG
// attributes), never as markup: reasons, notes and feedback are written by people.
//
// The admin token lives in this tab's sessionStorage only. A link may carry
// `#token=...&route=...&action=pause|resume|rollback|kill`: the token is taken, the address
// bar cleared, and the action run once. An action in a link runs only with a token from the
// same link, never with the stored one, so a crafted link cannot act with a token the reader
// already set.
"use strict";

const TOKEN_KEY = "hindsight.admin_token";
const BY_KEY = "hindsight.operator";
const ACTIONS = ["pause", "resume", "rollback", "kill"];
const ACTIVE = ["running", "paused", "frozen"];
const REFRESH_MS = 3000;

let token = sessionStorage.getItem(TOKEN_KEY) || "";
let auditRoute = null;

const $ = (id) => document.getElementById(id);

// An element with attributes and children (strings become text nodes).
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "text") e.textContent = v;
    else if (k === "onclick") e.addEventListener("click", v);
    else if (v !== undefined && v !== null && v !== false) e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

function svg(tag, attrs) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "text") e.textContent = v;
    else e.setAttribute(k, String(v));
  }
  return e;
}

function table(headers, rows) {
  return el("table", {},
    el("thead", {}, el("tr", {}, ...headers.map((h) => el("th", { text: h })))),
    el("tbody", {}, ...rows));
}

function cell(v, cls) {
  return el("td", { class: cls }, v instanceof Node ? v : fmt(v));
}

function fmt(v, digits = 3) {
  if (v === null || v === undefined || v === "") return "–";
  if (typeof v === "number") return Number.isInteger(v) ? String(v) : v.toFixed(digits);
  return String(v);
}

function pct(v) {
  return typeof v === "number" ? (100 * v).toFixed(1) + "%" : "–";
}

function when(ms) {
  return typeof ms === "number" ? new Date(ms).toISOString().slice(0, 19).replace("T", " ") + "Z" : "–";
}

function authHeaders() {
  return token ? { authorization: "Bearer " + token } : {};
}

// The server's own message for a refusal: `401: a valid bearer token is required ...`.
async function failure(r) {
  let message = r.statusText;
  try {
    const body = await r.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch (_) { /* not JSON */ }
  return r.status + ": " + message;
}

async function getJSON(path) {
  const r = await fetch(path, { headers: authHeaders(), cache: "no-store" });
  if (!r.ok) throw new Error(path + " — " + (await failure(r)));
  return r.json();
}

function setToken(t) {
  token = t;
  if (t) sessionStorage.setItem(TOKEN_KEY, t);
  else sessionStorage.removeItem(TOKEN_KEY);
  $("token-state").textContent = t
    ? "token set: actions enabled (kept in this tab only)"
    : "read-only: set the admin token to act";
  $("token-state").className = t ? "ok" : "muted";
}

function say(text, ok) {
  const p = $("action-result");
  p.textContent = text;
  p.className = ok ? "ok" : "err";
}

// One operator command through the admin API; the answer (or the refusal, with the server's
// reason) is shown at the top of the page.
async function act(route, action, generation) {
  if (!token) {
    say(action + " on " + route + ": set the admin token first", false);
    return;
  }
  const body = { action, by: $("by").value.trim() || "page" };
  if (typeof generation === "number") body.generation = generation;
  try {
    const r = await fetch("/v1/rollouts/" + encodeURIComponent(route), {
      method: "POST",
      headers: Object.assign({ "content-type": "application/json" }, authHeaders()),
      body: JSON.stringify(body),
      cache: "no-store",
    });
    if (r.ok) {
      const done = await r.json();
      const gen = done.route ? " (generation " + done.route.generation + ")" : "";
      say(action + " on " + route + ": done" + gen, true);
    } else {
      say(action + " on " + route + " refused: " + (await failure(r)), false);
    }
  } catch (e) {
    say(action + " on " + route + " failed: " + e.message, false);
  }
  await refresh();
}

function actionButtons(route) {
  const r = route.rollout;
  if (!r || !ACTIVE.includes(r.state)) return el("span", { class: "muted", text: "–" });
  const span = el("span", {});
  for (const a of ACTIONS) {
    if (a === "pause" && r.state !== "running") continue;
    if (a === "resume" && r.state === "running") continue;
    span.append(el("button", {
      type: "button",
      "data-action": a,
      "data-route": route.route,
      title: token ? a + " this rollout" : "needs the admin token",
      onclick: () => {
        if ((a === "kill" || a === "rollback") && !window.confirm(a + " the rollout on " + route.route + "?")) return;
        act(route.route, a, route.generation);
      },
    }, a));
  }
  return span;
}

// The controller writes its decision as `Wait("waiting for ...")`; the page says `wait: waiting for ...`.
function decision(text) {
  const m = /^(\w+)\("(.*)"\)$/s.exec(text || "");
  return m ? m[1].toLowerCase() + ": " + m[2].replace(/\\"/g, '"') : fmt(text);
}

function renderRoutes(routes) {
  const rows = routes.map((entry) => {
    if (entry.malformed) return el("tr", {}, el("td", { colspan: 9, class: "err", text: "malformed entry: " + entry.malformed }));
    const r = entry.route;
    const ro = r.rollout;
    const view = entry.controller;
    return el("tr", { "data-route": r.route },
      cell(r.route),
      cell(r.generation, "num"),
      el("td", { class: "version stable" }, r.stable),
      el("td", { class: "version canary" }, ro ? ro.canary : "–"),
      el("td", { class: ro ? "state-" + ro.state : "" }, ro ? ro.state : "no rollout"),
      cell(ro ? (ro.stage + 1) + " of " + ro.stages.length + " [" + ro.stages.join(", ") + "]" : "–"),
      cell(ro ? pct(ro.weight) : "–", "num"),
      cell(view ? decision(view.decision) + " (" + when(view.at_ms) + ")" : "–"),
      el("td", {}, actionButtons(r)));
  });
  $("routes").replaceChildren(routes.length
    ? table(["route", "gen", "stable", "canary", "state", "stage", "canary weight", "controller", "actions"], rows)
    : el("p", { class: "muted", text: "no routes yet" }));
}

// canary − stable intervals against their margins, one row per guard.
function intervalPlot(guards) {
  const rows = Object.entries(guards).filter(([, g]) => Array.isArray(g.canary_minus_stable));
  const W = 560, H = 26 * rows.length + 30, L = 190, R = 20;
  const s = svg("svg", { width: W, height: H, viewBox: "0 0 " + W + " " + H, class: "intervals" });
  rows.forEach(([name, g], i) => {
    const [lo, hi] = g.canary_minus_stable;
    const m = g.margin;
    const finite = [lo, hi, m, -m, 0].filter((v) => Number.isFinite(v));
    let a = Math.min(...finite), b = Math.max(...finite);
    if (b - a < 1e-9) { a -= 1; b += 1; }
    const pad = (b - a) * 0.08;
    a -= pad; b += pad;
    const x = (v) => L + (Math.min(b, Math.max(a, v)) - a) / (b - a) * (W - L - R);
    const y = 20 + i * 26;
    s.append(svg("text", { x: 4, y: y + 4, text: name + " (" + g.verdict + ")" }));
    s.append(svg("line", { x1: x(0), x2: x(0), y1: y - 9, y2: y + 9, stroke: "#999" }));
    if (Number.isFinite(m)) s.append(svg("line", { x1: x(m), x2: x(m), y1: y - 9, y2: y + 9, stroke: "#b3261e", "stroke-width": 2 }));
    const loX = Number.isFinite(lo) ? x(lo) : L, hiX = Number.isFinite(hi) ? x(hi) : W - R;
    s.append(svg("path", { d: "M" + loX + " " + y + " H" + hiX, stroke: g.verdict === "Harm" ? "#b3261e" : "#1f5fa8", "stroke-width": 5, "stroke-linecap": "round" }));
    s.append(svg("text", { x: W - R, y: y - 6, "text-anchor": "end", text: "[" + fmt(lo, 4) + ", " + fmt(hi, 4) + "]" }));
  });
  return s;
}

function renderMetrics(routes) {
  const out = [];
  for (const entry of routes) {
    const view = entry.controller;
    const stats = view && view.stats;
    if (!stats || !stats.canary || !stats.stable) continue;
    const c = stats.canary, st = stats.stable;
    out.push(el("h3", { text: entry.route.route + " — rollout " + view.rollout_id + " (" + view.state + ")" }));
    const keys = Object.keys(c).filter((k) => k !== "version");
    const tests = el("div", {});
    const guards = stats.guards || {};
    if (Object.values(guards).some((g) => Array.isArray(g.canary_minus_stable))) {
      tests.append(el("p", { class: "muted", text: "canary − stable (bar), 0 (grey), margin (red):" }), intervalPlot(guards));
    }
    const drift = Object.entries(guards).filter(([, g]) => "ratio" in g);
    if (drift.length) {
      tests.append(table(["drift test", "stable mean", "canary mean", "allowed ratio", "verdict"],
        drift.map(([k, g]) => el("tr", {}, cell(k), cell(g.stable_mean, "num"), cell(g.canary_mean, "num"), cell(g.ratio, "num"), cell(g.verdict)))));
    }
    out.push(el("div", { class: "plots" },
      table(["metric", "stable " + st.version, "canary " + c.version],
        keys.map((k) => el("tr", {}, cell(k), cell(st[k], "num"), cell(c[k], "num")))),
      tests));
  }
  $("metrics").replaceChildren(...(out.length ? out : [el("p", { class: "muted", text: "no rollout with exposures on both arms yet" })]));
}

async function renderAudit(routes) {
  const names = routes.filter((e) => e.route).map((e) => e.route.route);
  if (!names.length) {
    $("audit").replaceChildren(el("p", { class: "muted", text: "no routes yet" }));
    return;
  }
  if (!names.includes(auditRoute)) auditRoute = names[0];
  const select = el("select", { id: "audit-route" }, ...names.map((n) => el("option", { value: n, selected: n === auditRoute }, n)));
  select.addEventListener("change", () => { auditRoute = select.value; refresh(); });
  const h = await getJSON("/v1/rollouts/" + encodeURIComponent(auditRoute) + "/history?limit=25");
  const rows = h.audit.map((a) => el("tr", {},
    cell(a.generation, "num"), cell(when(a.at_ms)), cell(a.action), cell(a.by), cell(pct(a.weight), "num"), cell(a.reason)));
  $("audit").replaceChildren(el("label", {}, "route ", select),
    rows.length ? table(["gen", "at", "action", "by", "canary weight", "reason"], rows) : el("p", { class: "muted", text: "no audit records" }));
}

function renderAdapters(list) {
  if (!list.length) {
    $("adapters").replaceChildren(el("p", { class: "muted", text: "no adapter versions registered" }));
    return;
  }
  // Lineage per name: the newest version's chain of parents.
  const byTag = new Map(list.map((a) => [a.name + "@" + a.version, a]));
  const newest = new Map();
  for (const a of list) newest.set(a.name, a);
  const chains = [...newest.values()].map((a) => {
    const chain = [];
    for (let v = a; v && chain.length < 50; v = v.parent == null ? null : byTag.get(a.name + "@" + v.parent)) chain.unshift("v" + v.version + " (" + v.status + ")");
    return el("li", {}, a.name + ": " + chain.join(" → "));
  });
  const rows = list.slice().reverse().map((a) => {
    const e = a.eval;
    const gate = e ? (e.verdict || "?") + ": " + pct(e.candidate_exact_match) + " vs live " + pct(e.live_exact_match) + " (Δ " + fmt(e.delta) + ")" : "–";
    const offsets = (a.offsets || []).map((o) => o.topic + "[" + o.partition + "] " + o.from + "–" + o.to).join(", ");
    return el("tr", {},
      el("td", { class: "version" }, a.tag), cell(a.parent == null ? "–" : "v" + a.parent), cell(a.status),
      cell(a.examples, "num"), cell(a.tokens, "num"), cell(offsets), cell(gate), cell(when(a.created_at_ms)), cell(a.note));
  });
  $("adapters").replaceChildren(el("ul", {}, ...chains),
    table(["version", "parent", "status", "examples", "tokens", "offsets learned from", "eval gate", "created", "note"], rows));
}

// A line plot of (x, y) points with vertical marks (candidates).
function linePlot(title, pts, marks) {
  const W = 400, H = 220, L = 56, R = 14, T = 24, B = 32;
  const s = svg("svg", { width: W, height: H, viewBox: "0 0 " + W + " " + H, class: "plot" });
  s.append(svg("text", { x: L, y: 15, text: title }));
  const xs = pts.map((p) => p[0]), ys = pts.map((p) => p[1]);
  let x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { y0 -= 1; y1 += 1; }
  const X = (v) => L + (v - x0) / (x1 - x0) * (W - L - R);
  const Y = (v) => H - B - (v - y0) / (y1 - y0) * (H - T - B);
  s.append(svg("path", { d: "M" + L + " " + T + " V" + (H - B) + " H" + (W - R), stroke: "#888", fill: "none" }));
  s.append(svg("text", { x: L - 4, y: T + 4, "text-anchor": "end", text: fmt(y1) }));
  s.append(svg("text", { x: L - 4, y: H - B, "text-anchor": "end", text: fmt(y0) }));
  s.append(svg("text", { x: L, y: H - B + 16, text: fmt(x0) }));
  s.append(svg("text", { x: W - R, y: H - B + 16, "text-anchor": "end", text: fmt(x1) + " steps" }));
  for (const [mx, label] of marks) {
    if (mx < x0 || mx > x1) continue;
    s.append(svg("line", { x1: X(mx), x2: X(mx), y1: T, y2: H - B, stroke: "#a15c00", "stroke-dasharray": "4 3" }));
    s.append(svg("text", { x: X(mx) + 3, y: T + 10, text: label }));
  }
  s.append(svg("path", { class: "curve", d: pts.map((p, i) => (i ? "L" : "M") + X(p[0]).toFixed(1) + " " + Y(p[1]).toFixed(1)).join(" "), stroke: "#1f5fa8", fill: "none", "stroke-width": 1.5 }));
  if (pts.length < 40) for (const p of pts) s.append(svg("circle", { cx: X(p[0]), cy: Y(p[1]), r: 2.5, fill: "#1f5fa8" }));
  return s;
}

function renderLearning(curve) {
  const pts = curve.points.filter((p) => !p.skipped);
  if (!pts.length) {
    $("learning").replaceChildren(el("p", { class: "muted", text: "no training steps in the learner's run log yet (" + (curve.run_log || "rollout.run_log is empty") + ")" }));
    return;
  }
  const x = (p, i) => (typeof p.step === "number" ? p.step : i + 1);
  const stepOfBatch = (batch) => {
    let step = null;
    pts.forEach((p, i) => { if (p.batch <= batch) step = x(p, i); });
    return step;
  };
  const marks = curve.candidates
    .map((c) => [stepOfBatch(c.batch), "v" + c.version + " " + (c.status || "")])
    .filter(([m]) => m !== null);
  const series = (key) => pts.map((p, i) => [x(p, i), p[key]]).filter(([, v]) => typeof v === "number" && Number.isFinite(v));
  const plots = [];
  for (const [key, title] of [["loss", "training loss"], ["kl_to_base", "KL(policy ‖ base) per token"], ["grad_norm", "gradient norm"]]) {
    const s = series(key);
    if (s.length) plots.push(linePlot(title, s, marks));
  }
  $("learning").replaceChildren(...plots);
}

function renderFeedback(fb) {
  if (!fb.feedback.length) {
    $("feedback").replaceChildren(el("p", { class: "muted", text: "no feedback read yet" }));
    return;
  }
  const value = (f) => (f.thumbs_up === true ? "up" : f.thumbs_up === false ? "down" : f.score != null ? fmt(f.score) + (f.metric ? " " + f.metric : "") : "");
  const rows = fb.feedback.map((f) => el("tr", {},
    cell(when(f.event_time_ms)), cell(f.kind), cell(value(f)),
    el("td", { class: "version" }, f.version ? f.route + " / " + f.arm + " / " + f.version : "–"),
    cell(f.target_kind + " " + f.target), cell(fb.detail_hidden ? "(needs the admin token)" : f.detail)));
  $("feedback").replaceChildren(table(["accepted", "kind", "value", "route / arm / version", "about", "text"], rows));
}

let refreshing = false;

async function refresh() {
  if (refreshing) return;
  refreshing = true;
  const errors = [];
  const part = async (f) => { try { await f(); } catch (e) { errors.push(e.message); } };
  try {
    await part(async () => {
      const data = await getJSON("/v1/rollouts");
      const routes = data.routes.slice().sort((a, b) => ((a.route || {}).route || "").localeCompare((b.route || {}).route || ""));
      renderRoutes(routes);
      renderMetrics(routes);
      await renderAudit(routes);
    });
    await Promise.all([
      part(async () => renderAdapters((await getJSON("/v1/adapters")).adapters)),
      part(async () => renderLearning(await getJSON("/v1/learning"))),
      part(async () => renderFeedback(await getJSON("/v1/feedback/recent?limit=30"))),
    ]);
    $("load-error").textContent = errors.join("; ");
    $("refreshed").textContent = "updated " + when(Date.now());
  } finally {
    refreshing = false;
  }
}

// A link's token and action (see the top of this file); the address bar keeps neither.
function fromLink() {
  if (location.hash.length < 2) return null;
  const h = new URLSearchParams(location.hash.slice(1));
  history.replaceState(null, "", location.pathname + location.search);
  const t = h.get("token");
  if (!t) return null;
  setToken(t);
  const action = h.get("action"), route = h.get("route");
  return action && route && ACTIONS.includes(action) ? { action, route } : null;
}

async function main() {
  $("by").value = sessionStorage.getItem(BY_KEY) || "";
  $("by").addEventListener("change", () => sessionStorage.setItem(BY_KEY, $("by").value.trim()));
  $("token-set").addEventListener("click", () => { setToken($("token").value.trim()); $("token").value = ""; refresh(); });
  $("token-forget").addEventListener("click", () => { setToken(""); refresh(); });
  setToken(token);
  const linked = fromLink();
  if (linked) await act(linked.route, linked.action);
  else await refresh();
  setInterval(refresh, REFRESH_MS);
}

main();
