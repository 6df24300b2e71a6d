// One readable line per ticket event for the ticket page's log (never raw JSON),
// and how a clean-room verification (R41) reads for people. services/cli/event_lines.py
// words the same events for `afe ticket watch`.

export const short = (sha) => String(sha || "").slice(0, 12);
const plural = (n, word) => `${n} ${word}${n === 1 ? "" : "s"}`;

export function usd(v) {
  if (typeof v !== "number") return "—";
  return v < 1 ? `$${v.toFixed(4)}` : `$${v.toFixed(2)}`;
}

// "5 tests: 4 passed, 1 failed, 2 skipped" (zero counts left out, except passed).
export function testsText(t) {
  if (!t || typeof t !== "object") return "";
  const parts = [`${t.passed || 0} passed`];
  for (const k of ["failed", "errors", "skipped", "deselected"]) if (t[k]) parts.push(`${t[k]} ${k}`);
  return `${plural(t.ran || 0, "test")}: ${parts.join(", ")}`;
}

function commandFailed(c) { return c.exit_code !== 0 || c.timed_out; }

// How a command ended: "exit 0", "exited 1", "timed out".
export function commandOutcome(c) {
  if (c.timed_out) return "timed out";
  return c.exit_code === 0 ? "exit 0" : `exited ${c.exit_code}`;
}

// A head's verification in one line, as services/common/verification.py words it for the CLI.
export function verificationText(v) {
  const cmds = v.commands || [];
  const where = (v.base_paths || []).length ? ` (${v.base_paths.join(", ")} from ${v.base_branch || "the base branch"})` : "";
  const reasons = (v.reasons || []).filter(Boolean);
  if (v.passed) {
    const tests = v.tests ? `, ${testsText(v.tests)}` : "";
    return `verification passed: ${plural(cmds.length, "command")}${tests}${where}`;
  }
  const f = cmds.find(commandFailed);
  const why = reasons.length ? `; ${reasons.join("; ")}` : "";
  if (f) return `verification failed: ${f.command} ${commandOutcome(f)}${where}${why}`;
  if (reasons.length) return `verification failed: ${reasons.join("; ")}${where}`;
  if (v.error) return `verification failed: ${v.error}${where}`;
  return `verification did not run${where}`;
}

// "merged onto main at 1a2b3c4d5e6f": the base the head was verified on (the clean room's merge).
export function baseText(v) {
  if (!v.base_sha) return "";
  return `merged onto ${v.base_branch || "the base branch"} at ${short(v.base_sha)}`;
}

const hostCounts = (hosts) => (hosts || []).filter((x) => x && typeof x === "object")
  .map((x) => `${x.host} (${plural(Number(x.count) || 0, "time")})`).join(", ");
const checkNames = (checks) => (checks || []).map((c) => (c && (c.name || c.app || c.kind)) || "a check").join(", ") || "(none listed)";

// A value of an event nobody wrote a line for: text, a list of words, or a count — never JSON.
function plain(v) {
  if (v === null || v === undefined || v === "") return "—";
  if (Array.isArray(v)) return v.every((x) => x === null || typeof x !== "object") ? v.join(", ") : plural(v.length, "item");
  if (typeof v === "object") return plural(Object.keys(v).length, "field");
  return String(v);
}

const LINES = {
  "node.output": (p, n) => ({ cls: `out ${p.stream || ""}`, text: `${n}${p.text || ""}` }),
  "node.message": (p, n) => ({ cls: "msg", text: `${n}model: ${p.content || p.text || ""}` }),
  "node.tool_call": (p, n) => ({ cls: "tool", text: `${n}→ ${p.name}(${p.arguments || ""})` }),
  "node.tool_result": (p, n) => ({ cls: "tool", text: `${n}← ${p.name} ${p.ok === false ? "failed" : "ok"}: ${String(p.result || "").slice(0, 400)}` }),
  "node.started": (p, n) => ({ cls: "sys", text: `${n}started (${p.kind || ""}${p.attempt > 1 ? ", attempt " + p.attempt : ""})` }),
  "node.finished": (p, n) => ({ cls: "sys", text: `${n}finished: ${p.state}${p.attempt > 1 ? " (attempt " + p.attempt + ")" : ""}${p.error ? " — " + p.error : ""}` }),
  "node.retry": (p, n) => ({ cls: "sys", text: `${n}attempt ${p.attempt || "?"} failed, retrying${p.error ? " — " + p.error : ""}` }),
  "node.prompt": (p, n) => ({ cls: "sys", text: `${n}prompt sent to ${p.model || "the model"} (${String(p.prompt || "").length} chars; see Prompts)` }),
  "node.prompt_digest": (p, n) => ({ cls: "sys", text: `${n}prompt fingerprint kept for the run record: SHA-256 ${short(p.sha256)}… of ${plural(p.bytes || 0, "byte")}` }),
  "model.usage": (p, n) => ({ cls: "sys", text: `${n}tokens: ${p.input_tokens || 0} in, ${p.output_tokens || 0} out (${p.model || ""}${typeof p.cost_usd === "number" ? ", ~" + usd(p.cost_usd) : ""})` }),
  "node.budget_exceeded": (p, n) => ({ cls: "sys", text: `${n}budget spent (${p.limit}): ${p.reason || ""}` }),
  "node.resumed": (p, n) => ({ cls: "sys", text: `${n}resumed (was ${p.was || ""})` }),
  "ticket.resumed": () => ({ cls: "sys", text: "ticket resumed after a restart" }),
  "ticket.takeover": (p) => ({ cls: "sys", text: `ticket taken over by scheduler ${p.scheduler || "?"} (its previous scheduler stopped renewing its lease; the ticket was ${String(p.state || "").replace("_", " ")})` }),
  "broker.retry": (p, n) => ({ cls: "sys", text: `${n}waiting for the ${p.broker} broker (${p.step || ""})` }),
  "broker.recovered": (p, n) => ({ cls: "sys", text: `${n}the ${p.broker} broker is back (${p.step || ""})` }),
  "workspace.ready": (p) => ({ cls: "sys", text: `workspace ready: branch ${p.branch || ""} from ${short(p.base_sha)}` }),
  "approval.stale": (p) => ({ cls: "sys", text: `approval of ${short(p.approved_sha)} is stale: the head is now ${short(p.head_sha)}; approve again` }),
  "commit.warning": (p, n) => ({ cls: "sys", text: `${n}warning: ${p.message || p.kind || ""}` }),
  "agent.plan": (p, n) => ({ cls: "tool", text: `${n}agent plan: ${(p.entries || []).filter((x) => x.status === "completed").length} of ${(p.entries || []).length} steps done` }),
  "agent.cancel": (p, n) => ({ cls: "sys", text: `${n}agent asked to stop (session/cancel)` }),
  "agent.protocol_error": (p, n) => ({ cls: "sys", text: `${n}agent protocol error: ${p.reason || ""}` }),
  "agent.message": (p, n) => ({ cls: "msg", text: `${n}agent: ${p.text || ""}` }),
  "agent.thought": (p, n) => ({ cls: "msg thought", text: `${n}agent (thinking): ${p.text || ""}` }),
  "agent.tool_call": (p, n) => ({ cls: "tool", text: `${n}agent → ${p.title || p.kind} [${p.status}]` }),
  "agent.tool_call_update": (p, n) => ({ cls: "tool", text: `${n}agent tool ${p.id}: ${p.status || "updated"}` }),
  "agent.fs": (p, n) => ({ cls: "tool", text: `${n}agent ${p.op} ${p.path}${p.ok === false ? " (refused)" : ""}` }),
  "agent.terminal": (p, n) => ({ cls: "tool", text: `${n}agent terminal ${p.op}${p.command ? ": " + p.command : ""}${p.ok === false ? " (refused)" : ""}` }),
  "agent.stderr": (p, n) => ({ cls: "out stderr", text: `${n}${p.omitted_bytes ? "… " + p.omitted_bytes + " bytes left out …\n" : ""}${p.text || ""}` }),
  "agent.permission": (p, n) => ({ cls: "tool", text: `${n}agent asked permission for ${p.title || p.kind || "a tool"}: ${p.outcome || p.decision || ""}` }),
  "ticket.created": (p) => ({ cls: "sys", text: `ticket created${p.principal ? " by " + p.principal : ""}` }),
  "ticket.state": (p) => ({ cls: "sys", text: `ticket is ${String(p.state).replace("_", " ")}` }),
  "ticket.finished": (p) => ({ cls: "sys", text: `ticket ${p.state}${p.error ? " — " + p.error : ""}` }),
  "sandbox.ready": (p) => ({ cls: "sys", text: `sandbox ready${p.image ? ": " + p.image : ""} (${p.egress && p.egress.length ? "egress " + p.egress.join(", ") : "no network"})` }),
  "sandbox.env_names": (p) => {   // names only, never values (R9, R43)
    const agents = p.agents && typeof p.agents === "object" && !Array.isArray(p.agents)
      ? Object.entries(p.agents).filter(([, v]) => Array.isArray(v)).map(([a, v]) => `${a}: ${v.join(", ")}`).join("; ") : "";
    return { cls: "sys", text: `variables entered the sandbox (names only): ${(p.names || []).join(", ")}${agents ? " (agent " + agents + ")" : ""}` };
  },
  "agent.mcp_servers": (p, n) => ({ cls: "sys", text: p.given ? `${n}MCP servers given to the agent at the relay: ${(p.servers || []).join(", ")}` : `${n}MCP servers not given to the agent (${(p.servers || []).join(", ")}): ${p.reason || ""}` }),   // names only (R43)
  "mcp.call": (p, n) => ({ cls: "tool", text: `${n}MCP ${p.server || ""}/${p.tool || ""}: ${p.outcome || ""} (${plural(p.response_bytes || 0, "byte")})${p.reason ? " — " + p.reason : ""}` }),   // names, a digest and sizes only (R43)
  "egress.denied": (p, n) => ({ cls: "sys", text: `${n}the egress proxy refused requests to ${hostCounts(p.hosts) || "(no host named)"}${p.truncated ? " and more hosts" : ""}; add a host the work needs to the Workspace's sandbox.egress` +
    (Array.isArray(p.requests) && p.requests.length ? `; egress rules refused ${p.requests.slice(0, 20).map((q) => `${q.method} ${q.host}${q.path} (${q.reason}, rule ${q.rule}, ${q.count}x)`).join(", ")}${p.requests.length > 20 || p.requests_truncated ? " and more" : ""}` : "") }),
  "commit.done": (p, n) => ({ cls: "sys", text: `${n}committed ${short(p.sha)}${p.changed === false ? " (no changes)" : ""}` }),
  "push.done": (p, n) => ({ cls: "sys", text: `${n}pushed ${p.branch || ""} at ${short(p.sha)}` }),
  "pr.opened": (p, n) => ({ cls: "sys", text: `${n}pull request #${p.number} opened (${p.head_branch} → ${p.base_branch})` }),
  "approval.requested": (p, n) => {
    const v = p.verification;
    const harness = v && (v.harness_changes || []).length ? `; it changes how tests run: ${v.harness_changes.join(", ")}` : "";
    return { cls: "sys", text: `${n}waiting for a person to approve ${short(p.sha)}${v ? " (" + verificationText(v) + harness + ")" : ""}` };
  },
  "record.signed": (p, n) => ({ cls: "sys", text: `${n}run record signed (${p.kind || "record"}) for ${short(p.sha)}, key ${p.keyid || "?"}; see Signed run record` }),
  "record.unattached": (p, n) => ({ cls: "sys", text: `${n}the run record of ${short(p.sha)} is not on the pull request (${p.message || "no reason given"}); afe verify fetches it from afe` }),
  "verification.started": (p, n) => ({ cls: "sys", text: `${n}verifying ${short(p.sha)} in a fresh sandbox (${(p.commands || []).length} command(s)${(p.base_paths || []).length ? ", " + p.base_paths.join(", ") + " from the base branch" : ""})` }),
  "verification.output": (p) => ({ cls: `out ${p.stream || ""}`, text: `[verify] ${p.text || ""}` }),
  "verification.finished": (p, n) => {
    const onto = baseText(p);
    return { cls: "sys", text: `${n}${verificationText(p)} on ${short(p.sha)}${onto ? ", " + onto : ""}` };
  },
  "verification.base": (p, n) => ({ cls: "sys", text: `${n}the base ${short(p.base_sha)} ran the same commands: ${p.tests ? testsText(p.tests) : "no test counts reported"} (a head must not run fewer)` }),
  "merge.base_moved": (p, n) => ({ cls: "sys", text: `${n}the base moved while ${short(p.sha)} was being merged (it was verified on ${short(p.verified_base_sha)}): verifying it again` }),
  "verification.base_moved": (p, n) => ({ cls: "sys", text: `${n}the base moved from ${short(p.verified_base_sha)} to ${short(p.base_sha)} since ${short(p.sha)} was verified; verified again onto it: ${p.passed ? "passed" : "failed"}` }),
  "verification.error": (p, n) => ({ cls: "sys", text: `${n}the verification of ${short(p.sha)} could not run: ${p.message || "no reason given"} (not a verdict; Retry runs it again)` }),
  "approval.granted": (p) => {
    const acc = (p.accepted_harness_change || []).length ? ` and accepted the harness change (${p.accepted_harness_change.join(", ")})` : "";
    return { cls: "sys", text: `approved${p.sha ? " " + short(p.sha) : ""} by ${p.principal}${acc}` };
  },
  "approval.rejected": (p) => ({ cls: "sys", text: `rejected by ${p.principal}${p.reason ? ": " + p.reason : ""}` }),
  "ticket.reopened": (p) => ({ cls: "sys", text: `ticket re-opened (${p.reason}) by ${p.principal}${p.nodes && p.nodes.length ? ": runs " + p.nodes.join(", ") + " again" : ""}` }),
  "node.feedback": (p, n) => ({ cls: "sys", text: `${n}failed; round ${p.round} of ${p.max}: its output goes back to ${p.to}` }),
  "node.feedback_spent": (p, n) => ({ cls: "sys", text: `${n}failed after ${p.rounds} rounds back to ${p.to}` }),
  "branch.conflict": (p) => ({ cls: "sys", text: `updating the branch conflicts in: ${(p.paths || []).join(", ")}` }),
  "github.joined": (p) => ({ cls: "sys", text: `GitHub ${p.event} by ${p.author} joined this ticket (${p.delivery})` }),
  "followup.received": (p) => ({ cls: "sys", text: `follow-up (${p.source}) by ${p.author}${p.path ? " on " + p.path + " line " + p.line : ""}: ${({ followup: "re-runs with it shortly", gathered: "gathered into the coming re-run", queued: "queued for the next re-run" })[p.taken] || p.taken}` }),
  "followup.refused": (p) => ({ cls: "sys", text: `follow-up (${p.source}) by ${p.author} refused: ${p.reason}` }),
  "followup.dropped": (p) => ({ cls: "sys", text: `${p.count} follow-up(s) dropped: ${p.reason}` }),
  "ci.failed": (p) => ({ cls: "sys", text: `CI failed on ${short(p.sha)}: ${checkNames(p.checks)}${p.via ? " (reported by " + p.via + ")" : ""}` }),
  "ci.noted": (p) => ({ cls: "sys", text: `CI failed on ${short(p.sha)}: ${checkNames(p.checks)}; no afe round: ${p.reason || ""}` }),
  "ci.rounds_exhausted": (p) => ({ cls: "sys", text: `CI still fails on ${short(p.sha)} (${checkNames(p.checks)}) after ${p.rounds} of ${p.max} rounds; a person must look` }),
  "events.lost": (p) => {
    const types = p.types && typeof p.types === "object" ? Object.entries(p.types).map(([t, c]) => `${c} ${t}`).join(", ") : "";
    return { cls: "sys", text: `${plural(p.count || 0, "event")} not stored${types ? " (" + types + ")" : ""}: ${p.reason || ""}` };
  },
  "node.attempt": (p, n) => ({ cls: "sys", text: `${n}attempt ${p.attempt || "?"} starts (attempt ${p.previous ?? "?"} was interrupted: ${p.reason || "?"}${p.previous_scheduler ? ", on scheduler " + p.previous_scheduler : ""})` }),
  "workspace.checkpoint": (p) => ({ cls: "sys", text: p.error ? `no workspace checkpoint after ${p.after}: ${p.error}` : `workspace kept after ${p.after} (${short(p.sha)})` }),
  "workspace.restored": (p) => ({ cls: "sys", text: p.restored ? `workspace back to its state after ${p.after || "the branch head"} (${short(p.sha)}) for attempt ${p.attempt}` : `workspace not restored for attempt ${p.attempt}; the attempt runs on the files as they are: ${p.error || ""}` }),
  "merge.done": (p, n) => ({ cls: "sys", text: `${n}merged ${short(p.merge_sha || p.sha)}` }),
};

// The event types with a line of their own (tests check every type the scheduler emits is one).
export const DESCRIBED = new Set(Object.keys(LINES));

export function eventLine(e) {
  const p = e.payload && typeof e.payload === "object" ? e.payload : {};
  const node = p.node ? `[${p.node}] ` : "";
  const line = LINES[e.type];
  if (line) return line(p, node);
  // An event this page does not know yet: its name and fields in words.
  const rest = Object.entries(p).filter(([k]) => k !== "node").map(([k, v]) => `${k.replace(/_/g, " ")}: ${plain(v)}`);
  return { cls: "sys", text: `${node}${String(e.type || "event")}${rest.length ? " — " + rest.join("; ") : ""}` };
}
