"""`afe keys` and `afe verify`: the signed run records (R42, docs/GUIDE.md
"The run record"). The checking is services/common/provenance/attestation.py's.

    afe keys                      the credential broker's public key (PEM) and keyid
    afe verify FILE               an envelope JSON file, or a saved PR comment holding one
    afe verify TICKET             the ticket's records, fetched from afe
    afe verify PR-URL | NUMBER    the records of the ticket whose pull request it is

The key is afe's (asked through the gateway) unless `--key FILE` names a
PEM public key; a file needs no running afe with `--key` and `--sha`.
Without `--sha` the records are checked against the pull request's head as
the forge has it now (GetRunRecords asks it), so a head pushed after the
record (by a person) is reported, not passed. The exit code separates "not
genuine" (1) from "genuine, but the verification it records failed" (7) and
"genuine, but of an older head" (8); everything printed from a record goes
through `attestation.shown` (escaped).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.layout import TICKET_ID_RE
from services.common.provenance import attestation

from .rpc_client import EXIT_FAILED, EXIT_OK, EXIT_USAGE, CliError, RpcClient
from .tickets import _common, _parser, _token

DEFAULT_URL = "http://127.0.0.1:8420"
EXIT_VERIFICATION_FAILED = 7   # the record is genuine, but the verification it records failed (R41)
EXIT_OLDER_HEAD = 8            # the record is genuine, but of an older head than the pull request's current one
VERIFY_EXIT_CODES = """exit codes:
  0  every record is genuine (afe's key), of the pull request's current head, and the
     verification it records passed (or the workflow declares none)
  1  a record is not genuine (bad signature, another key, wrong subject, not a Statement,
     malformed envelope), there is no record, or an unexpected server error
  2  usage error
  3  afe knows no such ticket or pull request
  4  cannot connect to the gateway, or the token was refused
  7  the record is genuine, but the verification it records FAILED: do not merge this head
  8  the record is genuine, but of an older head: the pull request's head is now another
     commit (pushed since; by a person, or by a run not yet at its approval)

environment:
  AFE_URL    gateway URL (default http://127.0.0.1:8420)
  AFE_TOKEN  UI token (default: the file <data>/ui-token)
"""
_GITHUB_PR = re.compile(r"^https?://[^/]+/([^/]+/[^/]+)/pull/(\d+)")
# the local forge's pull request: local:WS/pulls/N, or its page in afe's UI (http(s)://afe/pulls/WS/N)
_LOCAL_PR = re.compile(r"^(?:local:|https?://[^/]+/pulls/)([A-Za-z0-9._-]+)/(?:pulls/)?(\d+)/?$")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    k = _parser(sub, "keys", help="print the public key afe signs run records with",
                description="Print the credential broker's Ed25519 public key (PEM) and its keyid "
                            "(hex SHA-256 of the raw public key).")
    _common(k)
    k.set_defaults(func=_run(_keys))

    v = sub.add_parser("verify", help="verify a signed run record", epilog=VERIFY_EXIT_CODES,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Verify the DSSE signature, the in-toto Statement and the subject commit of "
                                   "afe's run record(s); for a ticket or pull request, against the pull "
                                   "request's current head on the forge.")
    v.add_argument("target", help="an envelope JSON file or a saved PR comment, a ticket id, a PR URL "
                                  "(GitHub or local:WS/pulls/N) or a PR number (with --workspace)")
    v.add_argument("--key", help="a PEM public key file (default: afe's, from `afe keys`)")
    v.add_argument("--sha", help="the commit the record must be of (default: the head afe knows)")
    v.add_argument("--workspace", default="", help="the workspace of a PR given by number")
    _common(v)
    v.set_defaults(func=_run(_verify))


def _run(fn: Callable[[argparse.Namespace], Coroutine[Any, Any, int]]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return asyncio.run(fn(args))
        except CliError as exc:
            print(f"afe: {exc}", file=sys.stderr)
            return exc.exit_code
    return run


class _Afe:
    """The gateway, connected when first needed."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.client: RpcClient | None = None

    async def call(self, method: str, params: dict[str, Any]) -> Any:
        if self.client is None:
            url = self.args.url or os.environ.get("AFE_URL") or DEFAULT_URL
            if not url.startswith(("http://", "https://")):
                raise CliError(f"--url must start with http:// or https://, not {url!r}", EXIT_USAGE)
            self.client = RpcClient(url, _token(self.args))
            await self.client.__aenter__()
        return await self.client.call(method, params)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.__aexit__(None, None, None)


async def _keys(args: argparse.Namespace) -> int:
    afe = _Afe(args)
    try:
        k = await afe.call("keys.get", {})
    finally:
        await afe.close()
    if args.json:
        print(json.dumps(k, sort_keys=True))
    else:
        print(k["public_key_pem"].rstrip())
        print(f"keyid: {k['keyid']}")
    return EXIT_OK


async def _verify(args: argparse.Namespace) -> int:
    afe = _Afe(args)
    try:
        return await _verify_with(afe, args)
    finally:
        await afe.close()


async def _verify_with(afe: Any, args: argparse.Namespace) -> int:
    """Check the target's record(s); the exit code says what a script needs to know (docs/CLI.md):
    0 genuine, of the pull request's current head, verification passed (or none declared);
    1 not genuine or malformed; 7 genuine but the verification it records failed;
    8 genuine but of an older head than the pull request's current one."""
    _check_target(args.target)
    if args.key:
        try:
            key = attestation.public_key(Path(args.key).read_bytes())  # noqa: ASYNC240 - a CLI, one small file
        except OSError as exc:
            raise CliError(f"--key {args.key}: {exc.strerror}", EXIT_USAGE) from None
        except attestation.NotVerified as exc:
            raise CliError(f"--key {args.key}: {exc.message}", EXIT_USAGE) from None
    else:
        key = attestation.public_key((await afe.call("keys.get", {}))["public_key_pem"])
    found = await _envelopes(afe, args)
    for note in found.notes:
        print(f"afe verify: note: {note}", file=sys.stderr)
    results = []
    for env in found.envelopes:
        try:
            results.append(attestation.verify(env, key, found.expect or None))
        except attestation.NotVerified as exc:
            return _not_verified(args, exc.message)
    stale = sorted({v.sha for v in results if found.current and v.sha != found.current})
    failed = [v for v in results if attestation.verification_failed(v)]
    for v in results:
        if args.json:
            print(json.dumps(_as_json(v, found.current), sort_keys=True, ensure_ascii=True))
        else:
            print("\n".join(attestation.summary(v)))
    if stale:
        print(f"afe verify: OLDER HEAD: the record{'s are' if len(results) > 1 else ' is'} of "
              f"{', '.join(stale)}, but the pull request's head is now {attestation.shown(found.current)}"
              f"{' (as the forge has it)' if found.from_forge else ''}; "
              + ("that head has a record of its own: check it without --sha" if found.current_recorded else
                 "that head has no signed record: it was pushed after this record was signed (by a person, "
                 "or by a run that has not asked for approval yet), and this record says nothing about it"),
              file=sys.stderr)
        return EXIT_OLDER_HEAD
    if failed:
        reasons = [r for v in failed for r in (_verification(v).get("reasons") or [])][:5]
        why = f" ({', '.join(attestation.shown(r) for r in reasons)})" if reasons else ""
        print(f"afe verify: the record is genuine, but the verification it records FAILED{why}: this head "
              "must not be merged (R41)", file=sys.stderr)
        return EXIT_VERIFICATION_FAILED
    return EXIT_OK


def _not_verified(args: argparse.Namespace, message: str) -> int:
    if args.json:
        print(json.dumps({"verified": False, "error": message}, sort_keys=True, ensure_ascii=True))
    print(f"afe verify: FAILED: {message}", file=sys.stderr)
    return EXIT_FAILED


def _predicate(v: attestation.Verified) -> dict[str, Any]:
    p = v.statement.get("predicate")     # a verified Statement's predicate is an object or absent
    return p if isinstance(p, dict) else {}


def _verification(v: attestation.Verified) -> dict[str, Any]:
    ver = _predicate(v).get("verification")
    return ver if isinstance(ver, dict) else {}


def _as_json(v: attestation.Verified, current: str) -> dict[str, Any]:
    """One line of `--json` per record: what it verified and what the record says (its values
    are JSON, escaped by the encoder: ASCII only)."""
    p = _predicate(v)
    ver, decision, run = p.get("verification"), p.get("decision"), p.get("afe_run")
    return {"verified": True, "sha": v.sha, "keyid": v.keyid, "kind": v.kind,
            "pushed_by": attestation.pushed_by(v), "afe_head": run.get("head", "") if isinstance(run, dict) else "",
            "verification": ver if isinstance(ver, dict) else None,
            "verification_passed": ver.get("passed") is True if isinstance(ver, dict) else None,
            "decision": decision if isinstance(decision, dict) else None,
            "current_head": current, "is_current_head": (v.sha == current) if current else None}


def _check_target(target: str) -> None:
    """A target that is none of the forms `afe verify` takes is refused before afe is asked."""
    if Path(target).is_file() or _LOCAL_PR.match(target) or _GITHUB_PR.match(target) or target.isdigit() \
            or TICKET_ID_RE.match(target):
        return
    raise CliError(f"{target!r} is not a file, a ticket id, a pull request URL, local:WORKSPACE/pulls/N or a "
                   "PR number (with --workspace)", EXIT_USAGE)


@dataclass
class _Found:
    """What `afe verify` checks: the envelopes, the commit they must be of ("" = any), the pull
    request's current head to compare with ("" = unknown) and notes for the reader."""

    envelopes: list[dict[str, Any]]
    expect: str = ""
    current: str = ""
    from_forge: bool = False
    current_recorded: bool = False       # afe holds a record of the current head
    notes: list[str] = field(default_factory=list)


async def _envelopes(afe: Any, args: argparse.Namespace) -> _Found:
    target = args.target
    path = Path(target)
    if path.is_file():  # noqa: ASYNC240 - a CLI, one small file
        try:
            env = attestation.extract_envelope(path.read_text(encoding="utf-8"))  # noqa: ASYNC240
        except attestation.NotVerified as exc:
            raise CliError(f"{target}: {exc.message}", EXIT_FAILED) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise CliError(f"{target}: cannot read it ({exc})", EXIT_USAGE) from None
        problem = attestation.envelope_problem(env)
        if problem:
            raise CliError(f"FAILED: {target}: malformed envelope: {problem}", EXIT_FAILED)
        if args.sha:
            return _Found([env], expect=args.sha.lower())
        r = await afe.call("tickets.records", {"id": _ticket_of_file(env)})
        found = _Found([env])
        _current(found, r)
        found.current_recorded = any(isinstance(x, dict) and x.get("sha") == found.current
                                     for x in r.get("records") or [])
        if not found.current:
            raise CliError("afe knows no pull request head of the record's ticket; give --sha COMMIT", EXIT_USAGE)
        return found
    ticket = await _ticket_of(afe, target, args.workspace)
    r = await afe.call("tickets.records", {"id": ticket})
    found = _Found([])
    _current(found, r)
    records = [x for x in r.get("records") or [] if isinstance(x, dict)]
    found.current_recorded = bool(found.current) and any(x.get("sha") == found.current for x in records)
    if args.sha:
        found.expect = args.sha.lower()
    elif found.current:
        found.expect = found.current
        if not found.current_recorded and records:
            found.expect = ""                        # the latest record's head, an older one
            latest = str(records[-1].get("sha", ""))
            records = [x for x in records if x.get("sha") == latest]
    chosen = [x for x in records if not found.expect or x.get("sha") == found.expect]
    if not chosen:
        raise CliError(f"ticket {ticket} has no signed run record" + (
            f" of {attestation.shown(found.expect)}" if found.expect else "")
            + " (a record is signed when its approval is asked)", EXIT_FAILED)
    for x in chosen:
        stored: Any = None
        with contextlib.suppress(ValueError, RecursionError):
            stored = json.loads(str(x.get("envelope", "")))
        if not isinstance(stored, dict):
            raise CliError(f"FAILED: afe's stored record of {attestation.shown(x.get('sha', ''))} is not a JSON "
                           "envelope", EXIT_FAILED)
        found.envelopes.append(stored)
    return found


def _current(found: _Found, r: dict[str, Any]) -> None:
    """The pull request's current head: the forge's when it answered, else the one afe knows."""
    forge, known = str(r.get("forge_head_sha") or "").lower(), str(r.get("head_sha") or "").lower()
    found.current, found.from_forge = (forge, True) if forge else (known, False)
    if r.get("forge_error"):
        found.notes.append(f"the forge was not asked for the pull request's current head "
                           f"({attestation.shown(str(r['forge_error'])[:300])}); checked against the head afe "
                           f"knows{', ' + attestation.shown(found.current) if found.current else ''}")
    elif "forge_head_sha" not in r and known:
        found.notes.append("this afe does not say the forge's current head; checked against the head afe knows")


async def _ticket_of(afe: Any, target: str, workspace: str) -> str:
    m = _LOCAL_PR.match(target)
    if m:
        return str((await afe.call("pulls.get", {"workspace": m.group(1), "number": m.group(2)}))["id"])
    m = _GITHUB_PR.match(target)
    if m or target.isdigit():
        number = m.group(2) if m else target
        if not workspace and m:
            repo = m.group(1).lower()
            spaces = (await afe.call("workspaces.list", {}))["workspaces"]
            found = [w["name"] for w in spaces if str(w.get("forge_repo", "")).lower() == repo]
            if not found:    # an older afe: no forge_repo; its clone URL may still name owner/name
                found = [w["name"] for w in spaces if repo in str(w.get("repo", "")).lower()]
            workspace = found[0] if len(found) == 1 else ""
        if not workspace:
            raise CliError("give --workspace NAME: the pull request's workspace is not known", EXIT_USAGE)
        return str((await afe.call("pulls.get", {"workspace": workspace, "number": number}))["id"])
    return target


def _ticket_of_file(env: dict[str, Any]) -> str:
    """The ticket a record file names (trusted only once its signature checks; until then it
    only says which ticket's head to ask afe for, and must be a ticket id afe makes)."""
    try:
        ticket = attestation.unverified_statement(env)["predicate"]["ticket"]["id"]
    except (KeyError, TypeError):
        ticket = None
    if not isinstance(ticket, str) or not TICKET_ID_RE.fullmatch(ticket):
        raise CliError("not afe's run record: no ticket id afe makes in it; give --sha COMMIT to check it",
                       EXIT_FAILED)
    return ticket
