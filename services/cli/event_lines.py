"""One readable line per ticket event for `afe ticket watch` (never raw JSON)."""

from __future__ import annotations

from typing import Any

from services.common import cost
from services.common.provenance.verification import code, counts_text, detail_lines, failure_line, shown


def _fmt_secs(ms: int) -> str:
    s = max(0, ms) / 1000
    return f"{s:.1f}s" if s < 60 else f"{int(s // 60)}m{int(s % 60):02d}s"


def _describe(e: dict[str, Any], started: dict[str, int], t0: int, verbose: bool) -> str | None:
    p = e.get("payload") or {}
    node = p.get("node", "")
    at = f"[{_fmt_secs(e['at_ms'] - t0):>7}]"
    typ = e["type"]
    if typ == "node.started":
        started[node] = e["at_ms"]
        attempt = f", attempt {p['attempt']}" if (p.get("attempt") or 1) > 1 else ""
        return f"{at} {node:<16} started ({p.get('kind', '')}{attempt})"
    if typ == "node.retry":
        return (f"{at} {node:<16} attempt {p.get('attempt', '?')} failed, retrying"
                + _indented(p.get("error")))
    if typ == "node.finished":
        took = _fmt_secs(e["at_ms"] - started[node]) if node in started else ""
        state = p.get("state", "finished")
        line = f"{at} {node:<16} {state} {took}".rstrip()
        return line + _indented(p.get("error"))
    if typ == "node.tool_call":
        return f"{at} {node:<16} -> {p.get('name')} {str(p.get('arguments', ''))[:100]}"
    if typ in ("node.output", "node.tool_result"):
        if not verbose:
            return None
        text = p.get("text") if typ == "node.output" else p.get("result")
        return "\n".join(f"{'':>10} {node:<16} | {ln}" for ln in str(text or "").rstrip("\n").split("\n"))
    if typ == "node.message":
        if not verbose:
            return None
        turn = f"turn {p['turn']}, " if p.get("turn") else ""
        used = f" [{turn}{p.get('input_tokens', 0)} in / {p.get('output_tokens', 0)} out tokens]" \
            if "input_tokens" in p else ""
        return f"{at} {node:<16} model: {str(p.get('content') or p.get('text') or '')[:200]}{used}"
    if typ == "agent.tool_call":
        return f"{at} {node:<16} -> agent {p.get('title') or p.get('kind', '')} [{p.get('status', '')}]"
    if typ in ("agent.message", "agent.thought"):
        return f"{at} {node:<16} agent: {str(p.get('text') or '')[:200]}" if verbose else None
    if typ == "agent.stderr":
        if not verbose:
            return None
        gap = [f"{'':>10} {node:<16} ! ... {p['omitted_bytes']} bytes left out"] if p.get("omitted_bytes") else []
        return "\n".join(gap + [f"{'':>10} {node:<16} ! {ln}"
                                for ln in str(p.get("text") or "").rstrip("\n").split("\n")])
    if typ == "pr.opened":
        return f"{at} pull request opened {p.get('url') or p.get('number') or ''}".rstrip()
    if typ == "approval.requested":
        verified = f" ({failure_line(p['verification'])})" if isinstance(p.get("verification"), dict) else ""
        return f"{at} waiting for approval of {p.get('sha', '')}{verified}".rstrip()
    if typ in ("approval.granted", "approval.rejected"):
        word = "approved" if typ == "approval.granted" else "rejected"
        return f"{at} {word} by {p.get('principal', '?')}" + (f": {p['reason']}" if p.get("reason") else "")
    if typ == "merge.done":
        return f"{at} merged {p.get('merge_sha') or p.get('sha') or ''}".rstrip()
    if typ == "ticket.finished":
        return f"{at} ticket {p.get('state')}" + (f": {p['error']}" if p.get("error") else "")
    if typ == "verification.output" and not verbose:
        return None
    return _describe_more(typ, p, at, node)


def _indented(text: object) -> str:
    """A multi-line error kept as lines, under the event's line."""
    lines = str(text or "").rstrip().split("\n")
    return "" if not text else "\n" + "\n".join(f"{'':>10} {ln}" for ln in lines)


def _describe_more(typ: str, p: dict[str, Any], at: str, node: str) -> str | None:
    """A readable line for the events above do not cover (never raw JSON)."""
    if typ == "workspace.ready":
        return f"{at} workspace ready: branch {p.get('branch', '')} from {str(p.get('base_sha', ''))[:12]}"
    if typ == "sandbox.ready":
        net = "egress " + ", ".join(p["egress"]) if p.get("egress") else "no network"
        return f"{at} sandbox ready: {p.get('image', '')} ({net})"
    if typ == "sandbox.env_names":   # names only (R9, R43)
        agents = p.get("agents")
        agents = agents if isinstance(agents, dict) else {}
        per = "; ".join(f"{a}: {', '.join(str(n) for n in names)}" for a, names in agents.items()
                        if isinstance(names, list))
        return (f"{at} variables entered the sandbox (names): {', '.join(str(n) for n in p.get('names') or [])}"
                + (f" (agent {per})" if per else ""))
    if typ == "agent.mcp_servers":   # names only (R43)
        names = ", ".join(shown(str(n), 64) for n in p.get("servers") or [])
        if p.get("given"):
            return f"{at} {node:<16} MCP servers given to the agent at the relay: {names}"
        return f"{at} {node:<16} MCP servers not given to the agent ({names}): {shown(str(p.get('reason', '')), 300)}"
    if typ == "mcp.call":   # names, a digest and sizes only (R43, services/common/mcpcall.py)
        who = f"{node:<16} " if node else ""
        why = f" — {shown(str(p['reason']), 300)}" if p.get("reason") else ""
        return (f"{at} {who}MCP {shown(str(p.get('server', '')), 64)}/{shown(str(p.get('tool', '')), 128)}: "
                f"{shown(str(p.get('outcome', '')), 20)} ({p.get('response_bytes', 0)} bytes){why}")
    if typ == "commit.done":
        return f"{at} {node:<16} committed {str(p.get('sha', ''))[:12]}" + ("" if p.get("changed", True)
                                                                               else " (no changes)")
    if typ == "push.done":
        return f"{at} {node:<16} pushed {p.get('branch', '')} at {str(p.get('sha', ''))[:12]}"
    if typ == "model.usage":
        money = f", ~{cost.fmt_usd(p['cost_usd'])}" if isinstance(p.get("cost_usd"), (int, float)) else ""
        return (f"{at} {node:<16} tokens: {p.get('input_tokens', 0)} in, {p.get('output_tokens', 0)} out "
                f"({p.get('model', '')}{money})")
    if typ == "node.prompt":
        return f"{at} {node:<16} prompt sent to {p.get('model', '')} ({len(str(p.get('prompt') or ''))} chars)"
    if typ == "node.feedback":
        return (f"{at} {node:<16} failed; round {p.get('round', '?')} of {p.get('max', '?')}: its output goes "
                f"back to {p.get('to', '?')}")
    if typ == "node.feedback_spent":
        return f"{at} {node:<16} failed after {p.get('rounds', '?')} rounds back to {p.get('to', '?')}"
    if typ == "agent.tool_call_update":
        return f"{at} {node:<16} agent tool {p.get('id', '')}: {p.get('status') or 'updated'}"
    if typ == "agent.fs":
        return f"{at} {node:<16} agent {p.get('op', '')} {p.get('path', '')}" + (
            " (refused)" if p.get("ok") is False else "")
    if typ == "agent.terminal":
        cmd = f": {p['command']}" if p.get("command") else ""
        return f"{at} {node:<16} agent terminal {p.get('op', '')}{cmd}" + (" (refused)" if p.get("ok") is False else "")
    if typ == "agent.plan":
        entries = p.get("entries") or []
        done = sum(1 for x in entries if x.get("status") == "completed")
        return f"{at} {node:<16} agent plan: {done} of {len(entries)} steps done"
    if typ == "agent.cancel":
        return f"{at} {node:<16} agent asked to stop (session/cancel)"
    if typ == "agent.protocol_error":
        return f"{at} {node:<16} agent protocol error: {p.get('reason', '')}"
    if typ == "ticket.reopened":
        again = f": runs {', '.join(p['nodes'])} again" if p.get("nodes") else ""
        return f"{at} ticket re-opened ({p.get('reason', '')}) by {p.get('principal', '?')}{again}"
    if typ == "branch.conflict":
        return f"{at} updating the branch conflicts in: {', '.join(p.get('paths') or [])}"
    if typ == "github.joined":     # another event for the same issue and Trigger (docs/GITHUB.md)
        return f"{at} GitHub {p.get('event', '')} by {p.get('author', '')} joined this ticket ({p.get('delivery', '')})"
    if typ in ("followup.received", "followup.refused"):
        where = f" on {p['path']} line {p.get('line', 0)}" if p.get("path") else ""
        what = {"followup": "re-runs with it shortly", "gathered": "gathered into the coming re-run",
                "queued": "queued for the next re-run"}.get(p.get("taken", ""), "")
        if typ == "followup.refused":
            what = f"refused: {p.get('reason', '')}"
        return f"{at} follow-up ({p.get('source', '')}) by {p.get('author', '')}{where}: {what}"
    if typ == "followup.dropped":
        return f"{at} {p.get('count', 0)} follow-up(s) dropped: {p.get('reason', '')}"
    if typ == "agent.permission":
        what = p.get("title") or p.get("kind") or p.get("tool") or "a tool"
        return f"{at} {node:<16} agent asked permission for {what}: {p.get('outcome') or p.get('decision') or ''}".rstrip()
    if typ == "node.budget_exceeded":
        return f"{at} {node:<16} budget spent ({p.get('limit', '')}): {p.get('reason', '')}"
    if typ in ("broker.retry", "broker.recovered"):
        what = "waiting for" if typ == "broker.retry" else "back:"
        return f"{at} {node:<16} {what} the {p.get('broker', '')} broker ({p.get('step', '')})"
    if typ == "node.resumed":
        return f"{at} {node:<16} resumed (was {p.get('was', '')})"
    if typ == "ticket.resumed":
        return f"{at} ticket resumed after a restart"
    if typ == "approval.stale":
        return (f"{at} approval of {str(p.get('approved_sha', ''))[:12]} is stale: the head is now "
                f"{str(p.get('head_sha', ''))[:12]}; approve again")
    if typ == "verification.started":
        paths = f", {', '.join(p['base_paths'])} from the base branch" if p.get("base_paths") else ""
        return (f"{at} {node:<16} verifying {str(p.get('sha', ''))[:12]} in a fresh sandbox "
                f"({len(p.get('commands') or [])} command(s){paths})")
    if typ == "verification.output":
        return "\n".join(f"{'':>10} {'verify':<16} | {ln}" for ln in str(p.get("text") or "").rstrip("\n").split("\n"))
    if typ == "verification.finished":
        return "\n".join([f"{at} {node:<16} {failure_line(p)} on {str(p.get('sha', ''))[:12]}"]
                         + [f"{'':>10} {'verify':<16}   {line}" for line in detail_lines(p)])
    if typ == "verification.error":
        return (f"{at} {node:<16} verification could not run (no verdict; `afe ticket retry` runs it again): "
                f"{code(str(p.get('message') or ''), 400)}")
    if typ == "verification.base":
        return (f"{at} {node:<16} the base {str(p.get('base_sha', ''))[:12]} ran its own tests: "
                f"{counts_text(p.get('tests')) or 'no count'}")
    if typ == "merge.base_moved":
        return (f"{at} {node:<16} the base moved while {str(p.get('sha', ''))[:12]} was being merged (verified on "
                f"{str(p.get('verified_base_sha', ''))[:12]}): verifying it again")
    if typ == "verification.base_moved":
        return (f"{at} {node:<16} the base moved from {str(p.get('verified_base_sha', ''))[:12]} to "
                f"{str(p.get('base_sha', ''))[:12]} since the verification: verified again, "
                f"{'passed' if p.get('passed') else 'failed'}")
    if typ == "commit.warning":
        return f"{at} {node:<16} warning: {p.get('message') or p.get('kind', '')}"
    if typ == "egress.denied":     # the hosts the proxy refused (R11) and what egress rules refused (R44)
        hosts = ", ".join(f"{shown(str(h.get('host', '')), 253)} ({int(h.get('count', 0) or 0)})"
                          for h in p.get("hosts") or [] if isinstance(h, dict))
        lines = [f"{at} {node:<16} egress refused: {hosts or '(no host named)'}"
                 + (" and more hosts" if p.get("truncated") else "")]
        for q in [q for q in p.get("requests") or [] if isinstance(q, dict)][:50]:
            lines.append(f"{'':>10} {'egress':<16}   {shown(str(q.get('method', '')), 20)} "
                         f"{shown(str(q.get('host', '')), 253)}{shown(str(q.get('path', '')), 300)} refused "
                         f"({shown(str(q.get('reason', '')), 20)}; rule {shown(str(q.get('rule', '')), 100)}) "
                         f"x{int(q.get('count', 0) or 0)}")
        return "\n".join(lines)
    return None
