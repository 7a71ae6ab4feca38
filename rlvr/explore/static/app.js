// The run explorer page: plain JS over the JSON API of rlvr/explore/server.py, charts drawn as SVG.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { overview: null, samples: { offset: 0 }, episodes: { offset: 0 }, limit: 50 };

function esc(s) {
  return String(s ?? "").replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]));
}
// control characters (a random policy writes them) as their Unicode pictures: HTML would turn \r into \n
function visible(text) {
  return String(text).replace(/[\x00-\x08\x0b-\x1f\x7f]/g, (c) => String.fromCharCode(c === "\x7f" ? 0x2421 : 0x2400 + c.charCodeAt(0)));
}
function fmt(v) {
  if (v === null || v === undefined) return "";
  if (typeof v === "number") return Number.isInteger(v) ? String(v) : v.toFixed(3);
  if (typeof v === "object") return JSON.stringify(v);
  return String(v);
}
async function api(path, method) {
  // body[data-busy] counts requests in flight (the browser tests wait for 0)
  document.body.dataset.busy = Number(document.body.dataset.busy || 0) + 1;
  try {
    const response = await fetch(path, { method: method || "GET" });
    const body = await response.json();
    if (!response.ok) throw new Error(body.error || response.statusText);
    return body;
  } finally {
    document.body.dataset.busy = Number(document.body.dataset.busy) - 1;
  }
}
function query(params) {
  return Object.entries(params).filter(([, v]) => v !== "" && v !== undefined && v !== null)
    .map(([k, v]) => `${k}=${encodeURIComponent(v)}`).join("&");
}
function table(el, headers, rows, onClick) {
  const head = "<tr>" + headers.map((h) => `<th>${esc(h)}</th>`).join("") + "</tr>";
  el.innerHTML = head + rows.map((r) => r.html).join("");
  if (onClick) {
    el.querySelectorAll("tr[data-i]").forEach((tr) => tr.addEventListener("click", () => {
      el.querySelectorAll("tr.selected").forEach((s) => s.classList.remove("selected"));
      tr.classList.add("selected");
      onClick(Number(tr.dataset.i));
    }));
  }
}
function options(select, values, withAll) {
  const keep = select.value;
  select.innerHTML = (withAll ? '<option value="">all</option>' : "") +
    values.map((v) => (Array.isArray(v) ? v : [v, v])).map(([value, label]) => `<option value="${esc(value)}">${esc(label)}</option>`).join("");
  if ([...select.options].some((o) => o.value === keep)) select.value = keep;
}
function showError(el, error) { el.innerHTML = `<div class="error">${esc(error.message || error)}</div>`; }

// ---- overview ----------------------------------------------------------------------------------
const CURVE_ORDER = ["reward", "heldout", "correct", "kl", "entropy", "stale", "util", "loss", "clip", "tokens"];

function chart(metric, series, names) {
  const w = 300, h = 150, pad = 30, colours = ["#00897b", "#e64a19", "#3949ab", "#8e24aa", "#f9a825"];
  const points = series.flatMap((s) => s || []);
  if (!points.length) return "";
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  const X = (x) => pad + (x - x0) / (x1 - x0) * (w - pad - 8), Y = (y) => h - 18 - (y - y0) / (y1 - y0) * (h - 42);
  const lines = series.map((s, k) => (s && s.length) ? `<polyline fill="none" stroke="${colours[k % 5]}" stroke-width="1.5"
      points="${s.map((p) => `${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join(" ")}"/>` +
      s.map((p) => `<circle cx="${X(p[0]).toFixed(1)}" cy="${Y(p[1]).toFixed(1)}" r="2" fill="${colours[k % 5]}">
      <title>${esc(names[k])} step ${p[0]}: ${fmt(p[1])}</title></circle>`).join("") : "").join("");
  return `<svg class="chart" data-metric="${esc(metric)}" width="${w}" height="${h}">
    <text x="4" y="11">${esc(metric)}</text>
    <text x="2" y="${Y(y1) + 4}">${fmt(y1)}</text><text x="2" y="${Y(y0)}">${fmt(y0)}</text>
    <text x="${pad}" y="${h - 4}">${x0}</text><text x="${w - 30}" y="${h - 4}">${x1}</text>
    <line x1="${pad}" x2="${pad}" y1="20" y2="${h - 18}" stroke="#bbb"/>
    <line x1="${pad}" x2="${w - 8}" y1="${h - 18}" y2="${h - 18}" stroke="#bbb"/>${lines}</svg>`;
}

function rank(name) {
  const i = CURVE_ORDER.findIndex((p) => name.includes(p));
  return i < 0 ? CURVE_ORDER.length : i;
}

function drawCurves() {
  const o = state.overview, filter = $("curve-filter").value.trim();
  const names = o.runs.map((r) => r.name);
  const metrics = [...new Set(o.curves.flatMap((c) => Object.keys(c)))]
    .filter((m) => !filter || filter.split(/[ ,]+/).some((f) => m.includes(f)))
    .sort((a, b) => rank(a) - rank(b) || a.localeCompare(b));
  const legend = names.map((n, k) => `<span style="color:${["#00897b", "#e64a19", "#3949ab", "#8e24aa", "#f9a825"][k % 5]}">■ ${esc(n)}</span>`).join(" ");
  $("curves").innerHTML = (metrics.length ? `<div class="legend">${legend}</div>` : '<p class="muted">no metrics.jsonl</p>') +
    metrics.map((m) => chart(m, o.curves.map((c) => c[m]), names)).join("");
}

async function loadOverview() {
  const o = state.overview = await api("/api/overview");
  $("runs-line").textContent = o.runs.map((r, k) => `${k}: ${r.name} (${r.job || "?"})`).join("  ·  ");
  const names = o.runs.map((r) => r.name);
  table($("config-diff-table") || $("config-diff").appendChild(Object.assign(document.createElement("table"), { id: "config-diff-table" })),
    ["key", ...names], o.config_diff.map((row) => ({
      html: `<tr data-key="${esc(row.key)}"><td>${esc(row.key)}</td>${row.values.map((v) => `<td>${esc(fmt(v))}</td>`).join("")}</tr>`,
    })));
  drawCurves();
  $("capability").innerHTML = o.capability.map((cap, k) => {
    if (!cap.rows.length) return `<h3>${esc(names[k])}</h3><p class="muted">no summary.json or eval.json</p>`;
    const rows = cap.rows.map((r) => `<tr data-key="${esc(r.key)}" class="${r.crowded_out ? "bad" : ""}"><td>${esc(r.key)}</td>
      <td>${fmt(r.tasks)}</td><td>${fmt(r.first)}</td><td>${fmt(r.last)}</td>
      <td>${r.first === null || r.first === undefined ? "" : fmt(r.last - r.first)}</td><td>${r.crowded_out ? "crowded out" : ""}</td></tr>`).join("");
    const head = `<h3>${esc(names[k])}: by ${esc(cap.by)}${cap.before !== undefined ? `, overall ${fmt(cap.before)} → ${fmt(cap.after)}` : ""}</h3>`;
    const curriculum = cap.curriculum ? `<details><summary>curriculum</summary><pre>${esc(JSON.stringify(cap.curriculum, null, 1))}</pre></details>` : "";
    return `${head}<table class="capability-table" data-run="${k}"><tr><th>${esc(cap.by)}</th><th>tasks</th><th>first</th><th>last</th><th>change</th><th></th></tr>${rows}</table>${curriculum}`;
  }).join("");
  document.querySelectorAll(".run-select").forEach((s) => options(s, o.runs.map((r, k) => [k, `${k}: ${r.name}`])));
  const withEpisodes = o.runs.findIndex((r) => r.episodes > 0);  // the episode views open on a run that has some
  if (withEpisodes > 0 && !state.started) { $("e-run").value = withEpisodes; $("f-run").value = withEpisodes; }
}

// ---- samples -----------------------------------------------------------------------------------
const COLOURINGS = {
  logprob: { label: "sampling probability exp(log-prob): white = certain, red = unlikely", colour: (t) => t.logprob === undefined ? "" : `rgba(229,57,53,${(1 - Math.exp(t.logprob)).toFixed(2)})` },
  advantage: { label: "advantage (green +, red -), sampled tokens; not recorded with GAE (per token, in the trainer)",
    colour: (t) => !t.mask || t.advantage === undefined ? "#e0e0e0" : t.advantage >= 0 ? `rgba(67,160,71,${Math.min(1, t.advantage / 2).toFixed(2)})` : `rgba(229,57,53,${Math.min(1, -t.advantage / 2).toFixed(2)})` },
  loss_mask: { label: "loss mask (grey = observation, not trained on)", colour: (t) => t.mask ? "rgba(0,137,123,0.25)" : "#bdbdbd" },
  staleness: { label: "staleness = step's version − token's weight version (blue = staler)", colour: (t) => t.staleness === undefined ? "" : `rgba(57,73,171,${Math.min(1, t.staleness / 3).toFixed(2)})` },
};

function tokens(record) {
  if (!record.tokens) return null;
  const trainedAt = record.step - 1;  // a train record's step counts steps done; its batch trained at version step-1
  return record.tokens.map((text, k) => ({
    text, logprob: record.logprobs?.[k], version: record.versions?.[k],
    staleness: record.versions ? trainedAt - record.versions[k] : undefined,
    mask: record.loss_mask ? record.loss_mask[k] : 1, advantage: record.advantage,
  }));
}

function renderTokens(record) {
  const toks = tokens(record), by = $("colour-by")?.value || "logprob";
  if (!toks) return `<div class="text" id="sample-completion">${esc(record.completion)}</div>
    <p class="muted">no per-token record (evaluation samples keep the text and rewards only)</p>`;
  const spans = toks.map((t, k) => `<span class="tok" data-k="${k}" data-logprob="${t.logprob ?? ""}" data-mask="${t.mask}"
    style="background:${COLOURINGS[by].colour(t)}" title="#${k} log-prob ${fmt(t.logprob)} version ${fmt(t.version)} staleness ${fmt(t.staleness)} mask ${t.mask}">${esc(visible(t.text))}</span>`).join("");
  return `<div class="text" id="sample-completion">${spans}</div><div class="legend">${esc(COLOURINGS[by].label)};
    advantage ${fmt(record.advantage)}; the trainer-vs-sampler log-prob mismatch is not recorded per token (see the logprob_mismatch and approx_kl curves)</div>`;
}

function renderSample(record, i) {
  const choice = Object.entries(COLOURINGS).map(([k, c]) => `<option value="${k}">${esc(k)}</option>`).join("");
  $("sample-detail").innerHTML = `<h2>sample ${i}: ${esc(record.tag)} step ${record.step}, ${esc(record.family)} level ${record.level} #${record.task_index}</h2>
    <table id="sample-rewards">${Object.entries(record.rewards).map(([k, v]) => `<tr data-key="${esc(k)}"><td>${esc(k)}</td><td>${fmt(v)}</td></tr>`).join("")}</table>
    <h2>prompt</h2><div class="text" id="sample-prompt">${esc(record.prompt)}</div>
    <h2>completion (${record.response_tokens} tokens${record.truncated ? ", truncated" : ""})
      ${record.tokens ? `colour by <select id="colour-by">${choice}</select>` : ""}</h2><div id="sample-tokens"></div>`;
  const draw = () => { $("sample-tokens").innerHTML = renderTokens(record); };
  draw();
  if ($("colour-by")) $("colour-by").addEventListener("change", draw);
}

function filterValues(prefix, keys) {
  const out = {};
  for (const [key, id] of keys) {
    const el = $(`${prefix}-${id}`);
    if (!el) continue;
    out[key] = el.type === "checkbox" ? (el.checked ? "1" : "") : el.value.trim();
  }
  return out;
}

const SAMPLE_FILTERS = [["tag", "tag"], ["family", "family"], ["level", "level"], ["step_min", "step-min"], ["step_max", "step-max"],
  ["reward_min", "reward-min"], ["reward_max", "reward-max"], ["task_index", "task-index"]];
const EPISODE_FILTERS = [["family", "family"], ["level", "level"], ["reward_min", "reward-min"], ["reward_max", "reward-max"], ["failed", "failed"]];

async function loadFacets(kind, prefix) {
  const run = $(`${prefix}-run`).value;
  const f = await api(`/api/facets?${query({ run, kind })}`);
  if ($(`${prefix}-tag`)) options($(`${prefix}-tag`), f.tags, true);
  options($(`${prefix}-family`), f.families, true);
  options($(`${prefix}-level`), f.levels, true);
}

async function loadSamples() {
  const s = state.samples, run = $("s-run").value;
  try {
    const page = await api(`/api/samples?${query({ run, offset: s.offset, limit: state.limit, ...filterValues("s", SAMPLE_FILTERS) })}`);
    $("s-total").textContent = `${page.total} samples, showing ${page.total ? page.offset + 1 : 0}–${page.offset + page.rows.length}`;
    s.total = page.total;
    table($("samples-table"), ["#", "tag", "step", "family", "level", "task", "reward", "correct", "tokens"], page.rows.map((r) => ({
      html: `<tr class="clickable" data-i="${r.i}"><td>${r.i}</td><td>${esc(r.tag)}</td><td>${r.step}</td><td>${esc(r.family)}</td>
        <td>${r.level}</td><td>${r.task_index}</td><td class="reward">${fmt(r.reward)}</td><td>${fmt(r.correct)}</td><td>${fmt(r.response_tokens)}</td></tr>`,
    })), async (i) => renderSample(await api(`/api/sample?${query({ run, i })}`), i));
  } catch (e) { showError($("sample-detail"), e); }
}

// ---- episodes ----------------------------------------------------------------------------------
function renderSandboxRun(run, k) {
  return `<div class="sandbox-run" data-k="${k}"><b>sandbox #${k}</b> ${esc(run.what)} (${esc(run.backend)}): ${run.exit_code !== null && run.exit_code !== undefined ? `exit ${run.exit_code}` : ""}
    ${run.signal ? `signal ${esc(run.signal)}` : ""} ${run.limit_hit ? `<span class="bad">limit hit: ${esc(run.limit_hit)}</span>` : ""}
    ${run.code ? `<pre class="code">${esc(run.code)}</pre>` : ""}
    <div>stdout</div><pre class="stdout">${esc(run.stdout)}</pre><div>stderr</div><pre class="stderr">${esc(run.stderr)}</pre></div>`;
}

function renderEpisode(record, i, run) {
  const trace = record.trace || {}, env = trace.env || {}, sandbox = env.sandbox || [];
  const envTurns = env.turns || [];
  const opening = (trace.messages || []).map((m) => `<div class="text"><b>${esc(m.role)}</b>: ${esc(m.content)}</div>`).join("");
  const turns = (trace.turns || []).map((t, k) => {
    const calls = (t.info?.calls || envTurns[k]?.calls || []).map((c) => `<div class="call"><b>${esc(c.name)}</b>
      <code>${esc(JSON.stringify(c.arguments ?? c.args ?? {}))}</code> → <span class="${c.status === "ok" ? "good" : "bad"}">${esc(c.status)}</span>
      <pre>${esc(c.output)}</pre>${(c.sandbox || []).map((j) => sandbox[j] ? renderSandboxRun(sandbox[j], j) : "").join("")}</div>`).join("");
    const observation = (t.observation || []).map((m) => `<div class="text"><b>${esc(m.role)}${m.name ? ` (${esc(m.name)})` : ""}</b>: ${esc(m.content)}</div>`).join("");
    return `<div class="turn" data-turn="${k}"><b>turn ${t.turn}</b> <span class="muted">${[t.tokens !== undefined ? `${t.tokens} tokens` : "", t.finish?.type || "",
      t.generate_s !== undefined ? `${fmt(t.generate_s)} s` : ""].filter(Boolean).join(", ")}</span>
      <div class="text assistant">${esc(t.text)}</div>${calls}${observation}
      ${t.rewards && Object.keys(t.rewards).length ? `<div class="muted">step rewards ${esc(JSON.stringify(t.rewards))}</div>` : ""}</div>`;
  }).join("");
  const unlinked = sandbox.map((s, j) => [s, j]).filter(([, j]) => !(trace.turns || []).some((t, k) =>
    (t.info?.calls || envTurns[k]?.calls || []).some((c) => (c.sandbox || []).includes(j))));
  $("episode-detail").innerHTML = `<h2>episode ${i}: ${esc(record.task?.family)} level ${record.task?.level} #${record.task?.index}, step ${record.step}
    ${trace.error ? `<span class="bad">error: ${esc(trace.error)}</span>` : ""}</h2>
    <button id="replay">Replay (check the stored episode reproduces)</button> <span id="replay-result"></span>
    <h2>rewards</h2><table id="episode-rewards">${Object.entries(record.rewards || {}).map(([k, v]) =>
      `<tr data-key="${esc(k)}"><td>${esc(k)}</td><td>${fmt(v)}</td></tr>`).join("")}</table>
    ${env.judge ? `<div class="muted">judge ${esc(JSON.stringify(env.judge))}</div>` : ""}
    <h2>opening</h2>${opening}<h2>turns (stop: ${esc(trace.stop)})</h2>${turns}
    ${unlinked.length ? `<h2>other sandbox runs (judge, setup)</h2>${unlinked.map(([s, j]) => renderSandboxRun(s, j)).join("")}` : ""}`;
  $("replay").addEventListener("click", async () => {
    $("replay-result").textContent = "replaying…";
    try {
      const r = await api(`/api/replay?${query({ run, i })}`, "POST");
      $("replay-result").innerHTML = r.error ? `<span class="bad">${esc(r.error)}</span>` : r.identical
        ? `<span class="good" data-identical="true">identical over ${r.turns} turns</span>`
        : `<span class="bad" data-identical="false">differs: ${esc(JSON.stringify(r.differences))}</span>`;
    } catch (e) { $("replay-result").innerHTML = `<span class="bad">${esc(e.message)}</span>`; }
  });
}

async function loadEpisodes() {
  const s = state.episodes, run = $("e-run").value;
  try {
    const page = await api(`/api/episodes?${query({ run, offset: s.offset, limit: state.limit, ...filterValues("e", EPISODE_FILTERS) })}`);
    $("e-total").textContent = `${page.total} episodes, showing ${page.total ? page.offset + 1 : 0}–${page.offset + page.rows.length}`;
    s.total = page.total;
    table($("episodes-table"), ["#", "step", "family", "level", "task", "turns", "calls", "reward", "correct", "stop", "problem"], page.rows.map((r) => ({
      html: `<tr class="clickable" data-i="${r.i}"><td>${r.i}</td><td>${fmt(r.step)}</td><td>${esc(r.family)}</td><td>${fmt(r.level)}</td>
        <td>${fmt(r.task_index)}</td><td>${fmt(r.turns)}</td><td>${fmt(r.tool_calls)}</td><td class="reward">${fmt(r.reward)}</td><td>${fmt(r.correct)}</td>
        <td>${esc(r.stop)}</td><td class="bad">${esc(r.error || (r.limit_hits.length ? "limit: " + r.limit_hits.map((h) => h.limit_hit).join(",") : ""))}</td></tr>`,
    })), async (i) => renderEpisode(await api(`/api/episode?${query({ run, i })}`), i, run));
  } catch (e) { showError($("episode-detail"), e); }
}

// ---- compare -----------------------------------------------------------------------------------
async function loadCompareChoices() {
  const choices = [];
  for (const [k, r] of state.overview.runs.entries()) {
    const f = await api(`/api/facets?${query({ run: k, kind: "samples" })}`);
    f.tags.filter((t) => t.startsWith("eval")).forEach((t) => choices.push([`${k}:${t}`, `${r.name}: ${t}`]));
  }
  options($("cmp-a"), choices);
  options($("cmp-b"), choices);
  if (choices.length > 1 && $("cmp-a").value === $("cmp-b").value) $("cmp-b").value = choices[choices.length - 1][0];
}

async function loadCompare() {
  try {
    const c = await api(`/api/compare?${query({ a: $("cmp-a").value, b: $("cmp-b").value })}`);
    const rows = $("cmp-changed").checked ? c.rows.filter((r) => r.diff !== 0) : c.rows;
    $("cmp-summary").innerHTML = `<span id="cmp-count">${c.rows.length}</span> shared prompts; mean reward A ${fmt(c.mean_a)}, B ${fmt(c.mean_b)};
      changed ${c.rows.filter((r) => r.diff !== 0).length}; only in A ${c.only_a}, only in B ${c.only_b}`;
    const side = (s) => `<td class="side">reward ${fmt(s.reward)} · pass ${fmt(s.correct)} (n=${s.n})<div class="text">${esc(s.completions[0])}</div></td>`;
    table($("compare-table"), ["family", "level", "task", "prompt", "A", "B", "B − A"], rows.map((r) => ({
      html: `<tr data-key="${esc(r.family)}/${r.level}/${r.task_index}" class="${r.diff > 0 ? "diff-pos" : r.diff < 0 ? "diff-neg" : ""}">
        <td>${esc(r.family)}</td><td>${r.level}</td><td>${r.task_index}</td><td><div class="text">${esc(r.prompt)}</div></td>
        ${side(r.a)}${side(r.b)}<td class="diff">${fmt(r.diff)}</td></tr>`,
    })));
  } catch (e) { showError($("cmp-summary"), e); }
}

// ---- failures ----------------------------------------------------------------------------------
async function loadFailures() {
  const run = $("f-run").value;
  const f = await api(`/api/failures?${query({ run })}`);
  table($("failures-table"), ["#", "kind", "step", "family", "task", "error", "look at"], f.recorded.map((r) => ({
    html: `<tr data-i="${r.i}"><td>${r.i}</td><td>${esc(r.kind)}</td><td>${fmt(r.step)}</td><td>${esc(r.family)}</td><td>${fmt(r.task_index)}</td>
      <td class="bad">${esc(r.error)}</td><td>${r.episode !== null ? `<a href="#episodes" data-episode="${r.episode}">episode ${r.episode}</a>`
      : `<a href="#samples" data-family="${esc(r.family)}" data-task="${r.task_index}">samples of task ${r.task_index}</a>`}</td></tr>`,
  })));
  table($("failed-episodes-table"), ["#", "step", "family", "task", "error", "limit hits", ""], f.episodes.map((r) => ({
    html: `<tr data-i="${r.i}"><td>${r.i}</td><td>${fmt(r.step)}</td><td>${esc(r.family)}</td><td>${fmt(r.task_index)}</td><td class="bad">${esc(r.error)}</td>
      <td>${esc(r.limit_hits.map((h) => `${h.what}: ${h.limit_hit}`).join(", "))}</td><td><a href="#episodes" data-episode="${r.i}">open</a></td></tr>`,
  })));
  document.querySelectorAll("#view-failures a[data-episode]").forEach((a) => a.addEventListener("click", async () => {
    $("e-run").value = run;
    show("episodes");
    renderEpisode(await api(`/api/episode?${query({ run, i: a.dataset.episode })}`), Number(a.dataset.episode), run);
  }));
  document.querySelectorAll("#view-failures a[data-task]").forEach((a) => a.addEventListener("click", async () => {
    $("s-run").value = run;
    await loadFacets("samples", "s");
    $("s-family").value = a.dataset.family;
    $("s-task-index").value = a.dataset.task;
    state.samples.offset = 0;
    show("samples");
  }));
}

// ---- navigation --------------------------------------------------------------------------------
const LOADERS = {
  overview: async () => { if (state.started) await loadOverview(); },  // again: a live run has grown
  samples: loadSamples,
  episodes: loadEpisodes,
  compare: async () => { await loadCompareChoices(); if ($("cmp-a").value) await loadCompare(); },
  failures: loadFailures,
};

async function show(view) {
  document.querySelectorAll(".view").forEach((v) => v.classList.toggle("active", v.id === `view-${view}`));
  document.querySelectorAll("nav a").forEach((a) => a.classList.toggle("active", a.dataset.view === view));
  if (location.hash !== `#${view}`) history.replaceState(null, "", `#${view}`);
  document.body.dataset.loading = "1";
  try { await LOADERS[view](); } finally { document.body.dataset.loading = ""; document.body.dataset.view = view; }
}

function pager(prefix, kind, load) {
  $(`${prefix}-apply`).addEventListener("click", () => { state[kind].offset = 0; load(); });
  $(`${prefix}-prev`).addEventListener("click", () => { state[kind].offset = Math.max(0, state[kind].offset - state.limit); load(); });
  $(`${prefix}-next`).addEventListener("click", () => {
    if (state[kind].offset + state.limit < (state[kind].total || 0)) { state[kind].offset += state.limit; load(); }
  });
  $(`${prefix}-run`).addEventListener("change", async () => { state[kind].offset = 0; await loadFacets(kind, prefix); load(); });
}

async function start() {
  await loadOverview();
  // the filters' choices parse each file once (seconds for 100k episodes): not awaited, the page is usable meanwhile
  Promise.all([loadFacets("samples", "s"), loadFacets("episodes", "e")]).catch((e) => showError($("sample-detail"), e));
  pager("s", "samples", loadSamples);
  pager("e", "episodes", loadEpisodes);
  $("cmp-go").addEventListener("click", loadCompare);
  $("f-run").addEventListener("change", loadFailures);
  $("curve-filter").addEventListener("input", drawCurves);
  document.querySelectorAll("nav a").forEach((a) => a.addEventListener("click", (e) => { e.preventDefault(); show(a.dataset.view); }));
  await show((location.hash || "#overview").slice(1).split("?")[0] in LOADERS ? (location.hash || "#overview").slice(1) : "overview");
  state.started = true;
  document.body.dataset.ready = "1";
}

start().catch((e) => { document.body.dataset.ready = "error"; document.querySelector("main").insertAdjacentHTML("afterbegin", `<div class="error">${esc(e.message)}</div>`); });
