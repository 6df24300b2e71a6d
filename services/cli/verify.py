"""`afe keys` and `afe verify`: the signed run records (R42, docs/GUIDE.md
"The run record"). The checking is services/common/attestation.py's.

    afe keys                      the credential broker's public key (PEM) and keyid
    afe verify FILE               an envelope JSON file, or a saved PR comment holding one
    afe verify TICKET             the ticket's records, fetched from afe
    afe verify PR-URL | NUMBER    the records of the ticket whose pull request it is

The key is afe's (asked through the gateway) unless `--key FILE` names a
PEM public key; a file needs no running afe with `--key` and `--sha`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from services.common import attestation
from services.common.layout import TICKET_ID_RE

from .rpc_client import EXIT_FAILED, EXIT_OK, EXIT_USAGE, CliError, RpcClient
from .tickets import _common, _parser, _token

DEFAULT_URL = "http://127.0.0.1:8420"
_GITHUB_PR = re.compile(r"^https?://[^/]+/([^/]+/[^/]+)/pull/(\d+)")
# the local forge's pull request: local:WS/pulls/N, or its page in afe's UI (http(s)://afe/pulls/WS/N)
_LOCAL_PR = re.compile(r"^(?:local:|https?://[^/]+/pulls/)([A-Za-z0-9._-]+)/(?:pulls/)?(\d+)/?$")


def add_parser(sub: argparse._SubParsersAction) -> None:
    k = _parser(sub, "keys", help="print the public key afe signs run records with",
                description="Print the credential broker's Ed25519 public key (PEM) and its keyid "
                            "(hex SHA-256 of the raw public key).")
    _common(k)
    k.set_defaults(func=_run(_keys))

    v = _parser(sub, "verify", help="verify a signed run record",
                description="Verify the DSSE signature, the in-toto Statement and the subject commit of "
                            "afe's run record(s).")
    v.add_argument("target", help="an envelope JSON file or a saved PR comment, a ticket id, a PR URL "
                                  "(GitHub or local:WS/pulls/N) or a PR number (with --workspace)")
    v.add_argument("--key", help="a PEM public key file (default: afe's, from `afe keys`)")
    v.add_argument("--sha", help="the commit the record must be of (default: the head afe knows)")
    v.add_argument("--workspace", default="", help="the workspace of a PR given by number")
    _common(v)
    v.set_defaults(func=_run(_verify))


def _run(fn):
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


async def _verify_with(afe: _Afe, args: argparse.Namespace) -> int:
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
    envelopes, head = await _envelopes(afe, args)
    if not (args.sha or head):
        head = await _head_of_file(afe, envelopes[0])
    sha = args.sha or head
    results = []
    for env in envelopes:
        try:
            results.append(attestation.verify(env, key, sha))
        except attestation.NotVerified as exc:
            print(f"afe verify: FAILED: {exc.message}", file=sys.stderr)
            return EXIT_FAILED
    for v in results:
        if args.json:
            print(json.dumps({"verified": True, "sha": v.sha, "keyid": v.keyid, "kind": v.kind}, sort_keys=True))
        else:
            print("\n".join(attestation.summary(v)))
    return EXIT_OK


def _check_target(target: str) -> None:
    """A target that is none of the forms `afe verify` takes is refused before afe is asked."""
    if Path(target).is_file() or _LOCAL_PR.match(target) or _GITHUB_PR.match(target) or target.isdigit() \
            or TICKET_ID_RE.match(target):
        return
    raise CliError(f"{target!r} is not a file, a ticket id, a pull request URL, local:WORKSPACE/pulls/N or a "
                   "PR number (with --workspace)", EXIT_USAGE)


async def _envelopes(afe: _Afe, args: argparse.Namespace) -> tuple[list[dict[str, Any]], str]:
    """(the envelopes to check, the head afe knows or "")."""
    target = args.target
    path = Path(target)
    if path.is_file():  # noqa: ASYNC240 - a CLI, one small file
        try:
            return [attestation.extract_envelope(path.read_text(encoding="utf-8"))], ""  # noqa: ASYNC240
        except attestation.NotVerified as exc:
            raise CliError(f"{target}: {exc.message}", EXIT_FAILED) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise CliError(f"{target}: cannot read it ({exc})", EXIT_USAGE) from None
    ticket = await _ticket_of(afe, target, args.workspace)
    r = await afe.call("tickets.records", {"id": ticket})
    head = r.get("head_sha", "")
    sha = (args.sha or head).lower()
    records = [x for x in r.get("records") or [] if not sha or x["sha"] == sha]
    if not records:
        raise CliError(f"ticket {ticket} has no signed run record" + (f" of {sha}" if sha else "")
                       + " (a record is signed when its approval is asked)", EXIT_FAILED)
    return [json.loads(x["envelope"]) for x in records], head


async def _ticket_of(afe: _Afe, target: str, workspace: str) -> str:
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


async def _head_of_file(afe: _Afe, env: dict[str, Any]) -> str:
    """The head afe knows of the ticket a record file names (trusted only once the signature checks)."""
    try:
        ticket = str(attestation.unverified_statement(env)["predicate"]["ticket"]["id"])
    except (KeyError, TypeError):
        raise CliError("not afe's run record: no ticket in it; give --sha COMMIT to check it", EXIT_FAILED) from None
    head = str((await afe.call("tickets.records", {"id": ticket})).get("head_sha") or "")
    if not head:
        raise CliError(f"afe knows no pull request head of ticket {ticket}; give --sha COMMIT", EXIT_USAGE)
    return head
