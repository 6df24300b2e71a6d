"""Rewrite calls of the old 60-method `Store` into calls of its repositories
(issue 32: services/scheduler/store/store.py), mechanically:

    store.get_ticket(...)        -> store.tickets.get(...)
    self.store.append_events(..) -> self.store.events.append(..)
    store.get_pr(...)            -> store.prs.get_pr(...)
    store.fences                 -> store.leases.fences
    from ..store.base import Store, TicketRecord
                                 -> from ..store.base import TicketRecord
                                    from ..store.store import Store

A call is rewritten when its receiver is a store: a name or attribute chain
ending in `store` (`store`, `self.store`, `h.store`, `self._store`, ...), the
parameter of a `lambda s:` / `lambda st:` / `def fn(s: Store` / `def fn(st: Store`
whose body calls a store method (the jobs run on the store's thread), or one
of the names given with --receiver. One pass per file, so a rewritten call is
never rewritten again. Prints each file it changed; --check changes nothing
and exits 1 when a file would change.

usage: python scripts/store_repositories_rewrite.py [--check] [--receiver NAME ...] PATH ...
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

# old method -> (repository, its method)
METHODS: dict[str, tuple[str, str]] = {
    # tickets and node runs (store/tickets.py)
    "create_ticket": ("tickets", "create"), "get_ticket": ("tickets", "get"), "list_tickets": ("tickets", "list"),
    "update_ticket": ("tickets", "update"), "tickets_in_states": ("tickets", "in_states"),
    "terminal_not_torn_down": ("tickets", "terminal_not_torn_down"), "count_by_state": ("tickets", "count_by_state"),
    "node_runs": ("tickets", "node_runs"), "update_node": ("tickets", "update_node"),
    # events (store/events.py)
    "append_events": ("events", "append"), "events": ("events", "read"), "last_seq": ("events", "last_seq"),
    "report_lost": ("events", "report_lost"), "take_lost_reports": ("events", "take_lost_reports"),
    # leases and fences (store/leases.py)
    "claim_ticket": ("leases", "claim"), "expired_tickets": ("leases", "expired"), "renew_leases": ("leases", "renew"),
    "holds": ("leases", "holds"), "release_ticket": ("leases", "release"),
    "request_cancel": ("leases", "request_cancel"),
    # the record repositories (store/repos/), their methods keep their names
    **{m: ("approvals", m) for m in ("add_approval", "latest_approval")},
    **{m: ("prs", m) for m in ("put_pr", "get_pr", "ticket_for_pr", "ticket_for_head")},
    **{m: ("diffs", m) for m in ("put_final_diff", "final_diff")},
    **{m: ("reports", m) for m in ("report", "put_report")},
    **{m: ("intake", m) for m in ("claim_once", "release_once", "poll_cursor", "put_poll_cursor", "claim_work",
                                  "set_work_ticket", "release_work")},
    **{m: ("followups", m) for m in ("add_followup", "followups", "pending_followups", "give_followups",
                                     "drop_followups", "drop_ci_followups", "tickets_with_pending_followups")},
    **{m: ("ci", m) for m in ("claim_ci_failure", "put_ci_failure", "ci_failure", "ci_failures", "ci_gathering",
                              "ci_watch")},
    **{m: ("verifications", m) for m in ("put_verification", "verification_with", "verification",
                                         "verifications")},
    **{m: ("run_records", m) for m in ("put_run_record", "run_record", "run_records")},
    **{m: ("placements", m) for m in ("place_sandbox", "sandbox_placement", "unplace_sandbox")},
}
ATTRIBUTES = {"fences": ("leases", "fences")}

_CHAIN = r"(?:[A-Za-z_][A-Za-z0-9_]*\.)*[A-Za-z_][A-Za-z0-9_]*"
_METHODS = "|".join(sorted(METHODS, key=len, reverse=True))
_ATTRS = "|".join(ATTRIBUTES)
_JOB_PARAM = re.compile(r"(?:lambda\s+(\w+)\s*(?:,[^:]*)?:|def\s+\w+\(\s*(\w+)\s*:\s*(?:\"?\w*\.)?\"?Store\b)")


def _is_store(receiver: str, extra: set[str]) -> bool:
    last = receiver.rsplit(".", 1)[-1]
    return last.endswith("store") or last in extra or receiver in extra


def rewrite_text(text: str, extra: frozenset[str] = frozenset()) -> str:
    params = {m.group(1) or m.group(2) for m in _JOB_PARAM.finditer(text)}
    params = {p for p in params if p in ("s", "st", "store_", "db_store")}
    receivers = set(extra) | params

    def call(m: re.Match[str]) -> str:
        receiver, name = m.group(1), m.group(2)
        if not _is_store(receiver, receivers):
            return m.group(0)
        repo, method = METHODS[name]
        return f"{receiver}.{repo}.{method}("

    def attr(m: re.Match[str]) -> str:
        receiver, name = m.group(1), m.group(2)
        if not _is_store(receiver, receivers):
            return m.group(0)
        repo, a = ATTRIBUTES[name]
        return f"{receiver}.{repo}.{a}"

    text = re.sub(rf"(?<![\w.])({_CHAIN})\.({_METHODS})\(", call, text)
    text = re.sub(rf"(?<![\w.])({_CHAIN})\.({_ATTRS})\b(?!\s*\()", attr, text)
    return _one_import(_constructors(_store_import(text)))


# the old back ends' classes -> the store's constructors
_OLD_CLASSES = {"SqliteStore": "Store.sqlite", "PostgresStore": "Store.postgresql"}


def _constructors(text: str) -> str:
    for old, new in _OLD_CLASSES.items():
        text = re.sub(rf"(?m)^(\s*)from ((?:\.+|services\.)[\w.]*?store)\.(?:sqlite|postgres) import {old}\s*$",
                      r"\1from \2.store import Store", text)
        text = re.sub(rf"(?<![\w.]){old}\(", f"{new}(", text)
        text = re.sub(rf"(?<![\w.]){old}\b", "Store", text)      # as a type
    return text


def _one_import(text: str) -> str:
    """One `from ....store.store import Store` line per file (the first one, at its place)."""
    seen: set[str] = set()
    out = []
    for line in text.splitlines(keepends=True):
        m = re.match(r"\s*from ([\w.]*store\.store) import Store\s*$", line)
        if m:
            if m.group(1) in seen:
                continue
            seen.add(m.group(1))
        out.append(line)
    return "".join(out)


def _store_import(text: str) -> str:
    """`Store` from the records module (store/base.py) -> from store/store.py."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    lines = text.splitlines(keepends=True)
    edits: list[tuple[int, int, str]] = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ImportFrom) and node.module and node.module.endswith("store.base")):
            continue
        names = [a for a in node.names if a.name == "Store"]
        if not names:
            continue
        rest = [a for a in node.names if a.name != "Store"]
        module = "." * node.level + node.module
        new_module = module[: -len("base")] + "store"
        indent = re.match(r"\s*", lines[node.lineno - 1]).group(0)  # type: ignore[union-attr]
        out = ""
        if rest:
            parts = [a.name + (f" as {a.asname}" if a.asname else "") for a in rest]
            one = f"{indent}from {module} import {', '.join(parts)}\n"
            if len(one) <= 110:
                out += one
            else:
                out += f"{indent}from {module} import (\n" + "".join(f"{indent}    {p},\n" for p in parts) + f"{indent})\n"
        alias = names[0].asname
        out += f"{indent}from {new_module} import Store" + (f" as {alias}" if alias else "") + "\n"
        edits.append((node.lineno - 1, node.end_lineno or node.lineno, out))
    for start, end, new in sorted(edits, reverse=True):
        lines[start:end] = [new]
    return "".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--receiver", action="append", default=[])
    ap.add_argument("paths", nargs="+", type=Path)
    args = ap.parse_args(argv)
    changed = 0
    files = [p for path in args.paths for p in ([path] if path.is_file() else sorted(path.rglob("*.py")))]
    for f in files:
        old = f.read_text()
        new = rewrite_text(old, frozenset(args.receiver))
        if new != old:
            changed += 1
            print(f)
            if not args.check:
                f.write_text(new)
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
