"""The dashboard's one HTML page: live (it polls /snapshot.json) or exported (the snapshot and plotly inside).

The charts are plotly.js, the copy bundled in the plotly wheel (`plotly.offline.get_plotlyjs`), so neither the live
page nor an export reaches any network. The page's own script only turns a snapshot into the fleet table, the
event list and four charts (a standalone run: its loss and eval per step), and a fifth, each island's task accuracy
with its interval, where the run evaluates a task (--eval-task); the numbers come from `yeto.watch.snapshot`.
"""

from __future__ import annotations

import json
from typing import Any

from yeto import YetoError

POLL_MS = 500  # the live page asks for a new snapshot this often (the update lag stays under a second)


def plotly_js() -> str:
    try:
        from plotly.offline import get_plotlyjs
    except ImportError as e:
        raise YetoError("the dashboard draws with plotly, which is not installed: pip install 'yeto[watch]'") from e
    return get_plotlyjs()


def _script_json(value: Any) -> str:
    """JSON safe inside a <script> element (a "</script>" in a string cannot end it)."""
    return json.dumps(value, separators=(",", ":")).replace("</", "<\\/")


def live_page() -> str:
    return PAGE.replace("%PLOTLY%", '<script src="/plotly.min.js"></script>').replace(
        "%BOOT%", f"poll({POLL_MS});")


def export_page(snapshot: dict[str, Any]) -> str:
    """One self-contained file: every script and style inside, no request when it opens."""
    js = plotly_js().replace("</script", "<\\/script")
    return PAGE.replace("%PLOTLY%", f"<script>{js}</script>").replace(
        "%BOOT%", f"render({_script_json(snapshot)});")


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>yeto dashboard</title>
<style>
body { font: 14px system-ui, sans-serif; margin: 1em 2em; color: #222; }
h1 { font-size: 20px; margin: 0 0 .3em; } h2 { font-size: 16px; margin: 1.2em 0 .3em; }
table { border-collapse: collapse; } td, th { padding: 2px 10px; border-bottom: 1px solid #ddd; text-align: right; }
th { background: #f4f4f4; } td.l, th.l { text-align: left; }
.alive { color: #187a18; } .late { color: #b86e00; font-weight: bold; } .gone, .given-up { color: #b00; }
.done { color: #555; }
#summary span { margin-right: 1.5em; } .charts { display: grid; grid-template-columns: 1fr 1fr; gap: 8px; }
.chart { height: 320px; } #alerts li { color: #b00; } #events { max-height: 220px; overflow-y: auto; }
</style>
%PLOTLY%
</head><body>
<h1>yeto: <span id="name"></span></h1>
<div id="summary"><span>version <b id="version">-</b> / <span id="outer">?</span></span>
<span>rounds merged <b id="rounds">0</b></span><span>open round <b id="open">-</b></span>
<span>state <b id="state">-</b></span><span id="cost"></span><span>tape events <b id="seq">0</b></span>
<span id="updated"></span> <span id="note" class="late"></span></div>
<ul id="alerts"></ul>
<h2>Fleet</h2>
<table id="fleet"><thead><tr><th>island</th><th class="l">backend</th><th class="l">tier</th><th class="l">device</th>
<th class="l">state</th>
<th>version</th><th>merges</th><th>last delta (round)</th><th>ago (s)</th><th>lag</th><th>tokens/s</th>
<th>utilization</th></tr></thead><tbody></tbody></table>
<div class="charts">
<div id="loss-chart" class="chart"></div><div id="timeline-chart" class="chart"></div>
<div id="bytes-chart" class="chart"></div><div id="staleness-chart" class="chart"></div>
<div id="task-chart" class="chart" hidden></div>
</div>
<h2>Events (staleness, clips, what went wrong)</h2>
<table id="events"><thead><tr><th class="l">time</th><th class="l">event</th><th>round</th><th>island</th>
<th class="l">detail</th></tr></thead><tbody></tbody></table>
<script>
"use strict";
const PHASES = [["inner_steps", "#4c78a8"], ["push", "#f58518"], ["waiting", "#bab0ac"], ["merge", "#e45756"],
                ["broadcast", "#72b7b2"]];
const LAYOUT = {margin: {l: 60, r: 10, t: 30, b: 80}, legend: {orientation: "h", y: -0.3}};
const CONFIG = {displayModeBar: false, responsive: true};
const ROUND_AXIS = {title: {text: "round"}};
function cell(tr, text, cls) { const td = tr.insertCell(); td.textContent = text == null ? "-" : text;
  if (cls) td.className = cls; return td; }
function fmt(x, d) { return x == null ? "-" : Number(x).toFixed(d); }
function text(id, value) { document.getElementById(id).textContent = value; }
let drawn = null;
function c_rounds(s) { return s.curves.rounds.length ? s.curves.rounds[s.curves.rounds.length - 1] : 0; }
function render(s) {
  const r = s.run;
  text("name", (r.name || "") + (r.dir ? " (" + r.dir + ")" : ""));
  text("version", r.version); text("outer", r.outer_steps || "?"); text("rounds", r.rounds_merged);
  text("open", r.open_round == null ? "-" : r.open_round); text("seq", r.events);
  text("state", r.standalone ? "standalone run (yeto train): " + (r.finished || "training") :
    r.finished ? "finished: " + r.finished : (r.events ? "running" : "no tape yet"));
  text("cost", r.cost == null ? "" : "cost $" + fmt(r.cost, 2) + " ($" + fmt(r.cost_per_hour, 2) + "/h)");
  text("updated", "as of " + new Date(r.now * 1000).toLocaleTimeString()); text("note", r.note || "");
  if (r.stamp != null && r.stamp === drawn) return;  // nothing grew: the charts and tables stand
  drawn = r.stamp;
  const alerts = document.getElementById("alerts"); alerts.replaceChildren();
  for (const a of s.alerts || []) { const li = document.createElement("li");
    li.textContent = "island " + a.island + ": " + a.what + " (" + a.cause + ")"; alerts.appendChild(li); }
  const body = document.querySelector("#fleet tbody"); body.replaceChildren();
  for (const f of s.fleet) {
    const tr = body.insertRow(); tr.dataset.island = f.island; tr.className = "island";
    cell(tr, f.island); cell(tr, f.backend, "l"); cell(tr, f.tier, "l"); cell(tr, f.device, "l");
    cell(tr, f.state + (f.given_up_reason ? " (" + f.given_up_reason + ")" : ""), "l " + f.state.replace(" ", "-"));
    cell(tr, f.version); cell(tr, f.merges); cell(tr, f.last_delta_round); cell(tr, fmt(f.last_delta_ago, 0));
    cell(tr, f.lag); cell(tr, fmt(f.tokens_per_s, 0));
    cell(tr, f.utilization == null ? null : fmt(100 * f.utilization, 0) + "%");
  }
  ROUND_AXIS.dtick = c_rounds(s) <= 20 ? 1 : null;  // integer ticks while they fit
  const c = s.curves, loss = [];
  for (const [lid, pts] of Object.entries(c.islands)) loss.push({name: "island " + lid + " inner",
    mode: "lines+markers", x: pts.map(p => p[0]), y: pts.map(p => p[1])});
  for (const [lid, pts] of Object.entries(c.steps || {})) if (pts.length) loss.push({name: "island " + lid +
    " train", mode: "lines", x: pts.map(p => p[0]), y: pts.map(p => p[1])});
  if (!r.standalone) loss.push({name: "merged", mode: "lines+markers", line: {width: 3, color: "#222"},
    x: c.merged.map(p => p[0]), y: c.merged.map(p => p[1])});
  for (const [lid, pts] of Object.entries(c.eval)) if (pts.length) loss.push({name: "island " + lid + " eval",
    mode: "markers", marker: {symbol: "diamond", size: 9}, x: pts.map(p => p[0]), y: pts.map(p => p[1])});
  Plotly.react("loss-chart", loss, {...LAYOUT, title: {text: r.standalone ? "loss per step" : "loss per round"},
    xaxis: r.standalone ? {title: {text: "step"}} : ROUND_AXIS}, CONFIG);
  const task = Object.entries(c.task || {}), chart = document.getElementById("task-chart");
  chart.hidden = !task.length;  // a run that evaluates no task draws no task chart
  if (task.length) Plotly.react("task-chart", task.map(([lid, pts]) => ({name: "island " + lid,
    mode: "lines+markers", x: pts.map(p => p.x), y: pts.map(p => 100 * p.accuracy),
    error_y: {type: "data", symmetric: false, array: pts.map(p => 100 * ((p.high ?? p.accuracy) - p.accuracy)),
              arrayminus: pts.map(p => 100 * (p.accuracy - (p.low ?? p.accuracy)))},
    text: pts.map(p => (p.version == null ? "its own adapter" : "version " + p.version) + ", step " + p.step +
                       ", n " + p.n)})),
    {...LAYOUT, title: {text: "task accuracy, 95% interval (" + [...new Set(task.flatMap(([, pts]) =>
      pts.map(p => p.task)))].join(", ") + ")"}, yaxis: {title: {text: "accuracy (%)"}, range: [-2, 102]},
     xaxis: r.standalone ? {title: {text: "step"}} : {...ROUND_AXIS, title: {text: "rounds merged (version scored)"}}},
    CONFIG);
  const rows = s.timeline.map(t => "r" + t.round + " island " + t.island);
  Plotly.react("timeline-chart", PHASES.map(([k, color]) => ({type: "bar", orientation: "h", name: k.replace("_", " "),
    marker: {color}, y: rows, x: s.timeline.map(t => t[k])})),
    {...LAYOUT, barmode: "stack", title: {text: "where each round's time goes (s)"},
     yaxis: {autorange: "reversed", automargin: true}}, CONFIG);
  Plotly.react("bytes-chart", [{type: "bar", name: "delta bytes in", x: s.bytes.map(b => b[0]),
    y: s.bytes.map(b => b[1])}], {...LAYOUT, title: {text: "bytes per round"}, xaxis: ROUND_AXIS}, CONFIG);
  const stale = s.events.filter(e => e.event === "stale" || e.event === "clip");
  Plotly.react("staleness-chart", ["stale", "clip"].map(k => ({mode: "markers", name: k === "stale" ? "stale (lag)" :
    "clipped (factor)", x: stale.filter(e => e.event === k).map(e => e.round),
    y: stale.filter(e => e.event === k).map(e => k === "stale" ? e.lag : e.factor),
    text: stale.filter(e => e.event === k).map(e => "island " + e.island)})),
    {...LAYOUT, title: {text: "staleness and clip events"}, xaxis: ROUND_AXIS}, CONFIG);
  const ev = document.querySelector("#events tbody"); ev.replaceChildren();
  for (const e of s.events.slice().reverse()) {
    const tr = ev.insertRow(); cell(tr, new Date(e.time * 1000).toLocaleTimeString(), "l"); cell(tr, e.event, "l");
    cell(tr, e.round); cell(tr, e.island);
    const {time, event, round, island, ...rest} = e; cell(tr, JSON.stringify(rest), "l");
  }
  document.body.dataset.events = r.events;
}
function poll(ms) {
  let busy = false;
  const tick = async () => { if (busy) return; busy = true;
    try { const got = await fetch("/snapshot.json", {cache: "no-store"}); if (got.ok) render(await got.json()); }
    catch (e) { text("updated", "dashboard server unreachable"); } finally { busy = false; } };
  tick(); setInterval(tick, ms);
}
%BOOT%
</script></body></html>
"""
