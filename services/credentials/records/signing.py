"""The credential broker's signing key and what it signs: the run record of a
head afe asks approval for (R42, docs/GUIDE.md "The run record").

The key is an Ed25519 key made on the broker's first start and kept at
`<data>/credentials/signing/ed25519.pem` (PKCS#8 PEM, folder 0700, file
0600, written atomically); every later start loads the same key. A key file
that cannot be read or parsed, or that group or others may read, stops the
broker with an error saying what to fix: a new key would silently make every
earlier record unverifiable. The private key never leaves this module: no
RPC returns it and nothing logs it.

`keyid` = lowercase hex SHA-256 of the raw 32-byte public key.

The broker signs only what it checked (`check_statement`): an in-toto
Statement v1 (https://github.com/in-toto/attestation, spec/v1/statement.md)
of afe's run-record predicate type, whose one subject is a `gitCommit` of
the ticket's own branch, and which holds none of the secrets the broker
holds (its Redactor's values). The envelope is DSSE v1
(https://github.com/secure-systems-lab/dsse, protocol.md): the signature is
over PAE(payloadType, payload) =
"DSSEv1" SP len(type) SP type SP len(body) SP body.
"""

from __future__ import annotations

import base64
import json
import os
import re
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.provenance.attestation import (
    PAYLOAD_TYPE,
    PREDICATE_TYPE,
    STATEMENT_TYPE,
    canonical,
    keyid_of,
    pae,
)

if TYPE_CHECKING:
    from services.common.config.model import Workspace
    from services.common.secrecy.redact import Redactor
    from services.credentials.workspaces.host import WorkspaceGit

PREDICATE_TYPES = (PREDICATE_TYPE,)
MAX_STATEMENT_BYTES = 1024 * 1024
SHA1_HEX = re.compile(r"^[0-9a-f]{40}$")
KEY_FILE = "ed25519.pem"


class SigningKey:
    """The broker's Ed25519 key, loaded (or made once) from `folder`."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / KEY_FILE
        self._key = _load_or_create(folder, self.path)
        pub = self._key.public_key()
        self.raw_public = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.public_pem = pub.public_bytes(serialization.Encoding.PEM,
                                           serialization.PublicFormat.SubjectPublicKeyInfo).decode()
        self.keyid = keyid_of(self.raw_public)

    def __repr__(self) -> str:
        return f"SigningKey(keyid={self.keyid}, private=[secure])"

    def envelope(self, payload: bytes) -> str:
        """The DSSE envelope (canonical JSON) of `payload`, signed."""
        sig = self._key.sign(pae(PAYLOAD_TYPE, payload))
        return canonical({"payload": base64.b64encode(payload).decode(), "payloadType": PAYLOAD_TYPE,
                          "signatures": [{"keyid": self.keyid, "sig": base64.b64encode(sig).decode()}]}).decode()


def _load_or_create(folder: Path, path: Path) -> Ed25519PrivateKey:
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(folder, 0o700)
    try:
        st = path.lstat()
    except FileNotFoundError:
        return _create(path)
    where = f"the signing key {path}"
    if not stat.S_ISREG(st.st_mode):
        raise FailedPrecondition(f"{where} is not a regular file: move it away (a new key is made on start; "
                                 "records signed with the old one then verify only with its public key)")
    if st.st_mode & 0o077:
        raise FailedPrecondition(f"{where} may be read by group or others (mode {stat.S_IMODE(st.st_mode):o}): "
                                 f"run `chmod 600 {path}` and check who read it; if anyone may have, move it away "
                                 "so a new key is made")
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise FailedPrecondition(f"{where} cannot be read as an Ed25519 PEM key ({type(exc).__name__}): restore it "
                                 "from your backup, or move it away so a new key is made") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise FailedPrecondition(f"{where} is not an Ed25519 key: restore it from your backup, or move it away "
                                 "so a new key is made")
    return key


def _create(path: Path) -> Ed25519PrivateKey:
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, pem)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)       # first writer wins; a concurrent start loads that one
    except FileExistsError:
        return _load_or_create(path.parent, path)
    finally:
        tmp.unlink(missing_ok=True)
    return key


def check_statement(statement: bytes, ticket_id: str) -> tuple[str, dict[str, Any]]:
    """(the subject's commit, the parsed Statement) of what a caller asks the broker to sign,
    or InvalidArgument saying what is wrong with it."""
    if len(statement) > MAX_STATEMENT_BYTES:
        raise InvalidArgument(f"the statement is {len(statement)} bytes; at most {MAX_STATEMENT_BYTES} are signed")
    try:
        doc = json.loads(statement.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise InvalidArgument("the statement is not UTF-8 JSON") from None
    if not isinstance(doc, dict) or doc.get("_type") != STATEMENT_TYPE:
        raise InvalidArgument(f"the statement is not an in-toto Statement: `_type` must be {STATEMENT_TYPE}")
    if doc.get("predicateType") not in PREDICATE_TYPES:
        raise InvalidArgument(f"predicateType must be one of afe's: {', '.join(PREDICATE_TYPES)}")
    if not isinstance(doc.get("predicate"), dict):
        raise InvalidArgument("the statement's `predicate` must be an object")
    subject = doc.get("subject")
    if not isinstance(subject, list) or len(subject) != 1 or not isinstance(subject[0], dict):
        raise InvalidArgument("the statement must have exactly one subject: the commit")
    digest = subject[0].get("digest")
    name = subject[0].get("name")
    if not isinstance(digest, dict) or set(digest) != {"gitCommit"} or not SHA1_HEX.match(str(digest["gitCommit"])):
        raise InvalidArgument("the subject's digest must be {\"gitCommit\": <40 lowercase hex>} alone")
    if not isinstance(name, str) or not name.endswith(f"@afe/{ticket_id}"):
        raise InvalidArgument(f"the subject's name must end with @afe/{ticket_id} (the ticket's branch)")
    if (doc["predicate"].get("ticket") or {}).get("id") != ticket_id:
        raise InvalidArgument("the predicate's ticket.id must be the ticket being signed for")
    return str(digest["gitCommit"]), doc


def strings_of(obj: object) -> list[str]:
    """Every string (keys and values) in a JSON document."""
    out: list[str] = []
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, str):
            out.append(o)
        elif isinstance(o, dict):
            out.extend(str(k) for k in o)
            stack.extend(o.values())
        elif isinstance(o, list):
            stack.extend(o)
    return out


class Signer:
    """Signs the run records of tickets whose git dir this broker holds."""

    def __init__(self, key: SigningKey, git: WorkspaceGit, redactor: Redactor) -> None:
        self.key = key
        self.git = git              # workspaces.WorkspaceGit: the tickets' git dirs
        self.redactor = redactor    # the broker's Redactor: every secret it holds

    async def sign(self, ticket_id: str, statement: bytes, ws: Workspace | None = None) -> str:
        sha, doc = check_statement(statement, ticket_id)
        if any(self.redactor.holds(s) for s in [statement.decode("utf-8"), *strings_of(doc)]):
            raise FailedPrecondition("the statement holds a secret of the credential broker (a token or a model "
                                     "key); it was not signed: records hold no secret (R42)")
        await self._check_commit(ticket_id, sha, ws)
        return self.key.envelope(statement)

    async def _check_commit(self, ticket_id: str, sha: str, ws: Workspace | None = None) -> None:
        """`sha` is on the ticket's branch: the one afe pushed (its git dir), or, when
        a person pushed to that branch since, the branch as the remote has it now
        (the mirror, fetched first, as the verification's checkout does)."""
        from services.credentials.workspaces.continuation import branch_for

        gitdir = self.git.layout.gitdir(ticket_id)
        if not (gitdir / "afe-ready").exists():
            raise FailedPrecondition(f"ticket {ticket_id} has no prepared workspace here; prepare it, then sign")
        branch = f"refs/heads/{branch_for(ticket_id)}"
        if await self._on_branch(gitdir, sha, branch):
            return
        if ws is not None:
            mirror = await self.git.mirrors.update(ws)
            if await self._on_branch(mirror, sha, branch):
                return
        raise FailedPrecondition(f"commit {sha} is not on the branch of ticket {ticket_id}; only a commit of "
                                 "the ticket's own branch is signed")

    async def _on_branch(self, git_dir: Path, sha: str, branch: str) -> bool:
        res = await self.git.git.run(["merge-base", "--is-ancestor", "--end-of-options", sha, branch],
                                     git_dir=git_dir, check=False, what="git merge-base")
        return res.returncode == 0
