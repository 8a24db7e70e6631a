// The rollout viewer page: lists stored trajectories, filters them, and shows one as tokens.
// All text from the run goes through textContent (never innerHTML), so a reply cannot inject markup.
"use strict";

const FLAGS = ["truncated", "terminated_early", "replayed", "guided", "hinted"];
const MAX_ROWS = 2000; // rows drawn at once; the filters narrow the rest
const LOGPROB_FLOOR = -6; // log-probs at or below this get the strongest shading

let ROWS = [];
let SELECTED = null;

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
}

function fmt(x, digits = 3) {
  if (x === null || x === undefined) return "–";
  if (typeof x === "number") return Number.isInteger(x) ? String(x) : x.toFixed(digits);
  return String(x);
}

async function getJSON(url) {
  const res = await fetch(url);
  const data = await res.json();
  if (!res.ok) throw new Error(data.error || res.statusText);
  return data;
}

// ------------------------------------------------------------------------------------------ listing

function currentFilters() {
  const num = (id) => {
    const v = document.getElementById(id).value;
    return v === "" ? null : Number(v);
  };
  const flags = {};
  for (const f of FLAGS) flags[f] = document.getElementById("f-" + f).value;
  return {
    task: document.getElementById("f-task").value,
    stepMin: num("f-step-min"), stepMax: num("f-step-max"),
    rMin: num("f-rmin"), rMax: num("f-rmax"),
    text: document.getElementById("f-text").value.toLowerCase(),
    monitor: document.getElementById("f-monitor").value,
    flags,
  };
}

function matches(row, f) {
  if (f.task && row.task !== f.task) return false;
  if (f.stepMin !== null && row.step < f.stepMin) return false;
  if (f.stepMax !== null && row.step > f.stepMax) return false;
  if (f.rMin !== null && !(row.reward >= f.rMin)) return false;
  if (f.rMax !== null && !(row.reward <= f.rMax)) return false;
  for (const flag of FLAGS) {
    if (f.flags[flag] === "yes" && !row[flag]) return false;
    if (f.flags[flag] === "no" && row[flag]) return false;
  }
  if (f.text && !row.preview.toLowerCase().includes(f.text)) return false;
  // reward-hacking monitors: "flagged" (any flag), "clean" (none), or one flag by name
  const monitor = row.monitor_flags || [];
  if (f.monitor === "flagged" && monitor.length === 0) return false;
  if (f.monitor === "clean" && monitor.length > 0) return false;
  if (f.monitor && f.monitor !== "flagged" && f.monitor !== "clean" && !monitor.includes(f.monitor)) return false;
  return true;
}

function flagBadges(row) {
  const span = el("span");
  for (const f of FLAGS) if (row[f]) span.append(el("span", { class: "flag " + f, text: f.replace("_", " ") }));
  for (const m of row.monitor_flags || []) span.append(el("span", { class: "flag monitor", text: m.replace("_", " ") }));
  return span;
}

function renderTable() {
  const f = currentFilters();
  const shown = ROWS.filter((r) => matches(r, f));
  const body = document.querySelector("#traj-table tbody");
  body.replaceChildren();
  for (const row of shown.slice(0, MAX_ROWS)) {
    const tr = el("tr", { "data-i": row.i, onclick: () => { location.hash = "t=" + row.i; } },
      el("td", { class: "num", text: fmt(row.step) }),
      el("td", { text: row.task }),
      el("td", { class: "num", text: fmt(row.item_id) }),
      el("td", { class: "num", text: fmt(row.group_id) }),
      el("td", { class: "num reward", text: fmt(row.reward) }),
      el("td", { class: "num", text: fmt(row.advantage) }),
      el("td", {}, flagBadges(row)),
      el("td", { class: "preview", text: row.preview }));
    if (row.i === SELECTED) tr.classList.add("selected");
    body.append(tr);
  }
  const more = shown.length > MAX_ROWS ? ` (first ${MAX_ROWS} shown)` : "";
  document.getElementById("count").textContent =
    ROWS.length === 0 ? "no trajectories stored yet (trajectories.jsonl is empty or missing)"
      : shown.length === 0 ? `no trajectories match (of ${ROWS.length})`
        : `${shown.length} of ${ROWS.length} trajectories${more}`;
}

async function loadRows() {
  ROWS = (await getJSON("/api/trajectories")).rows;
  const select = document.getElementById("f-task");
  const keep = select.value;
  select.replaceChildren(el("option", { value: "", text: "all" }));
  for (const t of [...new Set(ROWS.map((r) => r.task))].sort()) select.append(el("option", { value: t, text: t }));
  select.value = keep;
  renderTable();
}

async function loadRun() {
  const run = await getJSON("/api/run");
  document.getElementById("run-name").textContent = run.name;
  document.title = "polyrl rollouts: " + run.name;
  const s = run.summary || {};
  const parts = [run.model ? "model " + run.model : null, s.steps !== undefined ? s.steps + " steps" : null];
  for (const [task, acc] of Object.entries(s.eval_after || {})) {
    const before = (s.eval_before || {})[task];
    parts.push(`${task}: ${before !== undefined ? fmt(before * 100, 1) + "% → " : ""}${fmt(acc * 100, 1)}%`);
  }
  document.getElementById("run-meta").textContent = parts.filter(Boolean).join(" · ");
}

// ------------------------------------------------------------------------------------------- detail

function shade(logprob) {
  // Green for likely tokens through yellow to red for surprising ones, on a log-prob scale.
  const t = logprob === null ? 0 : Math.min(1, Math.max(0, logprob / LOGPROB_FLOOR));
  return `hsl(${Math.round(120 * (1 - t))}, 70%, 84%)`;
}

function tokenView(tr) {
  const box = el("div", { id: "tokens" });
  const ids = tr.input_ids, mask = tr.loss_mask || [], lps = tr.logprobs || [], vers = tr.versions || [];
  const texts = tr.token_text;
  const turnStart = new Map((tr.turn_spans || []).map((s, k) => [s[0], k + 1]));
  for (let j = 0; j < ids.length; j++) {
    if (turnStart.has(j) && (tr.turn_spans || []).length > 0) {
      box.append(el("span", { class: "turn-mark", text: "turn " + turnStart.get(j) }));
    }
    if (tr.branch_at !== undefined && j === tr.branch_at) {
      const from = tr.parent_id !== undefined ? " from " + tr.parent_id : "";
      box.append(el("span", { class: "branch-mark", text: "branched here" + from }));
    }
    const inLoss = mask[j] === 1;
    const kind = inLoss ? "model" : (j < tr.prompt_len ? "prompt" : "env");
    const text = texts ? texts[j] : `[${ids[j]}]`;
    const span = el("span", { class: "tok " + kind, text });
    if (tr.special[j]) span.classList.add("special");
    if (inLoss) {
      span.style.background = shade(lps[j]);
      if (tr.branch_at !== undefined && j < tr.branch_at) span.classList.add("shared");
    }
    const lp = lps[j];
    span.title = `#${j} id ${ids[j]} · ${kind}${inLoss ? " (in loss)" : " (not in loss)"}` +
      (inLoss && lp !== null ? ` · log-prob ${lp.toFixed(3)} (p=${Math.exp(lp).toFixed(3)})` : "") +
      (vers[j] !== undefined && vers[j] >= 0 ? ` · policy version ${vers[j]}` : "");
    box.append(span);
  }
  return box;
}

function legend() {
  return el("div", { class: "legend" },
    el("span", {}, el("span", { class: "swatch tok prompt", text: "prompt" }), " not in loss"),
    el("span", {}, el("span", { class: "swatch tok env", text: "env / tool" }), " not in loss"),
    el("span", {}, el("span", { class: "swatch tok model", text: "model" }), " in loss mask (underlined)"),
    el("span", {}, "log-prob 0 ", el("span", { class: "gradient" }), ` ≤ ${LOGPROB_FLOOR}`),
    el("label", {}, el("input", { type: "checkbox", id: "show-mask", checked: "checked",
      onchange: (e) => document.getElementById("tokens").classList.toggle("hide-mask", !e.target.checked) }),
    " show loss mask"));
}

function groupTable(tr) {
  const table = el("table", { id: "group-table" },
    el("thead", {}, el("tr", {}, ...["#", "reward", "advantage", "flags", "reply"].map((h) => el("th", { text: h })))));
  const body = el("tbody");
  for (const g of tr.group) {
    const row = el("tr", { onclick: () => { location.hash = "t=" + g.i; } },
      el("td", { class: "num", text: g.i }),
      el("td", { class: "num", text: fmt(g.reward) }),
      el("td", { class: "num " + (g.advantage > 0 ? "pos" : g.advantage < 0 ? "neg" : ""), text: fmt(g.advantage) }),
      el("td", {}, flagBadges(g)),
      el("td", { class: "preview", text: g.preview }));
    if (g.i === tr.i) row.classList.add("current");
    body.append(row);
  }
  table.append(body);
  return table;
}

function branchTree(tr) {
  // Leaves of one ARPO tree: nodes by branch_id, children by parent_id; roots have no (known) parent.
  const nodes = tr.group.filter((g) => g.branch_id !== undefined);
  if (nodes.length === 0) return null;
  const known = new Set(nodes.map((n) => String(n.branch_id)));
  const children = new Map();
  for (const n of nodes) {
    const parent = n.parent_id !== undefined && known.has(String(n.parent_id)) ? String(n.parent_id) : "";
    if (!children.has(parent)) children.set(parent, []);
    children.get(parent).push(n);
  }
  const build = (parent) => {
    const ul = el("ul", { class: parent === "" ? "branch-tree" : "" });
    for (const n of children.get(parent) || []) {
      const label = `${n.branch_id}` + (n.branch_at !== undefined ? ` @${n.branch_at}` : "") +
        ` · reward ${fmt(n.reward)} · adv ${fmt(n.advantage)}`;
      const li = el("li", { class: n.i === tr.i ? "current" : "" },
        el("a", { onclick: () => { location.hash = "t=" + n.i; }, text: label }));
      if (children.has(String(n.branch_id))) li.append(build(String(n.branch_id)));
      ul.append(li);
    }
    return ul;
  };
  return build("");
}

function renderDetail(tr) {
  const d = document.getElementById("detail");
  d.replaceChildren();
  d.append(el("h2", { id: "detail-title", text: `#${tr.i} · step ${tr.step} · ${tr.task} · item ${tr.item_id} · group ${tr.group_id}` }));
  const facts = el("div", { class: "facts" });
  const fact = (k, v, cls = "") => facts.append(el("span", { class: "fact " + cls }, el("b", { text: k + " " }), String(v)));
  fact("reward", fmt(tr.reward));
  fact("advantage", fmt(tr.advantage), tr.advantage > 0 ? "pos" : tr.advantage < 0 ? "neg" : "");
  for (const [k, v] of Object.entries(tr.rewards || {})) fact("reward/" + k, fmt(v));
  fact("tokens", `${tr.input_ids.length} (${tr.loss_mask.filter((m) => m === 1).length} model)`);
  for (const f of FLAGS) if (tr[f]) fact(f.replace("_", " "), "yes", "flagged");
  for (const [k, v] of Object.entries(tr.info || {})) fact(k, typeof v === "object" ? JSON.stringify(v) : fmt(v));
  d.append(facts);
  const stepMetrics = Object.entries(tr.step_metrics || {});
  if (stepMetrics.length) {  // the step's engine/learner mismatch: how off-policy this sample's update was
    const line = stepMetrics.map(([k, v]) => `${k} ${fmt(v)}`).join(" · ");
    d.append(el("p", { class: "legend", id: "step-metrics", text: `step ${tr.step}: ${line}` }));
  }

  if ((tr.turn_spans || []).length > 1 || tr.branch_at !== undefined) {
    const spans = (tr.turn_spans || []).map((s, k) => `turn ${k + 1}: tokens ${s[0]}–${s[1] - 1}`).join(" · ");
    d.append(el("p", { class: "legend", id: "turns", text: spans }));
  }
  d.append(el("h3", { text: "Conversation" }));
  if (tr.token_error) d.append(el("p", { class: "notice", text: tr.token_error + " — showing token ids and the stored reply text." }));
  d.append(legend(), tokenView(tr));
  d.append(el("h3", { text: "Reply text (as scored)" }), el("div", { id: "plain-text", text: tr.text || "" }));

  d.append(el("h3", { text: `Group ${tr.group_id} at step ${tr.step}: ${tr.group.length} stored sample(s)` }));
  const tree = branchTree(tr);
  if (tree) d.append(tree);
  d.append(groupTable(tr));
  if (tr.group.length === 1) {
    d.append(el("p", { class: "empty", text: "Only one sample of this group is stored; set logging.trajectories_per_group to keep more." }));
  }
}

async function showFromHash() {
  const m = /t=(\d+)/.exec(location.hash);
  if (!m) return;
  SELECTED = Number(m[1]);
  for (const tr of document.querySelectorAll("#traj-table tbody tr")) {
    tr.classList.toggle("selected", Number(tr.dataset.i) === SELECTED);
  }
  try {
    renderDetail(await getJSON("/api/trajectory/" + SELECTED));
  } catch (err) {
    document.getElementById("detail").replaceChildren(el("p", { class: "notice", text: String(err.message || err) }));
  }
}

function init() {
  for (const node of document.querySelectorAll("#filters input, #filters select")) {
    node.addEventListener("input", renderTable);
  }
  document.getElementById("f-reset").addEventListener("click", () => {
    document.getElementById("filters").reset();
    renderTable();
  });
  document.getElementById("reload").addEventListener("click", loadRows);
  window.addEventListener("hashchange", showFromHash);
  Promise.all([loadRun(), loadRows()]).then(showFromHash).catch((err) => {
    document.getElementById("count").textContent = "error: " + (err.message || err);
  });
}

init();
