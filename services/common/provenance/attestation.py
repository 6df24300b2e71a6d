"""afe's run record (R42) as a reader checks it: a DSSE v1 envelope
(https://github.com/secure-systems-lab/dsse, protocol.md) holding an in-toto
Statement v1 (https://github.com/in-toto/attestation, spec/v1/statement.md
and resource_descriptor.md) of predicate type `PREDICATE_TYPE`, signed with
the credential broker's Ed25519 key (services/credentials/records/signing.py).

Used by `afe verify` (services/cli/verify.py) and by the tests; the broker
signs, this module only checks. `verify` raises `NotVerified` naming what
failed: a malformed envelope, bad signature, another key, wrong subject, not a
Statement. Everything read from an envelope is untrusted until its signature
checks, and even then it is data: `shown` escapes each value a line prints.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from services.common.errors import FailedPrecondition

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
PREDICATE_TYPE = "https://afe.dev/attestations/run-record/v1"
FENCE = "```json afe-run-record"     # the fenced block of the PR comment holding the envelope
_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:\S+$")
_HEX = re.compile(r"[0-9a-f]+")      # fullmatch: "$" would also match before a final newline


class NotVerified(FailedPrecondition):
    """The record did not verify; the message says why."""


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE v1 Pre-Authentication Encoding: "DSSEv1" SP len(type) SP type SP len(body) SP body."""
    t = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


def keyid_of(raw_public: bytes) -> str:
    """afe's keyid: lowercase hex SHA-256 of the raw 32-byte Ed25519 public key."""
    return hashlib.sha256(raw_public).hexdigest()


def canonical(obj: Any) -> bytes:
    """Deterministic JSON: sorted keys, no spaces, ASCII only (any character escaped)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def envelope_digest(envelope: str) -> str:
    return hashlib.sha256(envelope.encode()).hexdigest()


def public_key(pem_or_raw: str | bytes) -> Ed25519PublicKey:
    """An Ed25519 public key from PEM text or its raw 32 bytes."""
    data = pem_or_raw.encode() if isinstance(pem_or_raw, str) else pem_or_raw
    if len(data) == 32:
        return Ed25519PublicKey.from_public_bytes(data)
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError:
        raise NotVerified("the key is not a PEM public key (print afe's with `afe keys`)") from None
    if not isinstance(key, Ed25519PublicKey):
        raise NotVerified("the key is not an Ed25519 public key")
    return key


def fenced_blocks(text: str) -> list[str]:
    """The contents of the ```json afe-run-record fenced blocks in `text`, in order (those that
    hold a JSON object): from the line after a fence line up to the next line that is ``` alone.
    A fence line inside an unclosed block starts a new block. Linear in the text's size: every
    search starts where the last one stopped, so an adversarial comment (many fences, none
    closed) costs one pass, not one pass per fence."""
    out: list[str] = []
    pos, n = 0, len(text)
    while True:
        start = text.find(FENCE, pos)
        if start < 0:
            return out
        after = start + len(FENCE)
        if not ((start == 0 or text[start - 1] == "\n") and text.startswith(("\n", "\r\n"), after)):
            pos = after                     # not a fence line ("x```json afe-run-record-2")
            continue
        body = after + (1 if text.startswith("\n", after) else 2)
        scan = body - 1                     # the opening line's own newline
        while True:
            c = text.find("\n```", scan)
            if c < 0:
                return out
            line = c + 1
            if text.startswith(FENCE, line):
                pos = line                  # an unclosed block: the next fence line starts anew
                break
            rest = line + 3
            if rest == n or text[rest] in "\r\n":
                block = text[body:c].strip()
                if block.startswith("{") and block.endswith("}"):
                    out.append(block)
                pos = rest
                break
            scan = rest                     # "```python": not the closing line


def extract_envelope(text: str) -> dict[str, Any]:
    """The envelope from a file's text: the envelope JSON itself, or a saved PR
    comment holding it in its ```json afe-run-record fenced block (the last one)."""
    found = fenced_blocks(text)
    raw = found[-1] if found else text.strip()
    try:
        env = json.loads(raw)
    except (ValueError, RecursionError):
        raise NotVerified("no DSSE envelope found: give the envelope's JSON, or a PR comment holding it in a "
                          f"{FENCE} block") from None
    if not isinstance(env, dict):
        raise NotVerified("the envelope is not a JSON object")
    return env


def envelope_problem(env: object) -> str:
    """What makes `env` not a DSSE envelope's shape, for one line ("" when it has it):
    {"payloadType": str, "payload": base64 str, "signatures": [{"keyid": str, "sig": base64 str}, ...]}."""
    if not isinstance(env, dict):
        return "the envelope is not a JSON object"
    for field in ("payloadType", "payload"):
        if not isinstance(env.get(field), str):
            return f"the envelope's `{field}` must be a string, not {_kind(env.get(field))}"
    sigs = env.get("signatures")
    if not isinstance(sigs, list):
        return f"the envelope's `signatures` must be a list of {{keyid, sig}} objects, not {_kind(sigs)}"
    if not sigs:
        return "the envelope has no signature (`signatures` is empty)"
    for i, sig in enumerate(sigs):
        if not isinstance(sig, dict):
            return f"the envelope's signatures[{i}] must be an object {{keyid, sig}}, not {_kind(sig)}"
        if not isinstance(sig.get("sig"), str):
            return f"the envelope's signatures[{i}].sig must be a base64 string, not {_kind(sig.get('sig'))}"
        if "keyid" in sig and not isinstance(sig["keyid"], str):
            return f"the envelope's signatures[{i}].keyid must be a string, not {_kind(sig['keyid'])}"
    return ""


def _kind(value: object) -> str:
    """A JSON value's kind, for an error (never its content)."""
    if value is None:
        return "missing or null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
            dict: "an object"}.get(type(value), "another value")


def unverified_statement(env: dict[str, Any]) -> dict[str, Any]:
    """The Statement an envelope carries, NOT checked ({} when it holds none): for reading
    afe's own stored records and for finding which ticket a file names before `verify`."""
    try:
        doc = json.loads(base64.b64decode(str(env.get("payload", ""))))
    except (ValueError, TypeError, RecursionError):
        return {}
    return doc if isinstance(doc, dict) else {}


@dataclass(frozen=True)
class Verified:
    statement: dict[str, Any]
    keyid: str
    sha: str

    @property
    def kind(self) -> str:
        return str(self.statement.get("predicate", {}).get("kind", ""))


def verify(env: dict[str, Any], key: Ed25519PublicKey, sha: str | None = None) -> Verified:
    """Check the envelope's signature with `key`, its Statement and (when given) its subject commit."""
    problem = envelope_problem(env)
    if problem:
        raise NotVerified(f"malformed envelope: {problem}")
    if env.get("payloadType") != PAYLOAD_TYPE:
        raise NotVerified(f"not an in-toto envelope: payloadType is not {PAYLOAD_TYPE}")
    try:
        payload = base64.b64decode(str(env.get("payload", "")), validate=True)
    except (binascii.Error, ValueError):
        raise NotVerified("the envelope's payload is not base64") from None
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    keyid = keyid_of(raw)
    sigs: list[dict[str, Any]] = env["signatures"]
    mine = [s for s in sigs if s.get("keyid") in (keyid, "", None)]
    if not mine:
        others = ", ".join(shown(str(s.get("keyid"))[:16]) for s in sigs[:5])
        raise NotVerified(f"signed by another key (keyid {others}…), not by {keyid[:16]}…")
    for s in mine:
        try:
            key.verify(base64.b64decode(str(s.get("sig", "")), validate=True), pae(PAYLOAD_TYPE, payload))
            break
        except (InvalidSignature, binascii.Error, ValueError):
            continue
    else:
        raise NotVerified(f"bad signature: the envelope was changed after signing, or signed by another key "
                          f"than {keyid[:16]}…")
    try:
        statement = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise NotVerified("not a Statement: the payload is not UTF-8 JSON") from None
    problems = statement_problems(statement)
    if problems:
        raise NotVerified("not a Statement: " + "; ".join(problems))
    subject = statement["subject"][0]
    got = str(subject.get("digest", {}).get("gitCommit", ""))
    if statement.get("predicateType") != PREDICATE_TYPE or not got:
        raise NotVerified(f"not afe's run record: predicateType {PREDICATE_TYPE} with a gitCommit subject expected")
    if sha is not None and got != sha.lower():
        raise NotVerified(f"wrong subject: the record is of commit {got}, not {sha.lower()}")
    return Verified(statement, keyid, got)


def statement_problems(doc: object) -> list[str]:
    """What makes `doc` not an in-toto Statement v1 (spec/v1/statement.md,
    resource_descriptor.md, digest_set.md); [] when it is one. The same rules
    as tests/support/intoto_statement_v1.schema.json."""
    if not isinstance(doc, dict):
        return ["it is not a JSON object"]
    out = []
    if doc.get("_type") != STATEMENT_TYPE:
        out.append(f"_type must be {STATEMENT_TYPE}")
    pt = doc.get("predicateType")
    if not isinstance(pt, str) or not _URI.match(pt):
        out.append("predicateType must be a URI")
    if "predicate" in doc and not isinstance(doc["predicate"], dict):
        out.append("predicate must be an object")
    subject = doc.get("subject")
    if not isinstance(subject, list) or not subject:
        return [*out, "subject must be a non-empty array"]
    for i, rd in enumerate(subject):
        if not isinstance(rd, dict):
            out.append(f"subject[{i}] must be an object")
            continue
        digest = rd.get("digest")
        if not isinstance(digest, dict) or not digest:
            out.append(f"subject[{i}] must have a digest")   # the Statement requires it of each subject
            continue
        for alg, value in digest.items():
            if not isinstance(value, str) or not _HEX.fullmatch(value):
                out.append(f"subject[{i}].digest.{alg} must be lowercase hex")
        for f in ("name", "uri", "downloadLocation", "mediaType", "content"):
            if f in rd and not isinstance(rd[f], str):
                out.append(f"subject[{i}].{f} must be a string")
        if "annotations" in rd and not isinstance(rd["annotations"], dict):
            out.append(f"subject[{i}].annotations must be an object")
    return out


def shown(value: object) -> str:
    """A value from a record as one printable line: lowercase hex and whole numbers as they
    are, anything else as JSON with every control, non-ASCII and DEL character escaped (no
    terminal escape sequence, line break or bidi override reaches the terminal)."""
    if isinstance(value, str) and _HEX.fullmatch(value):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    try:
        text = json.dumps(value, ensure_ascii=True, sort_keys=True)
    except (TypeError, ValueError, RecursionError):
        text = json.dumps(str(value), ensure_ascii=True)
    return text.replace("\x7f", "\\u007f")


def _dict(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def _word(value: object, words: tuple[str, ...]) -> str:
    return value if isinstance(value, str) and value in words else shown(value)


def verification_failed(v: Verified) -> bool:
    """The record is genuine and holds a verification that did not pass (R41)."""
    ver = _dict(v.statement.get("predicate")).get("verification")
    return isinstance(ver, dict) and ver.get("passed") is not True


def pushed_by(v: Verified) -> str:
    """Who pushed the record's head: "afe", "person", "" (a record older than the field) or
    "unknown" (another value)."""
    head = _dict(_dict(v.statement.get("predicate")).get("head"))
    if "pushed_by" not in head:
        return ""
    return head["pushed_by"] if head["pushed_by"] in ("afe", "person") else "unknown"


def summary(v: Verified) -> list[str]:
    """A few lines about a verified record; every value from it goes through `shown`."""
    p = _dict(v.statement.get("predicate"))
    t = _dict(p.get("ticket"))
    wf = _dict(p.get("workflow"))
    lines = [f"verified: {_word(p.get('kind', 'request'), ('request', 'decision'))} record of commit {v.sha}",
             f"  signed by keyid {v.keyid}",
             (f"  ticket {shown(t.get('id', ''))}, workflow {shown(wf.get('name', ''))}, "
              f"{len(_list(wf.get('nodes')))} node(s)")]
    head = _dict(p.get("head"))
    if head.get("pushed_by") == "afe":
        lines.append("  head: pushed by afe's run")
    elif head.get("pushed_by") == "person":
        run = _dict(p.get("afe_run"))
        lines.append("  head: pushed by a person, NOT by afe's run; what the run did (its commands, prompts, "
                     f"models) made {shown(run.get('head') or 'no head')}, not this one")
    ver = p.get("verification")
    if isinstance(ver, dict):
        lines += _verification_lines(ver)
    usage = _dict(p.get("usage"))
    if usage:
        lines.append(f"  tokens: {shown(usage.get('total_tokens', 0))}")
    d = p.get("decision")
    if isinstance(d, dict):
        lines.append(f"  decision: {'approved' if d.get('granted') is True else 'rejected'} by "
                     f"{shown(d.get('principal', ''))} of {shown(d.get('sha', ''))}")
        acked = _list(d.get("accepted_harness_change"))
        if acked:
            lines.append(f"    acknowledged harness changes: {_items(acked)}")
    return lines


_DETAILS = (("reasons", "why it failed"), ("harness_changes", "changes how tests run (the base's version ran)"),
            ("binary_files", "binary files"), ("shadowing", "shadows a standard module"))


def _verification_lines(ver: dict[str, Any]) -> list[str]:
    tests = ver.get("tests")
    counted = ""
    if isinstance(tests, dict):
        counted = " (" + ", ".join(f"{shown(tests.get(k, 0))} {k}" for k in
                                   ("ran", "passed", "failed", "errors", "skipped", "deselected")) + ")"
    out = [f"  verification: {'passed' if ver.get('passed') is True else 'FAILED'}{counted}"]
    base_tests = ver.get("base_tests")
    if isinstance(base_tests, dict):
        out.append(f"    the base's own run: {shown(base_tests.get('ran', 0))} ran")
    if ver.get("base_sha"):
        out.append(f"    merged onto {shown(ver.get('base_branch') or '')} at {shown(ver['base_sha'])}"
                   + (f", verified as {shown(ver['merge_sha'])}" if ver.get("merge_sha") else ""))
    for c in _list(ver.get("commands"))[:50]:
        c = _dict(c)
        how = "timed out" if c.get("timed_out") is True else f"exit {shown(c.get('exit_code'))}"
        counts = _dict(c.get("counts"))
        ran = f", {shown(counts.get('ran', 0))} test(s) ran" if counts else ""
        out.append(f"    {shown(c.get('command', ''))}: {how}{ran}")
    for key, what in _DETAILS:
        if _list(ver.get(key)):
            out.append(f"    {what}: {_items(_list(ver.get(key)))}")
    if ver.get("error"):
        out.append(f"    error: {shown(ver['error'])}")
    return out


def _items(values: list[Any], limit: int = 20) -> str:
    more = f" and {len(values) - limit} more" if len(values) > limit else ""
    return ", ".join(shown(x) for x in values[:limit]) + more
