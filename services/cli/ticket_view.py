"""How `afe ticket show` prints a ticket: its nodes, PR, approval, model usage, prompts and test output."""

from __future__ import annotations

import time
from typing import Any

from services.common import cost
from services.common.provenance.verification import code, counts_text, detail_lines, failure_line
from services.common.states import TicketState

from .event_lines import _fmt_secs

WAITING = TicketState.WAITING_APPROVAL.value


def _node_line(n: dict[str, Any], now_ms: int) -> str:
    took = ""
    if n.get("started_at_ms"):
        took = _fmt_secs((n.get("finished_at_ms") or now_ms) - n["started_at_ms"])
    line = f"  {n['id']:<16} {n['state']:<10} {n['kind']:<16} {took}"
    if n.get("error"):
        line += f"\n      {n['error']}"
    return line.rstrip()


def _print_ticket(t: dict[str, Any]) -> None:
    now = int(time.time() * 1000)
    print(f"{t['id']}  {t['state']}  {t['title']}")
    runtime = f", sandbox runtime {t['sandbox_runtime']}" if t.get("sandbox_runtime") else ""
    print(f"  workspace {t['workspace']}, workflow {t['workflow']}{runtime}, last event {t['last_seq']}")
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


def _spent(u: dict[str, Any]) -> str:
    money = cost.fmt_usd(u["cost_usd"]) + (" (some models have no price)" if u["unpriced"] and
                                           u["cost_usd"] is not None else "")
    if u["cost_usd"] is None:
        money = "cost unknown (add price: to the Model manifests)"
    return f"{u['input_tokens']} in / {u['output_tokens']} out tokens, {money}"


def _print_usage(spent: dict[str, Any]) -> None:
    """Tokens and the estimated cost (services/common/cost.py), per node and for the ticket."""
    if not spent["nodes"]:
        return
    print("model usage (estimated cost):")
    for node, u in sorted(spent["nodes"].items()):
        print(f"  {node or '(ticket)':<16} {_spent(u)}")
    print(f"  {'total':<16} {_spent(spent['ticket'])}")


def _print_prompts(events: list[dict[str, Any]]) -> None:
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


def _print_test_output(t: dict[str, Any]) -> None:
    """The output of the ticket's `run:` nodes (its tests), kept with the ticket after it ended."""
    runs = [n for n in t["nodes"] if n.get("kind") == "run" and (n.get("output") or n.get("error"))]
    for n in runs:
        print(f"test output of {n['id']} ({n['state']}):")
        for ln in ((n.get("output") or "").rstrip("\n") + ("\n" + n["error"] if n.get("error") else "")).split("\n"):
            print(f"    {ln}".rstrip())
    if not runs:
        print("test output: (none)")


def _print_verification(events: list[dict[str, Any]]) -> None:
    """The clean-room verification (R41) of each head, newest last (from the ticket's events)."""
    for e in events:
        if e.get("type") != "verification.finished":
            continue
        p = e.get("payload") or {}
        print(f"{failure_line(p)} on {str(p.get('sha', ''))[:12]}")
        for c in p.get("commands") or []:
            how = "timed out" if c.get("timed_out") else f"exit {c.get('exit_code')}"
            tests = counts_text(c.get("counts"))
            print(f"    {code(str(c.get('command') or ''))}: {how}{', ' + tests if tests else ''} "
                  f"({_fmt_secs(int(c.get('duration_ms') or 0))})")
        for line in detail_lines(p):
            if not line.startswith("`"):          # the commands are listed above
                print(f"    {line}")

