// The afe web UI: login, board, new ticket, ticket page. Plain ES modules,
// no build step, no third-party code.

import { Rpc, RpcError } from "./rpc.js";
import { h, clear, when } from "./dom.js";
import { drawGraph, elapsed } from "./graph.js";
import { eventLine, usd } from "./events.js";
import { Keyed, showApprovalPanel, decodeRecords, recordsView } from "./review.js";
import { STATES, TERMINAL, WAITING_APPROVAL, RETRYABLE } from "/states.js";   // served from services/common/states.py
const DEMO = { workspace: "demo", workflow: "demo-fix", title: "Fix add() in the demo calculator",
               body: "The test for add() fails: add(2, 3) returns -1. Make the tests pass." };

const app = document.getElementById("app");
const nav = document.getElementById("nav");
const conn = document.getElementById("conn");
const banner = document.getElementById("conn-banner");
let wasConnected = false, bannerTimer = null;
// A clear banner when the live connection drops, and when it comes back.
function connStatus(s) {
  conn.textContent = s; conn.dataset.state = s;
  if (!banner) return;
  clearTimeout(bannerTimer);
  if (s === "disconnected" && wasConnected && !nav.hidden) {
    banner.textContent = "Connection to afe lost: the page is not updating. Reconnecting…";
    banner.dataset.kind = "lost"; banner.hidden = false;
  } else if (s === "connected" && banner.dataset.kind === "lost") {
    banner.textContent = "Reconnected: the page is live again.";
    banner.dataset.kind = "back"; banner.hidden = false;
    bannerTimer = setTimeout(() => { banner.hidden = true; banner.dataset.kind = ""; }, 4000);
  }
  if (s === "connected") wasConnected = true;
  if (s === "disconnected" && wasConnected && !nav.hidden && !reconnecting) reconnect();
}
// Try again every 2 s; once back, the page is drawn again (a ticket page watches from the start).
let reconnecting = false;
async function reconnect() {
  reconnecting = true;
  while (!nav.hidden) {
    await new Promise((r) => setTimeout(r, 2000));
    try { await rpc.open(); break; } catch { /* still down */ }
  }
  reconnecting = false;
  if (!nav.hidden) route();
}
const rpc = new Rpc(connStatus);
let cleanup = () => {};

rpc.onAuthLost = async (code) => {
  if (code !== 4401) {
    // The socket did not open: a lost connection (the banner says so), unless the session is gone.
    try { const r = await fetch("/auth/session", { credentials: "same-origin" }); if (r.status !== 401) return; }
    catch { return; }
  }
  showLogin("Your session ended. Log in again.");
};

function errorText(err) {
  if (err instanceof RpcError) return `${err.message} (${err.name})`;
  return String(err && err.message ? err.message : err);
}

function flash(msg, kind = "error") {
  // A multi-line error (a command's output) keeps its lines: preformatted.
  const tag = String(msg).includes("\n") ? "pre" : "p";
  const box = h(tag, { class: `flash ${kind}`, role: kind === "error" ? "alert" : "status" }, msg);
  app.prepend(box);
  setTimeout(() => box.remove(), 8000);
}

// -- login ---------------------------------------------------------------
function showLogin(message) {
  cleanup(); cleanup = () => {};
  configInfo = null;
  nav.hidden = true;
  const input = h("input", { type: "password", id: "token", name: "token", autocomplete: "current-password",
                             required: true, placeholder: "UI token" });
  const note = h("p", { class: "muted", id: "login-note" }, message || "Paste the UI token (the file ui-token in the data folder).");
  const form = h("form", { id: "login-form", class: "card narrow" },
    h("h1", {}, "Log in to afe"), note, input, h("button", { type: "submit" }, "Log in"));
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const resp = await fetch("/auth/login", { method: "POST", headers: { "Content-Type": "application/json" },
                                              body: JSON.stringify({ token: input.value }), credentials: "same-origin" });
    input.value = "";
    if (resp.ok) { nav.hidden = false; route(); return; }
    let msg = `login failed (${resp.status})`;
    try { msg = (await resp.json()).error || msg; } catch { /* keep */ }
    note.textContent = msg;
    note.className = "flash error";
  });
  clear(app).append(form);
  input.focus();
}

// -- board ---------------------------------------------------------------
function card(t) {
  return h("a", { class: `ticket-card state-${t.state}`, href: `#/t/${t.id}`, "data-ticket": t.id },
    h("span", { class: "title" }, t.title),
    h("span", { class: "meta" }, `${t.id} · ${t.workflow} · ${when(t.updated_at_ms)}`));
}

// What to do on an empty board: the form, the demo (when configured), the CLI.
function emptyHint(cfg) {
  const wf = (cfg.workflows[0] || {}).name || "WORKFLOW";
  const cmd = `afe ticket create --workflow ${wf} --title "what to change"`;
  return h("div", { id: "board-empty", class: "card hint" },
    h("h2", {}, "No tickets yet"),
    h("p", {}, "A ticket asks afe to make a change: an agent works on it in a sandbox, the checks run, ",
      "and a pull request waits for your approval."),
    h("ul", {},
      h("li", {}, "Create one with ", h("a", { href: "#/new", id: "hint-new" }, "New ticket"), "."),
      cfg.demo ? h("li", {}, "Or try ", h("b", {}, "Run the demo"), " (above): it fixes a small calculator in about a minute.") : "",
      h("li", {}, "Or from a terminal: ", h("code", { id: "hint-cli" }, cmd),
        cfg.workflows.length > 1 ? ` (workflows: ${cfg.workflows.map((w) => w.name).join(", ")})` : "")),
    cfg.workflows.length ? "" : h("p", { class: "flash error" }, "The configuration declares no Workflow: add one (docs/GUIDE.md), then restart afe."));
}

async function showBoard() {
  const cols = new Map(STATES.map((s) => [s, h("div", { class: "col-body" })]));
  const hint = h("div", { id: "board-hint" });
  const board = h("section", { class: "board", id: "board" },
    STATES.map((s) => h("div", { class: `col col-${s}`, "data-col": s },
      h("h2", {}, s.replace("_", " ")), cols.get(s))));
  clear(app).append(hint, board);
  let stop = false;
  const load = async () => {
    const res = await rpc.call("tickets.list", { page_size: 200 });
    if (!res.tickets.length && !hint.firstChild) hint.append(emptyHint(await learnConfig()));
    if (res.tickets.length) clear(hint);
    for (const c of cols.values()) clear(c);
    for (const t of res.tickets) (cols.get(t.state) || cols.get(STATES[0])).append(card(t));
    for (const [s, c] of cols) if (!c.firstChild) c.append(h("p", { class: "muted" }, "—"));
  };
  try { await load(); } catch (e) { flash(errorText(e)); }
  const timer = setInterval(() => { if (!stop) load().catch(() => {}); }, 2500);
  cleanup = () => { stop = true; clearInterval(timer); };
}

// -- new ticket ----------------------------------------------------------
async function showNew() {
  const [wf, ws] = await Promise.all([rpc.call("workflows.list"), rpc.call("workspaces.list")]);
  const wsSel = h("select", { id: "f-workspace", name: "workspace" },
    h("option", { value: "" }, "(the workflow's default)"),
    ws.workspaces.map((w) => h("option", { value: w.name }, `${w.name} — ${w.repo}`)));
  const wfSel = h("select", { id: "f-workflow", name: "workflow", required: true },
    wf.workflows.map((w) => h("option", { value: w.name }, w.name)));
  const title = h("input", { id: "f-title", name: "title", required: true, maxlength: 200 });
  const body = h("textarea", { id: "f-body", name: "body", rows: 8 });
  // The chosen workflow's declared inputs: required ones marked, defaults pre-filled.
  const inputsBox = h("fieldset", { id: "f-inputs", class: "inputs" });
  const showInputs = () => {
    const w = wf.workflows.find((x) => x.name === wfSel.value);
    const decl = (w && w.inputs) || [];
    clear(inputsBox);
    inputsBox.hidden = !decl.length;
    if (!decl.length) return;
    inputsBox.append(h("legend", {}, "Inputs"));
    for (const i of decl) {
      inputsBox.append(h("label", {}, i.name, i.required ? h("span", { class: "req", title: "required" }, " *") : " (optional)",
        h("input", { name: `input-${i.name}`, "data-input": i.name, value: i.default || "", required: i.required || undefined })));
    }
  };
  wfSel.addEventListener("change", showInputs);
  showInputs();
  const form = h("form", { id: "new-form", class: "card" }, h("h1", {}, "New ticket"),
    h("label", {}, "Workspace", wsSel), h("label", {}, "Workflow", wfSel),
    h("label", {}, "Title", title), h("label", {}, "Body", body), inputsBox,
    h("button", { type: "submit" }, "Create ticket"));
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    try {
      const inputs = {};
      for (const el of inputsBox.querySelectorAll("input[data-input]")) inputs[el.dataset.input] = el.value;
      const t = await rpc.call("tickets.create", { workspace: wsSel.value, workflow: wfSel.value,
                                                   title: title.value, body: body.value, inputs });
      location.hash = `#/t/${t.id}`;
    } catch (e) { flash(errorText(e)); }
  });
  clear(app).append(form);
}

// The configuration as the UI needs it: its workflows, and whether the bundled demo is
// there (the demo-fix workflow of the demo workspace: services/common/demo/afe.yaml).
let configInfo = null;
function learnConfig() {
  if (!configInfo) {
    configInfo = rpc.call("workflows.list").then((r) => ({
      workflows: r.workflows || [],
      demo: (r.workflows || []).some((w) => w.name === DEMO.workflow && w.workspace === DEMO.workspace),
    }));
    configInfo.catch(() => { configInfo = null; });
  }
  return configInfo;
}

// "Run the demo" only where the demo is configured (one's own config has no demo-fix).
async function showDemoButton() {
  const button = document.getElementById("run-demo");
  try { button.hidden = !(await learnConfig()).demo; } catch { button.hidden = true; }
}

async function runDemo() {
  try {
    const t = await rpc.call("tickets.create", DEMO);
    location.hash = `#/t/${t.id}`;
  } catch (e) { flash(errorText(e)); }
}

// -- ticket page ---------------------------------------------------------
// Tokens and the estimated cost (services/common/cost.py, in each model.usage event) per node and for the ticket.
function renderCost(box, spent) {
  clear(box);
  const rows = [...spent.nodes.entries()].sort(([a], [b]) => a.localeCompare(b));
  if (!rows.length) { box.append(h("p", { class: "muted" }, "(no model tokens used yet)")); return; }
  const line = (name, u) => h("tr", { "data-node": name },
    h("td", {}, name), h("td", {}, String(u.input)), h("td", {}, String(u.output)),
    h("td", { class: "cost" }, u.cost === null ? "unknown (no price)" : usd(u.cost) + (u.unpriced ? " + unpriced" : "")));
  box.append(h("table", { class: "cost-table" },
    h("thead", {}, h("tr", {}, h("th", {}, "node"), h("th", {}, "input tokens"), h("th", {}, "output tokens"), h("th", {}, "estimated cost"))),
    h("tbody", {}, rows.map(([n, u]) => line(n, u)), line("total", spent.total))));
}

function addUsage(spent, p) {
  const node = p.node || "(ticket)";
  if (!spent.nodes.has(node)) spent.nodes.set(node, { input: 0, output: 0, cost: null, unpriced: false });
  for (const u of [spent.nodes.get(node), spent.total]) {
    u.input += p.input_tokens || 0; u.output += p.output_tokens || 0;
    if (typeof p.cost_usd === "number") u.cost = (u.cost || 0) + p.cost_usd; else u.unpriced = true;
  }
}

function renderDiff(pre, diff) {
  clear(pre);
  for (const line of diff.split("\n")) {
    let cls = "";
    if (line.startsWith("+++") || line.startsWith("---") || line.startsWith("diff ")) cls = "file";
    else if (line.startsWith("+")) cls = "add";
    else if (line.startsWith("-")) cls = "del";
    else if (line.startsWith("@@")) cls = "hunk";
    pre.append(h("span", { class: cls }, line + "\n"));
  }
}

// A pull request's link: the local forge's page (same origin) opens here, GitHub in a new tab.
// Only http(s) URLs become links: a forge URL is data, never a script.
function prLink(pr, id, label) {
  const url = pr.url || "";
  if (!/^https?:\/\//i.test(url)) return h("span", { id, title: url }, `${label} ${url}`);
  if (new URL(url).origin === location.origin) return h("a", { href: url, id, "data-local": "1" }, label);
  return h("a", { href: url, id, rel: "noopener noreferrer", target: "_blank" }, label);
}

// The records kept with a ticket after it ended: its run nodes' output (the tests) and its usage.
function renderRecords(ticket, tests, usage) {
  clear(tests);
  const runs = (ticket.nodes || []).filter((n) => n.kind === "run" && (n.output || n.error));
  for (const n of runs) {
    tests.append(h("h3", {}, `${n.id} (${n.state})`),
      h("pre", { class: "logs test-output", "data-node": n.id }, (n.output || "") + (n.error ? `\n${n.error}` : "")));
  }
  if (!runs.length) tests.append(h("p", { class: "muted" }, "(no test output)"));
  const u = ticket.usage || {};
  usage.textContent = `usage: ${u.tokens || 0} model tokens`;
}

// -- pull request page (local forge) ----------------------------------------
async function showPull(workspace, number) {
  const title = h("h1", { id: "pull-title" });
  const state = h("span", { id: "pull-state", class: "badge" });
  const meta = h("p", { class: "meta", id: "pull-meta" });
  const decision = h("div", { id: "decision" });
  const actions = h("div", { id: "actions" });
  const diffBox = h("pre", { id: "diff", class: "diff" }, "(loading the diff…)");
  clear(app).append(h("section", { class: "ticket pull" }, h("div", { class: "head" }, title, state), meta, decision, actions,
    h("h2", {}, "Diff"), diffBox));
  let stopped = false, ticket = null;
  const render = () => {
    if (stopped) return;
    const pr = ticket.pr || {};
    title.textContent = `Pull request #${pr.number}: ${ticket.title}`;
    state.textContent = pr.state || "open";
    state.dataset.state = pr.state || "open";
    state.className = `badge pr-${pr.state || "open"}`;
    clear(meta).append(`${workspace} · ${pr.head_branch} → ${pr.base_branch} · head ${(pr.head_sha || "").slice(0, 12)}`,
      pr.merge_sha ? ` · merge ${pr.merge_sha.slice(0, 12)}` : "", " · ticket ",
      h("a", { href: `/#/t/${ticket.id}`, id: "pull-ticket" }, ticket.id), ` (${ticket.state.replace("_", " ")})`);
    const group = `${ticket.state}:${ticket.awaiting_sha}:${pr.head_sha}`;
    diff.want(`${group}:${ticket.last_seq}`, group, () => rpc.call("tickets.diff", { id: ticket.id }));
    showDiff(diffBox, diff);
    clear(actions);
    if (ticket.state === WAITING_APPROVAL) {
      // Pinned to the head shown here: a newer push makes the approval fail (R16).
      records.want(group, group, () => rpc.call("tickets.records", { id: ticket.id }).then(decodeRecords));
      showApprovalPanel(decision, { ticket, group, diff, records, act,
                                    followup: (text) => act("tickets.followup", { id: ticket.id, instruction: text }) });
    } else showApprovalPanel(decision, null);
    if (ticket.approval) {
      actions.append(h("p", { class: "muted", id: "approval" },
        ` ${ticket.approval.granted ? "approved" : "rejected"} by ${ticket.approval.principal}${ticket.approval.reason ? ": " + ticket.approval.reason : ""}`));
    }
  };
  const diff = new Keyed(render), records = new Keyed(render);
  const load = async () => { ticket = await rpc.call("pulls.get", { workspace, number }); render(); };
  const act = async (method, params) => {
    try { await rpc.call(method, params); await load(); } catch (e) { flash(errorText(e)); }
  };
  await load();
  const timer = setInterval(() => { if (!stopped) load().catch(() => {}); }, 2000);
  cleanup = () => { stopped = true; clearInterval(timer); diff.stop(); records.stop(); };
}

// The diff box: the latest diff that arrived; before one did, what is happening.
function showDiff(pre, diff, idle = "(loading the diff…)") {
  if (diff.value !== undefined) {
    if (pre.dataset.version === String(diff.version)) return;
    pre.dataset.version = String(diff.version);
    const d = diff.value;
    renderDiff(pre, (d.diff || "(no changes)") + (d.truncated ? "\n(cut short: the diff is larger than afe shows)" : "")
      + (d.recorded ? "\n(stored when the ticket ended)" : ""));
  } else if (diff.error) {
    pre.textContent = `(the diff could not be loaded: ${errorText(diff.error)}; trying again)`;
  } else {
    pre.textContent = diff.key === null ? idle : "(loading the diff…)";
  }
}

async function showTicket(id) {
  const title = h("h1", { id: "ticket-title" });
  const state = h("span", { id: "ticket-state", class: "badge" });
  const meta = h("p", { class: "meta", id: "ticket-meta" });
  const err = h("pre", { class: "flash error", id: "ticket-error", hidden: true });   // multi-line errors keep their lines
  const decision = h("div", { id: "decision" });
  const actions = h("div", { class: "actions", id: "actions" });
  const prBox = h("p", { id: "pr" });
  const graph = h("div", { id: "graph", class: "graph-box" });
  const logs = h("pre", { id: "logs", class: "logs" });
  const tools = h("ol", { id: "tools", class: "tools" });
  const NO_PUSH = "(nothing pushed yet: the change shows here once the ticket has committed it)";
  const diffBox = h("pre", { id: "diff", class: "diff" }, NO_PUSH);
  const recordsBox = h("div", { id: "records" }, h("p", { class: "muted" }, "(no signed record yet: afe signs one when it asks for an approval)"));
  const body = h("pre", { class: "body", id: "ticket-body" });
  const tests = h("div", { id: "test-output" });
  const usage = h("p", { class: "meta", id: "usage" });
  const provenance = h("ul", { class: "meta", id: "ticket-provenance", hidden: true });
  const costBox = h("div", { id: "cost" });
  const prompts = h("div", { id: "prompts" }, h("p", { class: "muted" }, "(no model node has started)"));
  const filterNote = h("p", { class: "meta", id: "log-filter", hidden: true });
  const spent = { nodes: new Map(), total: { input: 0, output: 0, cost: null, unpriced: false } };
  let signed = 0;   // record.signed and approval.requested events seen: the records to load again
  let filter = "";   // a node id: the log shows only its lines (click its box in the graph; again to clear)
  const applyFilter = (span) => { span.hidden = !!filter && span.dataset.node !== filter; };
  const markSelected = () => {
    for (const g of graph.querySelectorAll("g.node")) g.classList.toggle("selected", g.dataset.node === filter);
  };
  graph.addEventListener("click", (ev) => {
    const g = ev.target.closest && ev.target.closest("g.node");
    if (!g) return;
    filter = filter === g.dataset.node ? "" : g.dataset.node;
    filterNote.hidden = !filter;
    filterNote.textContent = filter ? `Showing only the lines of ${filter}; click it in the graph again to show all.` : "";
    for (const span of logs.children) applyFilter(span);
    markSelected();
  });
  clear(app).append(h("section", { class: "ticket" },
    h("div", { class: "head" }, title, state), meta, provenance, err, decision, actions, prBox,
    h("h2", {}, "Workflow"), graph,
    h("div", { class: "split" },
      h("div", {}, h("h2", {}, "Live log"), filterNote, logs),
      h("div", {}, h("h2", {}, "Tool calls"), tools)),
    h("h2", {}, "Diff"), diffBox, h("h2", {}, "Test output"), tests, usage,
    h("h2", {}, "Signed run record"), recordsBox,
    h("h2", {}, "Tokens and cost"), costBox, h("h2", {}, "Prompts"), prompts, h("h2", {}, "Ticket"), body));
  renderCost(costBox, spent);

  let ticket = null, stopped = false, sub = null, lastSeq = 0, refreshTimer = null;
  const render = () => {
    if (!ticket || stopped) return;
    title.textContent = ticket.title;
    state.textContent = ticket.state.replace("_", " ");
    state.dataset.state = ticket.state;
    state.className = `badge state-${ticket.state}`;
    meta.textContent = `${ticket.id} · workspace ${ticket.workspace} · workflow ${ticket.workflow}${ticket.sandbox_runtime ? " · sandbox " + ticket.sandbox_runtime : ""} · created ${when(ticket.created_at_ms)}`;
    err.hidden = !ticket.error;
    err.textContent = ticket.error || "";
    body.textContent = ticket.body || "(no body)";
    // Provenance of each input (R36): text from GitHub is data written by someone outside afe.
    const o = ticket.origin;
    provenance.hidden = !o;
    clear(provenance);
    if (o) {
      const who = `from ${o.source} ${o.event} by @${o.author} (Trigger ${o.trigger})`;
      const src = /^https?:\/\//i.test(o.url || "")
        ? h("a", { href: o.url, rel: "noopener noreferrer", target: "_blank" }, o.url) : (o.url || "");
      provenance.append(h("li", { id: "origin" }, who, " ", src));
      if (o.title_untrusted || o.body_untrusted) {
        provenance.append(h("li", { class: "untrusted" }, "title and body: untrusted text from outside"));
      }
      for (const i of o.inputs || []) {
        provenance.append(h("li", { class: i.untrusted ? "untrusted" : "" },
          `input ${i.name} ← ${i.source}${i.untrusted ? " (untrusted)" : ""}`));
      }
    }
    clear(graph).append(drawGraph(ticket.nodes, Date.now()));
    markSelected();
    clear(prBox);
    if (ticket.pr) {
      const pr = ticket.pr;
      // Only http(s) URLs become links: a forge URL is data, never a script.
      const label = `#${pr.number}`;
      const link = prLink(pr, "pr-link", label);
      prBox.append("Pull request ", link, ` (${pr.state}) ${pr.head_branch} → ${pr.base_branch}`,
        pr.merge_sha ? ` · merge ${pr.merge_sha.slice(0, 12)}` : "");
    }
    // The diff of what is asked to be approved is fetched once the ticket waits for it (its
    // workspace holds that head then), and the decision is offered only once it is shown.
    const group = `${ticket.state}:${ticket.awaiting_sha}:${ticket.pr ? ticket.pr.head_sha : ""}`;
    if (ticket.state === WAITING_APPROVAL || TERMINAL.has(ticket.state) || ticket.pr) {
      diff.want(`${group}:${ticket.last_seq}`, group, () => rpc.call("tickets.diff", { id }));
    }
    showDiff(diffBox, diff, NO_PUSH);
    if (ticket.state === WAITING_APPROVAL || TERMINAL.has(ticket.state) || signed) {
      records.want(`${group}:${signed}`, group, () => rpc.call("tickets.records", { id }).then(decodeRecords));
    }
    if (records.value !== undefined && records.version !== shownRecords) {
      shownRecords = records.version;
      recordsView(recordsBox, records.value);
    }
    showApprovalPanel(decision, ticket.state === WAITING_APPROVAL ? { ticket, group, diff, records, act,
      followup: (text) => reopen("tickets.followup", { id, instruction: text }) } : null);
    clear(actions);
    if (!TERMINAL.has(ticket.state)) {
      actions.append(h("button", { id: "cancel", type: "button", class: "quiet", onclick: () => act("tickets.cancel", { id }) }, "Cancel ticket"));
    }
    if (RETRYABLE.has(ticket.state)) {
      // Recovery: run it again on its branch (Engine.retry), or merge the base into a conflicting branch.
      const from = h("select", { id: "retry-from", title: "run again from" },
        h("option", { value: "" }, "the nodes that did not succeed"),
        ...(ticket.nodes || []).map((n) => h("option", { value: n.id }, `from ${n.id}`)));
      actions.append(h("button", { id: "retry", type: "button", class: "good", onclick: () => reopen("tickets.retry", { id, from_node: from.value }) }, "Retry"), from);
      if (ticket.pr && ticket.pr.state !== "merged") {
        actions.append(h("button", { id: "update-branch", type: "button", class: "quiet", onclick: () => reopen("tickets.updateBranch", { id }) }, "Update branch"));
      }
    }
    if (ticket.approval) {
      actions.append(h("span", { class: "muted", id: "approval" },
        ` ${ticket.approval.granted ? "approved" : "rejected"} by ${ticket.approval.principal}${ticket.approval.reason ? ": " + ticket.approval.reason : ""}`));
    }
    renderRecords(ticket, tests, usage);
  };
  const diff = new Keyed(render), records = new Keyed(render);
  let shownRecords = 0;
  const refresh = async () => {
    try { ticket = await rpc.call("tickets.get", { id }); render(); } catch (e) { if (!stopped) flash(errorText(e)); }
  };
  const scheduleRefresh = () => {
    if (refreshTimer) return;
    refreshTimer = setTimeout(() => { refreshTimer = null; if (!stopped) refresh(); }, 150);
  };
  const reopen = async (method, params) => {
    // A re-opened ticket has new events after its end: watch it again from the start.
    try { await rpc.call(method, params); cleanup(); cleanup = () => {}; await showTicket(id); } catch (e) { flash(errorText(e)); }
  };
  const act = async (method, params) => {
    try { ticket = await rpc.call(method, params); render(); } catch (e) { flash(errorText(e)); }
  };
  const onEvent = (e) => {
    lastSeq = Math.max(lastSeq, e.seq);
    const p = e.payload || {};
    if (e.type === "node.tool_call") {
      tools.append(h("li", { class: "tool-call", "data-kind": "model" }, h("b", {}, `${p.node}: ${p.name}`), " ", h("code", {}, String(p.arguments || "").slice(0, 600))));
    } else if (e.type === "agent.tool_call") {
      tools.append(h("li", { class: "tool-call", "data-kind": "agent", "data-call": p.id || "" },
        h("b", {}, `${p.node ? p.node + ": " : ""}${p.title || p.kind}`), " ", h("code", { class: "status" }, p.status || "")));
    } else if (e.type === "agent.tool_call_update" && p.status) {
      for (const li of tools.querySelectorAll("li[data-call]")) {
        if (li.dataset.call === p.id) { const st = li.querySelector(".status"); if (st) st.textContent = p.status; }
      }
    }
    if (e.type === "model.usage") { addUsage(spent, p); renderCost(costBox, spent); }
    if (e.type === "record.signed" || e.type === "approval.requested") signed += 1;
    if (e.type === "node.prompt") {
      if (!prompts.querySelector("details")) clear(prompts);
      prompts.append(h("details", { class: "prompt", "data-node": p.node || "" },
        h("summary", {}, `${p.node}: the prompt sent to ${p.model || "the model"}`),
        h("h3", {}, "System prompt"), h("pre", { class: "prompt-system" }, p.system || ""),
        h("h3", {}, "Prompt"), h("pre", { class: "prompt-text" }, (p.prompt || "") + (p.truncated ? "\n(cut short in the event)" : ""))));
    }
    const line = eventLine(e);
    const atBottom = logs.scrollTop + logs.clientHeight >= logs.scrollHeight - 4;
    const span = h("span", { class: line.cls, "data-type": e.type, "data-node": p.node || "" }, line.text.endsWith("\n") ? line.text : line.text + "\n");
    applyFilter(span);
    logs.append(span);
    if (atBottom) logs.scrollTop = logs.scrollHeight;
    if (e.type !== "node.output" && e.type !== "verification.output") scheduleRefresh();
  };
  const startWatch = async () => {
    try {
      sub = await rpc.watch(id, lastSeq + 1, onEvent, (error) => {
        sub = null;
        if (stopped) return;
        refresh();
        if (error && error.message !== "connection closed") flash(error.message);
        else if (!ticket || !TERMINAL.has(ticket.state)) setTimeout(() => { if (!stopped) startWatch(); }, 1000);
      });
    } catch (e) { if (!stopped) flash(errorText(e)); }
  };
  await refresh();
  if (!ticket) return;
  await startWatch();
  const tick = setInterval(() => { if (ticket && !TERMINAL.has(ticket.state)) { clear(graph).append(drawGraph(ticket.nodes, Date.now())); markSelected(); } }, 1000);
  cleanup = () => { stopped = true; clearInterval(tick); diff.stop(); records.stop(); if (sub) rpc.unwatch(sub); };
}

// -- routing -------------------------------------------------------------
async function route() {
  cleanup(); cleanup = () => {};
  showDemoButton();
  const hash = location.hash || "#/";
  const pull = location.pathname.match(/^\/pulls\/([A-Za-z0-9][A-Za-z0-9_.-]{0,99})\/([0-9]{1,20})$/);
  if (pull && location.hash) { location.assign("/" + location.hash); return; }   // the nav's links leave the page
  try {
    if (pull) { await showPull(pull[1], pull[2]); return; }
    const m = hash.match(/^#\/t\/([a-z0-9-]{1,63})$/);
    if (m) await showTicket(m[1]);
    else if (hash === "#/new") await showNew();
    else await showBoard();
  } catch (e) { flash(errorText(e)); }
}

async function start() {
  document.getElementById("run-demo").addEventListener("click", runDemo);
  document.getElementById("logout").addEventListener("click", async () => {
    await fetch("/auth/logout", { method: "POST", credentials: "same-origin" });
    if (rpc.ws) rpc.ws.close();
    showLogin("Logged out.");
  });
  window.addEventListener("hashchange", () => { if (!nav.hidden) route(); });
  const who = await fetch("/auth/session", { credentials: "same-origin" });
  if (!who.ok) { showLogin(); return; }
  nav.hidden = false;
  route();
}

start();
