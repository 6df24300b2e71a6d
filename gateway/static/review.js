// What a person decides on: the approval panel (the head's clean-room verification,
// R41, and the actions it allows) and the signed run records (R42) decoded.
// Every value shown is text (dom.js's h(): textContent), never markup.

import { h, when } from "./dom.js";
import { short, testsText, commandOutcome, verificationText, baseText, usd } from "./events.js";

// -- loading ----------------------------------------------------------------
// One value fetched per key (the newest key wins; an older answer is dropped). `group` names
// what the value is of (a ticket's state and head): a refetch within the same group keeps the
// value shown, and `ready(group)` says a value of that group arrived. After an error it asks
// again in 3 s.
export class Keyed {
  constructor(onChange) {
    this.onChange = onChange;
    this.key = null; this.group = null; this.okGroup = null;
    this.value = undefined; this.error = null; this.loading = false; this.timer = null;
    this.version = 0;   // counts the values that arrived
  }

  want(key, group, fetch) {
    if (key === this.key) return;
    this.key = key; this.group = group; this.loading = true;
    clearTimeout(this.timer);
    fetch().then((v) => {
      if (this.key !== key) return;
      this.value = v; this.okGroup = group; this.error = null; this.loading = false; this.version += 1;
      this.onChange();
    }, (e) => {
      if (this.key !== key) return;
      this.error = e; this.loading = false;
      this.onChange();
      this.timer = setTimeout(() => { if (this.key === key) { this.key = null; this.onChange(); } }, 3000);
    });
  }

  ready(group) { return this.okGroup === group; }
  stop() { clearTimeout(this.timer); this.key = {}; }
}

// -- the signed run record ----------------------------------------------------
// A DSSE envelope's in-toto statement, decoded (not checked: `afe verify` checks the signature).
export function decodeEnvelope(text) {
  let env;
  try { env = JSON.parse(text); } catch { return { error: "the envelope is not JSON" }; }
  if (!env || typeof env !== "object" || Array.isArray(env)) return { error: "the envelope is not a JSON object" };
  let statement;
  try {
    const bytes = Uint8Array.from(atob(String(env.payload || "")), (c) => c.charCodeAt(0));
    statement = JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(bytes));
  } catch { return { error: "its payload is not base64-encoded JSON" }; }
  if (!statement || typeof statement !== "object") return { error: "its payload is not a statement" };
  const sigs = Array.isArray(env.signatures) ? env.signatures : [];
  return { payloadType: String(env.payloadType || ""), keyids: sigs.map((s) => s && s.keyid).filter(Boolean).map(String),
           statement, predicate: statement.predicate && typeof statement.predicate === "object" ? statement.predicate : {} };
}

// The records of tickets.records, decoded, oldest first.
export function decodeRecords(res) {
  return ((res && res.records) || []).map((r) => ({ ...r, decoded: decodeEnvelope(r.envelope) }));
}

// The request record of `sha` (what the approval of that head was asked with).
export function requestRecord(records, sha) {
  return (records || []).find((r) => r.sha === sha && r.kind === "request") || null;
}

const list = (items, id, cls = "") => h("ul", { id, class: `files ${cls}` }, items.map((x) => h("li", {}, h("code", {}, String(x)))));
const cell = (v) => h("td", {}, v === null || v === undefined || v === "" ? "—" : String(v));
function table(id, head, rows) {
  return h("table", { id, class: "kv-table" }, h("thead", {}, h("tr", {}, head.map((x) => h("th", {}, x)))),
    h("tbody", {}, rows.map((r) => h("tr", {}, r.map(cell)))));
}
const seconds = (ms) => (typeof ms === "number" ? `${(ms / 1000).toFixed(1)} s` : "");
function countsText(c) {
  if (!c) return "not reported";
  return testsText(c) + (c.runner ? ` (${c.runner})` : "");
}
const arr = (x) => (Array.isArray(x) ? x : []);

// A verification in full: verdict, the base it was verified on, each command with its counts,
// why it failed, and what a person must look at (harness changes, binary files, shadowing names).
export function verificationDetails(v) {
  const box = h("div", { class: "verification", id: "verification-details" });
  box.append(h("p", {}, h("span", { id: "verification", class: `badge verify-${v.passed ? "passed" : "failed"}`, "data-passed": String(!!v.passed) },
    v.passed ? "✓ verified" : "✗ verification failed"), " ", h("span", { id: "verification-text" }, verificationText(v))));
  const onto = baseText(v);
  if (onto) {
    box.append(h("p", { class: "meta", id: "verify-base" }, `Verified as the head ${onto}`,
      v.merge_sha ? ` (the merge ${short(v.merge_sha)} ran in the clean room)` : "",
      arr(v.base_paths).length ? `; ${v.base_paths.join(", ")} and the test harness taken from the base` : ""));
  }
  const cmds = arr(v.commands);
  if (cmds.length) {
    box.append(table("verify-commands", ["command", "result", "took", "tests"],
      cmds.map((c) => [c.command, commandOutcome(c), seconds(c.duration_ms), c.counts === undefined ? "" : countsText(c.counts)])));
  }
  if (v.tests || v.base_tests) {
    box.append(h("p", { id: "verify-tests" }, v.tests ? `In all: ${testsText(v.tests)}.` : "No test counts reported.",
      v.base_tests ? ` The base's own run: ${testsText(v.base_tests)}.` : ""));
  }
  if (arr(v.reasons).length) {
    box.append(h("p", { class: "warn-title" }, "Why it failed:"), h("ul", { id: "verify-reasons" }, v.reasons.map((r) => h("li", {}, String(r)))));
  }
  if (v.error) box.append(h("p", { id: "verify-error", class: "flash error" }, String(v.error)));
  if (arr(v.harness_changes).length) {
    box.append(h("div", { id: "harness-changes", class: "warn" },
      h("p", {}, h("b", {}, "This head changes how tests run. "),
        "The clean room ran the base's version of these files; approving merges the head's version:"),
      list(v.harness_changes, "harness-files")));
  }
  if (arr(v.binary_files).length) {
    box.append(h("div", { id: "binary-files", class: "warn" },
      h("p", {}, h("b", {}, "Binary files "), "the head adds or changes (the diff cannot show them; bytecode is removed in the clean room):"),
      list(v.binary_files, "binary-list")));
  }
  if (arr(v.shadowing).length) {
    box.append(h("div", { id: "shadowing", class: "warn" },
      h("p", {}, h("b", {}, "Names that shadow a module "), "the tests or a verify command import (a standard module, the test runner):"),
      list(v.shadowing, "shadowing-list")));
  }
  if (v.omitted && typeof v.omitted === "object") {
    const left = Object.entries(v.omitted).filter(([, n]) => Number(n) > 0).map(([k, n]) => `${n} more ${k.replace(/_/g, " ")}`);
    if (left.length) box.append(h("p", { class: "meta", id: "verify-omitted" }, `Left out (lists are bounded): ${left.join(", ")}.`));
  }
  return box;
}

// -- the approval panel ---------------------------------------------------------
// `ticket` waits for approval of ticket.awaiting_sha. `diffReady`: its diff is shown;
// `records`: the Keyed of tickets.records (decoded), fetched while it waits for this head.
// `act(method, params)` calls /rpc; `followup(text)` re-opens the ticket with an instruction.
export function approvalPanel({ ticket, group, diff, records, act, followup }) {
  const sha = ticket.awaiting_sha || "";
  const panel = h("section", { id: "approval-panel", class: "card approval", "data-sha": sha });
  panel.append(h("h2", {}, `Your decision on ${short(sha) || "the change"}`));
  const reason = h("input", { id: "reject-reason", placeholder: "reason (for reject)", maxlength: 2000 });
  const reject = h("button", { id: "reject", type: "button", class: "bad", onclick: () => act("tickets.reject", { id: ticket.id, reason: reason.value }) }, "Reject");
  const text = h("textarea", { id: "followup-text", rows: 2, maxlength: 65536, placeholder: "what to change (the agent runs again with it)" });
  const send = h("button", { id: "followup", type: "button", class: "quiet", onclick: () => { if (text.value.trim()) followup(text.value); } }, "Send follow-up");
  const rest = h("div", { class: "actions" }, reason, reject);
  const follow = h("div", { class: "followup" }, h("label", { for: "followup-text" }, "Follow-up"), text, send);

  if (!diff.ready(group) || !records.ready(group)) {
    const why = [diff.error && !diff.ready(group) ? `the diff: ${errorText(diff.error)}` : "",
                 records.error && !records.ready(group) ? `the run record: ${errorText(records.error)}` : ""].filter(Boolean);
    panel.append(h("p", { id: "approve-wait", class: "muted" },
      why.length ? `Not loaded yet (${why.join("; ")}); trying again…` : `Loading the diff and the verification of ${short(sha)} before asking for your decision…`),
      rest, follow);
    return panel;
  }
  const rec = requestRecord(records.value, sha);
  const v = rec && !rec.decoded.error ? rec.decoded.predicate.verification : undefined;
  let approve;
  if (rec === null) {
    panel.append(h("p", { class: "muted", id: "no-record" }, `No signed run record of ${short(sha)} was found: its verification cannot be shown here.`));
  } else if (rec.decoded.error) {
    panel.append(h("p", { class: "flash error", id: "no-record" }, `The run record of ${short(sha)} cannot be read: ${rec.decoded.error}.`));
  } else if (!v) {
    panel.append(h("p", { class: "muted", id: "no-verify" }, "This workflow declares no verify: nothing checked this head in a clean room."));
  } else {
    panel.append(verificationDetails(v));
  }
  if (v && !v.passed) {
    // Not a normal action: the scheduler refuses it, and the merge would be refused.
    panel.append(h("p", { id: "approve-blocked", class: "flash error" },
      "Approving is not offered: this head's verification failed, so its merge would be refused. ",
      "Send a follow-up saying what to fix (the code, not the tests), or reject the change."));
    panel.append(follow, rest);
    return panel;
  }
  if (v && arr(v.harness_changes).length) {
    approve = h("button", { id: "approve-harness", type: "button", class: "warn",
      title: `acknowledges the change to: ${v.harness_changes.join(", ")}`,
      onclick: () => act("tickets.approve", { id: ticket.id, sha: sha || undefined, accept_harness_change: true }) },
      "Accept harness change and approve");
    panel.append(h("p", { class: "muted" }, `Approving acknowledges, in the signed record, that ${v.harness_changes.length === 1 ? "this file changes" : "these files change"} how tests run: ${v.harness_changes.join(", ")}.`));
  } else {
    approve = h("button", { id: "approve", type: "button", class: "good", onclick: () => act("tickets.approve", { id: ticket.id, sha: sha || undefined }) }, "Approve");
  }
  rest.prepend(h("span", { class: "muted" }, `Merge ${short(sha)}? `), approve);
  panel.append(rest, follow);
  return panel;
}

// The panel in `box` (null opts: none), made again only when what it shows changed, so a
// reviewer's typing and focus survive the page's refreshes.
export function showApprovalPanel(box, opts) {
  if (!opts) { box.dataset.key = ""; box.replaceChildren(); return; }
  const { group, diff, records } = opts;
  const key = [opts.ticket.id, group, diff.ready(group), records.ready(group) ? records.version : "-",
               diff.error ? errorText(diff.error) : "", records.error ? errorText(records.error) : ""].join("|");
  if (box.dataset.key === key) return;
  box.dataset.key = key;
  box.replaceChildren(approvalPanel(opts));
}

function errorText(e) {
  if (!e) return "";
  return e.name && e.name !== "Error" && e.name !== "error" ? `${e.message} (${e.name})` : String(e.message || e);
}

// -- the record panel -------------------------------------------------------------
function section(title, ...body) {
  return h("div", { class: "rec-section" }, h("h4", {}, title), ...body);
}

function hostRows(hosts) {
  return arr(hosts).filter((x) => x && typeof x === "object").map((x) => [x.host, x.count]);
}

// A predicate key this page does not know: its value as lines of text.
function plainBlock(v) {
  const text = (x, depth) => {
    if (x === null || x === undefined) return "—";
    if (typeof x !== "object") return String(x);
    if (depth > 3) return "…";
    const entries = Array.isArray(x) ? x.map((y, i) => [String(i + 1), y]) : Object.entries(x);
    return entries.map(([k, y]) => `${"  ".repeat(depth)}${k}: ${typeof y === "object" && y !== null ? "\n" + text(y, depth + 1) : text(y, depth)}`).join("\n");
  };
  return h("pre", { class: "body rec-plain" }, text(v, 0));
}

const KNOWN = new Set(["kind", "ticket", "repository", "head", "afe_run", "workflow", "agents", "models", "prompts",
                       "egress", "usage", "commands", "agent_commands", "mcp_calls", "verification", "decision"]);

function runSections(p) {
  const out = [];
  if (arr(p.agents).length) {
    out.push(section("Agents", table(null, ["agent", "preset", "version", "image", "model", "variables (names only)"],
      p.agents.map((a) => [a.name, a.preset, a.version, a.image, a.model, arr(a.env_names).join(", ")]))));
  }
  out.push(section("Models", arr(p.models).length ? table(null, ["model", "provider", "model id"], p.models.map((m) => [m.name, m.provider, m.model]))
    : h("p", { class: "muted" }, "none")));
  if (arr(p.prompts).length) {
    out.push(section("Prompts (their SHA-256; the text is not in the record)",
      table(null, ["node", "SHA-256", "bytes"], p.prompts.map((x) => [x.node, x.sha256, x.bytes]))));
  }
  const u = p.usage || {};
  const sum = (k) => arr(u.models).reduce((n, m) => n + (Number(m[k]) || 0), 0);
  out.push(section("Usage", arr(u.models).length
    ? table("rec-usage", ["model", "calls", "input tokens", "output tokens", "estimated cost"],
      [...u.models.map((m) => [m.model, m.calls, m.input_tokens, m.output_tokens, usd(m.cost_usd)]),
       ["total", sum("calls"), sum("input_tokens"), sum("output_tokens"), usd(u.cost_usd)]])
    : h("p", { class: "muted" }, "no model tokens")));
  out.push(section("Commands", arr(p.commands).length
    ? table("rec-commands", ["node", "command", "exit codes"], p.commands.map((c) => [c.node, c.command, arr(c.exit_codes).map((x) => (x === null ? "?" : x)).join(", ") || "not run"]))
    : h("p", { class: "muted" }, "no run: node")));
  if (arr(p.agent_commands).length) {
    out.push(section("Commands the agents ran (the program; the command line as SHA-256)",
      table(null, ["node", "program", "exit code"], p.agent_commands.map((c) => [c.node, c.program, c.exit_code === null ? (c.signal ? `signal ${c.signal}` : "not waited for") : c.exit_code]))));
  }
  if (arr(p.mcp_calls).length) {
    out.push(section("MCP tool calls (the arguments as SHA-256; results are not in the record)",
      table(null, ["node", "via", "server", "tool", "outcome", "bytes sent", "bytes received"],
        p.mcp_calls.map((c) => [c.node, c.via, c.server, c.tool || (c.server ? "(not a tool name)" : ""), c.outcome + (c.count ? ` (${c.count})` : ""), c.request_bytes, c.response_bytes]))));
  }
  return out;
}

// One record's statement, readable: what ran (nodes, models, egress with counts, commands),
// its verification and the decision.
export function recordView(r) {
  const d = r.decoded;
  const box = h("details", { class: "record", "data-kind": r.kind, "data-sha": r.sha });
  box.append(h("summary", {}, `${r.kind} record of ${short(r.sha)}`, r.at_ms ? ` · ${when(r.at_ms)}` : "",
    d.keyids && d.keyids.length ? ` · signed by key ${d.keyids.join(", ")}` : ""));
  if (d.error) { box.append(h("p", { class: "flash error" }, `This record cannot be read: ${d.error}.`)); return box; }
  const s = d.statement, p = d.predicate;
  const subj = arr(s.subject)[0] || {};
  box.append(h("p", { class: "meta" }, `Subject: ${subj.name || "?"} at commit ${(subj.digest || {}).gitCommit || "?"} · `,
    `predicate ${s.predicateType || "?"} · check the signature with `, h("code", {}, `afe verify ${(p.ticket || {}).id || "TICKET"}`)));
  const t = p.ticket || {}, repo = p.repository || {};
  box.append(section("Ticket", h("p", {}, `${t.id || "?"} in workspace ${t.workspace || "?"}, created by ${t.principal || "?"}`,
    t.created_at_ms ? ` on ${when(t.created_at_ms)}` : "", "; its title, body and follow-ups are in the record only as SHA-256 digests."),
    h("p", {}, `Repository: ${repo.forge || "?"} ${repo.repo || ""} · branch ${repo.branch || "?"} → ${repo.base_branch || "?"}`,
      repo.pull_request ? ` · pull request ${repo.pull_request}` : "")));
  const head = p.head;
  if (head && typeof head === "object") {
    box.append(section("Head", h("p", { class: head.pushed_by === "person" ? "flash error" : "" },
      head.pushed_by === "person" ? `Pushed by a person, not by afe's run (afe's run made ${short(head.afe_head) || "no head"}); what afe's run did is listed apart below.`
        : `Pushed by afe's run (${short(head.sha)}).`)));
  }
  const wf = p.workflow || {};
  box.append(section(`Workflow ${wf.name || ""}`, table("rec-nodes", ["node", "kind", "model / agent", "state", "attempts", "rounds"],
    arr(wf.nodes).map((n) => [n.id, n.uses || n.kind, n.model || n.agent || "", n.state || "not run", n.attempts, n.rounds])),
    wf.max_tokens ? h("p", { class: "meta" }, `token budget: ${wf.max_tokens}`) : ""));
  box.append(...runSections(p));
  if (p.afe_run && typeof p.afe_run === "object") {
    box.append(h("div", { class: "rec-afe-run" }, h("h4", {}, `What afe's run did (its head: ${short(p.afe_run.head) || "none"})`), ...runSections(p.afe_run)));
  }
  const eg = p.egress || {};
  box.append(section("Egress", h("p", {}, `Allowed hosts: ${arr(eg.allowed).join(", ") || "none (no network)"}`,
      arr(eg.allowed_private).length ? `; private: ${eg.allowed_private.join(", ")}` : ""),
    h("p", {}, "Requests let through:"),
    Array.isArray(eg.allowed_counts) ? (eg.allowed_counts.length ? table("rec-egress-allowed", ["host", "requests"], hostRows(eg.allowed_counts)) : h("p", { class: "muted" }, "none"))
      : h("p", { class: "muted" }, String(eg.allowed_counts || "not recorded")),
    eg.allowed_truncated ? h("p", { class: "meta" }, "… and more hosts") : "",
    h("p", {}, "Requests refused:"),
    arr(eg.denied).length ? table("rec-egress-denied", ["host", "requests"], hostRows(eg.denied)) : h("p", { class: "muted" }, "none"),
    eg.denied_truncated ? h("p", { class: "meta" }, "… and more hosts") : ""));
  box.append(section("Verification", p.verification && typeof p.verification === "object"
    ? verificationDetails(p.verification) : h("p", { class: "muted" }, "none declared (the workflow has no verify:)")));
  const dec = p.decision;
  if (dec && typeof dec === "object") {
    box.append(section("Decision", h("p", { class: "rec-decision" }, `${dec.granted ? "Approved" : "Rejected"} by ${dec.principal || "?"} on ${short(dec.sha)}`,
      dec.at_ms ? ` at ${when(dec.at_ms)}` : "", dec.reason_sha256 ? " (the reason is in the record as its SHA-256)" : ""),
      arr(dec.accepted_harness_change).length ? h("p", {}, "Acknowledged harness changes: ", dec.accepted_harness_change.join(", ")) : ""));
  }
  for (const [k, v] of Object.entries(p)) if (!KNOWN.has(k)) box.append(section(k.replace(/_/g, " "), plainBlock(v)));
  // The ids keep to one record's copy of the shared tables: a page shows several records.
  for (const el of box.querySelectorAll("[id]")) { el.dataset.part = el.id; el.removeAttribute("id"); }
  return box;
}

export function recordsView(box, records) {
  if (!records || !records.length) { box.replaceChildren(h("p", { class: "muted" }, "(no signed record yet: afe signs one when it asks for an approval)")); return; }
  const open = new Set([...box.querySelectorAll("details.record[open]")].map((d) => `${d.dataset.kind}:${d.dataset.sha}`));
  box.replaceChildren(...records.map((r) => {
    const v = recordView(r);
    if (open.has(`${r.kind}:${r.sha}`)) v.open = true;
    return v;
  }));
}
