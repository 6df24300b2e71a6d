"""`afe ticket create|list|show|watch|cancel|followup|retry|update-branch`, `afe approve`, `afe reject`.

The CLI talks JSON-RPC to the gateway's /rpc WebSocket with the bearer token
(AFE_TOKEN, else the file <data>/ui-token). See docs/CLI.md. The client and the
exit codes are in rpc_client.py, event lines in event_lines.py, the printed
ticket in ticket_view.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from services.common import cost
from services.common.states import TicketState

from .event_lines import _describe
from .rpc_client import (
    EXIT_CANCELLED,
    EXIT_CONNECT,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_USAGE,
    EXIT_WAITING,
    CliError,
    RpcClient,
)
from .ticket_view import (
    WAITING,
    _print_prompts,
    _print_test_output,
    _print_ticket,
    _print_usage,
    _print_verification,
)

__all__ = ["EXIT_CANCELLED", "EXIT_CONNECT", "EXIT_FAILED", "EXIT_OK", "EXIT_REFUSED", "EXIT_USAGE",
           "EXIT_WAITING", "STATES", "TERMINAL", "CliError", "RpcClient", "_describe", "_print_test_output",
           "_print_ticket", "add_parser"]

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


# -- argument parsing -------------------------------------------------------

def _common(p: argparse.ArgumentParser, json_flag: bool = True) -> None:
    p.add_argument("--url", default=None, help=f"gateway URL (default: $AFE_URL or {DEFAULT_URL})")
    p.add_argument("--data", default=".afe/data",
                   help="data folder holding ui-token, used when AFE_TOKEN is unset (default: .afe/data)")
    if json_flag:
        p.add_argument("--json", action="store_true", help="print JSON for scripts")


def _parser(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str,
            **kw: Any) -> argparse.ArgumentParser:
    return sub.add_parser(name, epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
                          **kw)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    a.add_argument("--accept-harness-change", action="store_true",
                   help="the head changes how its tests run (conftest.py, test-runner configuration, a script "
                        "the verify commands call); you read those changes and approve them (recorded in the "
                        "signed run record)")
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


# A verb of `afe ticket`: its work over the connected client; returns the exit code.
Verb = Callable[[RpcClient, argparse.Namespace], Awaitable[int]]


def _run(fn: Verb) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return asyncio.run(_with_client(fn, args))
        except CliError as exc:
            print(f"afe: {exc}", file=sys.stderr)
            return exc.exit_code
    return run


async def _with_client(fn: Verb, args: argparse.Namespace) -> int:
    url = args.url or os.environ.get("AFE_URL") or DEFAULT_URL
    if not url.startswith(("http://", "https://")):
        raise CliError(f"--url must start with http:// or https://, not {url!r}", EXIT_USAGE)
    async with RpcClient(url, _token(args)) as client:
        return await fn(client, args)


def _emit_json(obj: object) -> None:
    print(json.dumps(obj, indent=None, sort_keys=True), flush=True)


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
              if e.get("type") in ("model.usage", "node.prompt", "verification.finished")]
    spent = cost.totals(events)
    if args.json:
        _emit_json({**t, "cost": spent, **({"diff": diff} if diff else {})})
        return EXIT_OK
    _print_ticket(t)
    _print_verification(events)
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

async def _follow(client: RpcClient, ticket_id: str, args: argparse.Namespace) -> int:
    t = await client.call("tickets.get", {"id": ticket_id})
    t0 = t["created_at_ms"] or int(time.time() * 1000)
    started: dict[str, int] = {}
    if not args.json:
        print(f"{t['id']}  {t['title']}  ({t['workflow']})", flush=True)
    # Ended (or waiting, with --until-waiting): the whole history, no live follow. Live, --until-waiting stops at
    # the CURRENT wait: the ticket's last event when an approval request (maybe an earlier one) finds it waiting.
    settled = t["state"] in TERMINAL or (args.until_waiting and t["state"] == WAITING)
    stop_at = 0
    async for e in client.watch(ticket_id, follow=not settled):
        if args.json:
            _emit_json(e)
        elif line := _describe(e, started, t0, args.verbose):
            print(line, flush=True)
        if args.until_waiting and not settled and not stop_at and e["type"] == "approval.requested":
            t = await client.call("tickets.get", {"id": ticket_id})
            stop_at = t["last_seq"] if t["state"] == WAITING else 0
        if stop_at and e["seq"] >= stop_at:
            break
    t = await client.call("tickets.get", {"id": ticket_id})
    if not args.json:
        print(f"{t['id']} {t['state']}" + (f": {t['error']}" if t.get("error") else ""), flush=True)
    if t["state"] == WAITING:
        return EXIT_WAITING
    return TERMINAL.get(t["state"], EXIT_FAILED)


async def _watch(client: RpcClient, args: argparse.Namespace) -> int:
    return await _follow(client, args.id, args)


async def _simple(client: RpcClient, args: argparse.Namespace, method: str, params: dict[str, Any],
                  verb: str) -> int:
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


async def _reopened(client: RpcClient, args: argparse.Namespace, t: dict[str, Any], what: str) -> int:
    if args.json:
        _emit_json(t)
    else:
        print(f"{t['id']} {what}: now {t['state']}")
    if args.watch:
        args.until_waiting, args.verbose = True, False
        return await _follow(client, t["id"], args)
    return EXIT_OK


async def _approve(client: RpcClient, args: argparse.Namespace) -> int:
    params: dict[str, object] = {"id": args.id, "sha": args.sha}
    if args.accept_harness_change:
        params["accept_harness_change"] = True
    return await _simple(client, args, "tickets.approve", params, "approved")


async def _reject(client: RpcClient, args: argparse.Namespace) -> int:
    return await _simple(client, args, "tickets.reject", {"id": args.id, "reason": args.reason}, "rejected")
