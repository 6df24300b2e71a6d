"""afe's run record (R42) as a reader checks it: a DSSE v1 envelope
(https://github.com/secure-systems-lab/dsse, protocol.md) holding an in-toto
Statement v1 (https://github.com/in-toto/attestation, spec/v1/statement.md
and resource_descriptor.md) of predicate type `PREDICATE_TYPE`, signed with
the credential broker's Ed25519 key (services/credentials/signing.py).

Used by `afe verify` (services/cli/verify.py) and by the tests; the broker
signs, this module only checks. `verify` raises `NotVerified` naming what
failed: bad signature, another key, wrong subject, not a Statement.
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

from .errors import FailedPrecondition

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
PREDICATE_TYPE = "https://afe.dev/attestations/run-record/v1"
FENCE = "```json afe-run-record"     # the fenced block of the PR comment holding the envelope
_FENCED = re.compile(r"```json afe-run-record\n(\{.*?\})\n```", re.DOTALL)
_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:\S+$")
_HEX = re.compile(r"^[0-9a-f]+$")


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


def extract_envelope(text: str) -> dict[str, Any]:
    """The envelope from a file's text: the envelope JSON itself, or a saved PR
    comment holding it in its ```json afe-run-record fenced block (the last one)."""
    found = _FENCED.findall(text)
    raw = found[-1] if found else text.strip()
    try:
        env = json.loads(raw)
    except ValueError:
        raise NotVerified("no DSSE envelope found: give the envelope's JSON, or a PR comment holding it in a "
                          f"{FENCE} block") from None
    if not isinstance(env, dict):
        raise NotVerified("the envelope is not a JSON object")
    return env


def unverified_statement(env: dict[str, Any]) -> dict[str, Any]:
    """The Statement an envelope carries, NOT checked ({} when it holds none): for reading
    afe's own stored records and for finding which ticket a file names before `verify`."""
    try:
        doc = json.loads(base64.b64decode(str(env.get("payload", ""))))
    except (ValueError, TypeError):
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
    if env.get("payloadType") != PAYLOAD_TYPE:
        raise NotVerified(f"not an in-toto envelope: payloadType is not {PAYLOAD_TYPE}")
    try:
        payload = base64.b64decode(str(env.get("payload", "")), validate=True)
    except (binascii.Error, ValueError):
        raise NotVerified("the envelope's payload is not base64") from None
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    keyid = keyid_of(raw)
    sigs = [s for s in env.get("signatures") or [] if isinstance(s, dict)]
    if not sigs:
        raise NotVerified("the envelope has no signature")
    mine = [s for s in sigs if s.get("keyid") in (keyid, "", None)]
    if not mine:
        others = ", ".join(str(s.get("keyid"))[:16] for s in sigs)
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
    except (UnicodeDecodeError, ValueError):
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
            if not isinstance(value, str) or not _HEX.match(value):
                out.append(f"subject[{i}].digest.{alg} must be lowercase hex")
        for f in ("name", "uri", "downloadLocation", "mediaType", "content"):
            if f in rd and not isinstance(rd[f], str):
                out.append(f"subject[{i}].{f} must be a string")
        if "annotations" in rd and not isinstance(rd["annotations"], dict):
            out.append(f"subject[{i}].annotations must be an object")
    return out


def summary(v: Verified) -> list[str]:
    """A few lines about a verified record (its values are JSON-escaped data)."""
    p = v.statement.get("predicate") or {}
    t = p.get("ticket") or {}
    wf = p.get("workflow") or {}
    lines = [f"verified: {p.get('kind', 'request')} record of commit {v.sha}",
             f"  signed by keyid {v.keyid}",
             (f"  ticket {json.dumps(t.get('id', ''))}, workflow {json.dumps(wf.get('name', ''))}, "
             f"{len(wf.get('nodes') or [])} node(s)")]
    ver = p.get("verification")
    if isinstance(ver, dict):
        lines.append(f"  verification: {'passed' if ver.get('passed') else 'FAILED'}")
    usage = p.get("usage") or {}
    if usage:
        lines.append(f"  tokens: {usage.get('total_tokens', 0)}")
    d = p.get("decision")
    if isinstance(d, dict):
        lines.append(f"  decision: {'approved' if d.get('granted') else 'rejected'} by "
                     f"{json.dumps(d.get('principal', ''))} of {d.get('sha', '')}")
    return lines
