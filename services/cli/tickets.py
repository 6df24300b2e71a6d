"""`afe ticket create|list|show|watch|cancel|followup|retry|update-branch`, `afe approve`, `afe reject`.

The CLI talks JSON-RPC to the gateway's /rpc WebSocket with the bearer token
(AFE_TOKEN, else the file <data>/ui-token). See docs/CLI.md.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Self

from services.common import cost
from services.common.states import TicketState

EXIT_OK = 0             # done / the ticket succeeded
EXIT_FAILED = 1         # the ticket failed (watch), or an unexpected server error
EXIT_USAGE = 2          # bad arguments (also invalid params reported by the server)
EXIT_REFUSED = 3        # not found, or refused in this state (e.g. approve a ticket that is not waiting)
EXIT_CONNECT = 4        # cannot reach the gateway/scheduler, or the token was refused
EXIT_CANCELLED = 5      # the ticket was cancelled (watch)
EXIT_WAITING = 6        # the ticket waits for approval (watch --until-waiting)

EXIT_CODES_HELP = """exit codes:
  0  ok; for watch: the ticket succeeded
  1  the ticket failed (watch), or an unexpected server error
  2  usage error, or the server refused the arguments
  3  not found, or refused in the ticket's current state
  4  cannot connect to the gateway or the scheduler, or the token was refused
  5  the ticket was cancelled (watch)
  6  the ticket is waiting for approval (watch --until-waiting)

environment:
  AFE_URL    gateway URL (default http://127.0.0.1:8420)
  AFE_TOKEN  UI token (default: the file <data>/ui-token)
"""

DEFAULT_URL = "http://127.0.0.1:8420"
DEMO = {"workspace": "demo", "workflow": "demo-fix", "title": "Fix add() in the demo calculator",
        "body": "The test for add() fails: add(2, 3) returns -1. Make the tests pass."}
TERMINAL = {TicketState.SUCCEEDED.value: EXIT_OK, TicketState.FAILED.value: EXIT_FAILED,
            TicketState.CANCELLED.value: EXIT_CANCELLED}
STATES = [s.value for s in TicketState]
WAITING = TicketState.WAITING_APPROVAL.value

_BY_ERROR = {
    "invalid_params": EXIT_USAGE, "invalid_request": EXIT_USAGE, "method_not_found": EXIT_USAGE,
    "not_found": EXIT_REFUSED, "failed_precondition": EXIT_REFUSED, "already_exists": EXIT_REFUSED,
    "permission_denied": EXIT_REFUSED, "resource_exhausted": EXIT_REFUSED,
    "unavailable": EXIT_CONNECT, "unauthenticated": EXIT_CONNECT, "deadline_exceeded": EXIT_CONNECT,
}


class CliError(Exception):
    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class RpcClient:
    """One /rpc WebSocket with the bearer token."""

    def __init__(self, url: str, token: str) -> None:
        self.url = url.rstrip("/")
        self._token = token
        self._ids = itertools.count(1)
        self._session: Any = None
        self._ws: Any = None
        self._backlog: list[dict] = []

    def __repr__(self) -> str:
        return f"RpcClient({self.url})"

    async def __aenter__(self) -> Self:
        import aiohttp

        ws_url = ("wss" if self.url.startswith("https:") else "ws") + self.url[self.url.index(":"):] + "/rpc"
        self._session = aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar())
        try:
            self._ws = await self._session.ws_connect(
                ws_url, headers={"Authorization": f"Bearer {self._token}"}, max_msg_size=32 * 1024 * 1024,
                heartbeat=30)
        except aiohttp.WSServerHandshakeError as exc:
            await self._session.close()
            if exc.status in (401, 403):
                raise CliError("the gateway refused the token (was it rotated? set AFE_TOKEN or check "
                               "<data>/ui-token)", EXIT_CONNECT) from None
            raise CliError(f"the gateway refused the connection (HTTP {exc.status})", EXIT_CONNECT) from None
        except (aiohttp.ClientError, OSError) as exc:
            await self._session.close()
            raise CliError(f"cannot connect to the gateway at {self.url} ({exc.__class__.__name__}); "
                           "is `afe up` running? (set --url or AFE_URL)", EXIT_CONNECT) from None
        return self

    async def __aexit__(self, *exc) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._session is not None:
            await self._session.close()

    async def _next(self) -> dict:
        import aiohttp

        msg = await self._ws.receive()
        if msg.type != aiohttp.WSMsgType.TEXT:
            if msg.type == aiohttp.WSMsgType.CLOSE and msg.data == 4401:
                raise CliError("the session ended: the token was rotated", EXIT_CONNECT)
            raise CliError("the gateway closed the connection", EXIT_CONNECT)
        return json.loads(msg.data)

    async def call(self, method: str, params: dict | None = None) -> dict:
        rid = next(self._ids)
        await self._ws.send_str(json.dumps({"jsonrpc": "2.0", "id": rid, "method": method,
                                            "params": params or {}}))
        while True:
            doc = await self._next()
            if doc.get("id") == rid:
                break
            if "method" in doc:
                self._backlog.append(doc)
        if "error" in doc:
            err = doc["error"]
            name = (err.get("data") or {}).get("code", "internal_error")
            raise CliError(f"{err.get('message', 'error')} ({name})", _BY_ERROR.get(name, EXIT_FAILED))
        return doc["result"]

    async def watch(self, ticket_id: str, from_seq: int = 1, follow: bool = True) -> AsyncIterator[dict]:
        sub = (await self.call("tickets.watch", {"id": ticket_id, "from_seq": from_seq,
                                                 "follow": follow}))["subscription"]
        while True:
            doc = self._backlog.pop(0) if self._backlog else await self._next()
            params = doc.get("params") or {}
            if params.get("subscription") != sub:
                continue
            if doc.get("method") == "tickets.watch_end":
                err = params.get("error")
                if err:
                    name = (err.get("data") or {}).get("code", "internal_error")
                    raise CliError(f"{err.get('message')} ({name})", _BY_ERROR.get(name, EXIT_FAILED))
                return
            yield params["event"]


# -- argument parsing -------------------------------------------------------

def _common(p: argparse.ArgumentParser, json_flag: bool = True) -> None:
    p.add_argument("--url", default=None, help=f"gateway URL (default: $AFE_URL or {DEFAULT_URL})")
    p.add_argument("--data", default=".afe/data",
                   help="data folder holding ui-token, used when AFE_TOKEN is unset (default: .afe/data)")
    if json_flag:
        p.add_argument("--json", action="store_true", help="print JSON for scripts")


def _parser(sub, name: str, **kw) -> argparse.ArgumentParser:
    return sub.add_parser(name, epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
                          **kw)


def add_parser(sub: argparse._SubParsersAction) -> None:
    t = _parser(sub, "ticket", help="create, list, show, watch and cancel tickets",
                description="Work with tickets through the gateway's /rpc.")
    tsub = t.add_subparsers(dest="ticket_verb", metavar="ACTION", required=True)

    c = _parser(tsub, "create", help="create a ticket", description="Create a ticket (or the demo ticket).")
    c.add_argument("--workspace", default="", help="workspace (default: the workflow's own)")
    c.add_argument("--workflow", help="workflow name")
    c.add_argument("--title", help="ticket title")
    c.add_argument("--body", default="", help="ticket body (use @FILE to read a file, - for stdin)")
    c.add_argument("--input", action="append", default=[], metavar="KEY=VALUE", help="a workflow input")
    c.add_argument("--demo", action="store_true", help="create the demo ticket (workflow demo-fix, workspace demo)")
    c.add_argument("--watch", action="store_true", help="then watch it (exit code as for `watch`)")
    _common(c)
    c.set_defaults(func=_run(_create))

    ls = _parser(tsub, "list", help="list tickets", description="List tickets, newest first.")
    ls.add_argument("--state", action="append", default=[], choices=STATES, help="only this state (repeatable)")
    ls.add_argument("--workspace", default="", help="only this workspace")
    ls.add_argument("--limit", type=int, default=50, help="at most this many (1-500, default 50)")
    _common(ls)
    ls.set_defaults(func=_run(_list))

    sh = _parser(tsub, "show", help="show one ticket", description="Show a ticket, its nodes and its PR.")
    sh.add_argument("id")
    sh.add_argument("--diff", action="store_true", help="also print the workspace diff")
    sh.add_argument("--prompts", "-v", action="store_true",
                    help="also print the system prompt and prompt each model node received")
    _common(sh)
    sh.set_defaults(func=_run(_show))

    w = _parser(tsub, "watch", help="follow a ticket live; exit with its outcome",
                description="Print the ticket's progress node by node with elapsed times until it ends; "
                "the exit code is the outcome.")
    w.add_argument("id")
    w.add_argument("--until-waiting", action="store_true",
                   help="stop (exit 6) when the ticket waits for approval")
    w.add_argument("-v", "--verbose", action="store_true", help="also print command output and tool results")
    _common(w)
    w.set_defaults(func=_run(_watch))

    x = _parser(tsub, "cancel", help="cancel a ticket", description="Cancel a ticket; its sandbox is removed.")
    x.add_argument("id")
    _common(x)
    x.set_defaults(func=_run(_cancel))

    f = _parser(tsub, "followup", help="run a ticket's model/agent again with an instruction",
                description="Run the model/agent node of a ticket that waits for approval or has ended "
                "again with INSTRUCTION: new commits on the same branch and pull request, then a new approval.")
    f.add_argument("id")
    f.add_argument("instruction", help="what should change (use @FILE to read a file, - for stdin)")
    f.add_argument("--watch", action="store_true", help="then watch it (exit code as for `watch`)")
    _common(f)
    f.set_defaults(func=_run(_followup))

    rt = _parser(tsub, "retry", help="run a failed or cancelled ticket again on its branch",
                 description="Run a failed or cancelled ticket again on the same branch and pull request: the "
                 "nodes that did not succeed (or --from NODE) and every node after them; the nodes before keep "
                 "their results. A merge asks for a new approval.")
    rt.add_argument("id")
    rt.add_argument("--from", dest="from_node", default="", metavar="NODE", help="run again from this node")
    rt.add_argument("--watch", action="store_true", help="then watch it (exit code as for `watch`)")
    _common(rt)
    rt.set_defaults(func=_run(_retry))

    ub = _parser(tsub, "update-branch", help="merge the base into a conflicting ticket's branch",
                 description="For a ticket whose merge failed on a conflict: merge the base branch into the "
                 "ticket's branch on the host (conflicting files are named, nothing is pushed then) and ask "
                 "for a new approval of the new head.")
    ub.add_argument("id")
    ub.add_argument("--watch", action="store_true", help="then watch it (exit code as for `watch`)")
    _common(ub)
    ub.set_defaults(func=_run(_update_branch))

    a = _parser(sub, "approve", help="approve a merge that waits for a person",
                description="Approve the merge a ticket is waiting on (recorded as principal 'cli').")
    a.add_argument("id")
    a.add_argument("--sha", default="", help="the head SHA you reviewed; refused if the PR moved since")
    _common(a)
    a.set_defaults(func=_run(_approve))

    r = _parser(sub, "reject", help="reject a merge that waits for a person",
                description="Reject the merge a ticket is waiting on; the ticket fails.")
    r.add_argument("id")
    r.add_argument("--reason", default="", help="why (shown on the ticket)")
    _common(r)
    r.set_defaults(func=_run(_reject))


# -- running ----------------------------------------------------------------

def _token(args: argparse.Namespace) -> str:
    token = os.environ.get("AFE_TOKEN")
    if token:
        return token.strip()
    path = Path(args.data) / "ui-token"
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError:
        raise CliError(f"no token: set AFE_TOKEN or point --data at the folder holding ui-token "
                       f"({path} is not readable)", EXIT_CONNECT) from None


def _run(fn):
    def run(args: argparse.Namespace) -> int:
        try:
            return asyncio.run(_with_client(fn, args))
        except CliError as exc:
            print(f"afe: {exc}", file=sys.stderr)
            return exc.exit_code
    return run


async def _with_client(fn, args: argparse.Namespace) -> int:
    url = args.url or os.environ.get("AFE_URL") or DEFAULT_URL
    if not url.startswith(("http://", "https://")):
        raise CliError(f"--url must start with http:// or https://, not {url!r}", EXIT_USAGE)
    async with RpcClient(url, _token(args)) as client:
        return await fn(client, args)


def _emit_json(obj: object) -> None:
    print(json.dumps(obj, indent=None, sort_keys=True), flush=True)


def _fmt_secs(ms: int) -> str:
    s = max(0, ms) / 1000
    return f"{s:.1f}s" if s < 60 else f"{int(s // 60)}m{int(s % 60):02d}s"


def _node_line(n: dict, now_ms: int) -> str:
    took = ""
    if n.get("started_at_ms"):
        took = _fmt_secs((n.get("finished_at_ms") or now_ms) - n["started_at_ms"])
    line = f"  {n['id']:<16} {n['state']:<10} {n['kind']:<16} {took}"
    if n.get("error"):
        line += f"\n      {n['error']}"
    return line.rstrip()


def _print_ticket(t: dict) -> None:
    now = int(time.time() * 1000)
    print(f"{t['id']}  {t['state']}  {t['title']}")
    print(f"  workspace {t['workspace']}, workflow {t['workflow']}, last event {t['last_seq']}")
    if t.get("error"):
        print(f"  error: {t['error']}")
    print("nodes:")
    for n in t["nodes"]:
        print(_node_line(n, now))
    if t.get("pr"):
        pr = t["pr"]
        print(f"pull request #{pr['number']} ({pr['state']}) {pr['head_branch']} -> {pr['base_branch']} {pr['url']}")
    if t["state"] == WAITING:
        print(f"waiting for approval of {t.get('awaiting_sha') or '?'}: "
              f"afe approve {t['id']} --sha {t.get('awaiting_sha')}  |  afe reject {t['id']} --reason ...")
    if t.get("approval"):
        a = t["approval"]
        print(f"{'approved' if a['granted'] else 'rejected'} by {a['principal']}"
              f"{': ' + a['reason'] if a.get('reason') else ''}")
    if t.get("usage") is not None:
        print(f"usage: {t['usage'].get('tokens', 0)} model tokens")


def _spent(u: dict) -> str:
    money = cost.fmt_usd(u["cost_usd"]) + (" (some models have no price)" if u["unpriced"] and
                                           u["cost_usd"] is not None else "")
    if u["cost_usd"] is None:
        money = "cost unknown (add price: to the Model manifests)"
    return f"{u['input_tokens']} in / {u['output_tokens']} out tokens, {money}"


def _print_usage(spent: dict) -> None:
    """Tokens and the estimated cost (services/common/cost.py), per node and for the ticket."""
    if not spent["nodes"]:
        return
    print("model usage (estimated cost):")
    for node, u in sorted(spent["nodes"].items()):
        print(f"  {node or '(ticket)':<16} {_spent(u)}")
    print(f"  {'total':<16} {_spent(spent['ticket'])}")


def _print_prompts(events: list[dict]) -> None:
    prompts = [e.get("payload") or {} for e in events if e.get("type") == "node.prompt"]
    if not prompts:
        print("prompts: (no model node has started)")
    for p in prompts:
        print(f"prompt of {p.get('node', '?')} (model {p.get('model', '?')}):")
        print("  system:")
        for ln in str(p.get("system") or "").split("\n"):
            print(f"    {ln}".rstrip())
        print("  prompt:")
        for ln in str(p.get("prompt") or "").split("\n"):
            print(f"    {ln}".rstrip())
        if p.get("truncated"):
            print("    (cut short in the event)")


def _print_test_output(t: dict) -> None:
    """The output of the ticket's `run:` nodes (its tests), kept with the ticket after it ended."""
    runs = [n for n in t["nodes"] if n.get("kind") == "run" and (n.get("output") or n.get("error"))]
    for n in runs:
        print(f"test output of {n['id']} ({n['state']}):")
        for ln in ((n.get("output") or "").rstrip("\n") + ("\n" + n["error"] if n.get("error") else "")).split("\n"):
            print(f"    {ln}".rstrip())
    if not runs:
        print("test output: (none)")


def _read_body(value: str) -> str:
    if value == "-":
        return sys.stdin.read()
    if value.startswith("@"):
        try:
            return Path(value[1:]).read_text(encoding="utf-8")
        except OSError as exc:
            raise CliError(f"cannot read {value[1:]}: {exc.strerror}", EXIT_USAGE) from None
    return value


def _check_create(params: dict[str, Any]) -> None:
    """Refuse before sending what the gateway would refuse: the same model and limits
    (services/common/schema/rpc.py; title, body and inputs as services/common/schema/tickets.py)."""
    from services.common.errors import InvalidArgument
    from services.common.schema.rpc import parse_params

    try:
        parse_params("tickets.create", params)
    except InvalidArgument as exc:
        raise CliError(f"{exc.message} (invalid_params)", EXIT_USAGE) from None


async def _create(client: RpcClient, args: argparse.Namespace) -> int:
    if args.demo:
        params: dict[str, Any] = dict(DEMO)
        if args.title:
            params["title"] = args.title
    else:
        if not args.workflow or not args.title:
            raise CliError("--workflow and --title are required (or use --demo)", EXIT_USAGE)
        inputs = {}
        for item in args.input:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise CliError(f"--input takes KEY=VALUE, not {item!r}", EXIT_USAGE)
            inputs[key] = value
        params = {"workspace": args.workspace, "workflow": args.workflow, "title": args.title,
                  "body": _read_body(args.body), "inputs": inputs}
    _check_create(params)
    t = await client.call("tickets.create", params)
    if args.json:
        _emit_json(t)
    else:
        print(f"created {t['id']} ({t['state']}): {t['title']}")
        print(f"  open {client.url}/#/t/{t['id']}  or run  afe ticket watch {t['id']}")
    if args.watch:
        args.until_waiting, args.verbose = False, False
        return await _follow(client, t["id"], args)
    return EXIT_OK


async def _list(client: RpcClient, args: argparse.Namespace) -> int:
    if not 1 <= args.limit <= 500:
        raise CliError("--limit must be between 1 and 500", EXIT_USAGE)
    res = await client.call("tickets.list", {"states": args.state, "workspace": args.workspace,
                                             "page_size": args.limit})
    if args.json:
        _emit_json(res["tickets"])
        return EXIT_OK
    if not res["tickets"]:
        print("no tickets")
    for t in res["tickets"]:
        print(f"{t['id']:<24} {t['state']:<17} {t['workflow']:<16} {t['title']}")
    return EXIT_OK


async def _show(client: RpcClient, args: argparse.Namespace) -> int:
    t = await client.call("tickets.get", {"id": args.id})
    diff = (await client.call("tickets.diff", {"id": args.id})) if args.diff else None
    # Tokens and cost per node, and the prompts, come from the ticket's recorded events.
    events = [e async for e in client.watch(args.id, 1, follow=False)
              if e.get("type") in ("model.usage", "node.prompt")]
    spent = cost.totals(events)
    if args.json:
        _emit_json({**t, "cost": spent, **({"diff": diff} if diff else {})})
        return EXIT_OK
    _print_ticket(t)
    _print_usage(spent)
    if getattr(args, "prompts", False):
        _print_prompts(events)
    if diff:
        _print_test_output(t)
        print(diff["diff"] or "(no changes)")
        if diff["truncated"]:
            print("(diff truncated)")
        if diff.get("recorded"):
            print(f"(the diff stored when the ticket ended; try `afe ticket retry {t['id']}` to run it again)"
                  if t.get("state") in ("failed", "cancelled") else "(the diff stored when the ticket ended)")
    return EXIT_OK


def _describe(e: dict, started: dict[str, int], t0: int, verbose: bool) -> str | None:
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
        return f"{at} waiting for approval of {p.get('sha', '')}".rstrip()
    if typ in ("approval.granted", "approval.rejected"):
        word = "approved" if typ == "approval.granted" else "rejected"
        return f"{at} {word} by {p.get('principal', '?')}" + (f": {p['reason']}" if p.get("reason") else "")
    if typ == "merge.done":
        return f"{at} merged {p.get('merge_sha') or p.get('sha') or ''}".rstrip()
    if typ == "ticket.finished":
        return f"{at} ticket {p.get('state')}" + (f": {p['error']}" if p.get("error") else "")
    return _describe_more(typ, p, at, node)


def _indented(text: object) -> str:
    """A multi-line error kept as lines, under the event's line."""
    lines = str(text or "").rstrip().split("\n")
    return "" if not text else "\n" + "\n".join(f"{'':>10} {ln}" for ln in lines)


def _describe_more(typ: str, p: dict, at: str, node: str) -> str | None:
    """A readable line for the events above do not cover (never raw JSON)."""
    if typ == "workspace.ready":
        return f"{at} workspace ready: branch {p.get('branch', '')} from {str(p.get('base_sha', ''))[:12]}"
    if typ == "sandbox.ready":
        net = "egress " + ", ".join(p["egress"]) if p.get("egress") else "no network"
        return f"{at} sandbox ready: {p.get('image', '')} ({net})"
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
    if typ == "commit.warning":
        return f"{at} {node:<16} warning: {p.get('message') or p.get('kind', '')}"
    return None


async def _follow(client: RpcClient, ticket_id: str, args: argparse.Namespace) -> int:
    t = await client.call("tickets.get", {"id": ticket_id})
    t0 = t["created_at_ms"] or int(time.time() * 1000)
    started: dict[str, int] = {}
    if not args.json:
        print(f"{t['id']}  {t['title']}  ({t['workflow']})", flush=True)
    # A ticket that has already ended (or already waits, with --until-waiting)
    # gets its history printed and no live follow.
    settled = t["state"] in TERMINAL or (args.until_waiting and t["state"] == WAITING)
    async for e in client.watch(ticket_id, follow=not settled):
        if args.json:
            _emit_json(e)
        else:
            line = _describe(e, started, t0, args.verbose)
            if line:
                print(line, flush=True)
        if args.until_waiting and e["type"] == "approval.requested":
            t = await client.call("tickets.get", {"id": ticket_id})
            if t["state"] == WAITING:
                break
    t = await client.call("tickets.get", {"id": ticket_id})
    if not args.json:
        print(f"{t['id']} {t['state']}" + (f": {t['error']}" if t.get("error") else ""), flush=True)
    if t["state"] == WAITING:
        return EXIT_WAITING
    return TERMINAL.get(t["state"], EXIT_FAILED)


async def _watch(client: RpcClient, args: argparse.Namespace) -> int:
    return await _follow(client, args.id, args)


async def _simple(client: RpcClient, args: argparse.Namespace, method: str, params: dict, verb: str) -> int:
    t = await client.call(method, params)
    if args.json:
        _emit_json(t)
    else:
        print(f"{verb} {t['id']}: now {t['state']}")
    return EXIT_OK


async def _cancel(client: RpcClient, args: argparse.Namespace) -> int:
    """A finished ticket cannot be cancelled: exit 3 (refused in its state), as documented."""
    before = await client.call("tickets.get", {"id": args.id})
    if before["state"] in TERMINAL:
        raise CliError(f"ticket {before['id']} already finished ({before['state']}); nothing to cancel",
                       EXIT_REFUSED)
    return await _simple(client, args, "tickets.cancel", {"id": args.id}, "cancelled")


async def _followup(client: RpcClient, args: argparse.Namespace) -> int:
    text = _read_body(args.instruction)
    if not text.strip():
        raise CliError("the instruction is empty; say what should change", EXIT_USAGE)
    t = await client.call("tickets.followup", {"id": args.id, "instruction": text})
    if args.json:
        _emit_json(t)
    else:
        print(f"follow-up for {t['id']}: now {t['state']}")
    if args.watch:
        args.until_waiting, args.verbose = True, False
        return await _follow(client, t["id"], args)
    return EXIT_OK


async def _retry(client: RpcClient, args: argparse.Namespace) -> int:
    t = await client.call("tickets.retry", {"id": args.id, "from_node": args.from_node})
    return await _reopened(client, args, t, "retried")


async def _update_branch(client: RpcClient, args: argparse.Namespace) -> int:
    t = await client.call("tickets.updateBranch", {"id": args.id})
    return await _reopened(client, args, t, "branch updated")


async def _reopened(client: RpcClient, args: argparse.Namespace, t: dict, what: str) -> int:
    if args.json:
        _emit_json(t)
    else:
        print(f"{t['id']} {what}: now {t['state']}")
    if args.watch:
        args.until_waiting, args.verbose = True, False
        return await _follow(client, t["id"], args)
    return EXIT_OK


async def _approve(client: RpcClient, args: argparse.Namespace) -> int:
    return await _simple(client, args, "tickets.approve", {"id": args.id, "sha": args.sha}, "approved")


async def _reject(client: RpcClient, args: argparse.Namespace) -> int:
    return await _simple(client, args, "tickets.reject", {"id": args.id, "reason": args.reason}, "rejected")
