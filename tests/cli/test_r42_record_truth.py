"""R42, "the record tells the truth", in `afe verify` (services/cli/verify.py,
services/common/provenance/attestation.py).

Fast tests, in-process, with real Ed25519 keys and real DSSE envelopes:
- the exit code tells a script what it needs: 0 genuine and passed, 1 not
  genuine or malformed, 7 genuine but the verification it records failed,
  8 genuine but of an older head than the pull request's current one;
- `--json` carries the verification, who pushed the head and the current head;
- `afe verify <PR>` checks the forge's current head, not only the one afe
  stored (the afe RPCs are answered by a stand-in object here; the end-to-end
  test at the bottom runs the real system);
- a malformed envelope gets one line, never a traceback (a table of shapes;
  the control shows the checker would raise without the shape check);
- every field printed from a record is escaped (the control prints it raw);
- finding envelopes in a comment is linear (characters scanned counted; the
  control counts the per-fence scan the old regex made).

End-to-end (Docker, the shared live system): a person pushes to the ticket's
branch; `afe verify <PR>` says the record is of an older head (exit 8); once
the person's head is asked for approval, its record says `pushed_by: person`
with none of the agent's commands or models."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from services.cli import verify as cli_verify
from services.cli.main import build_parser, main
from services.cli.rpc_client import CliError
from services.common.provenance import attestation

SHA = "a" * 40
NEWER = "b" * 40
KEY = Ed25519PrivateKey.generate()


def _pem(key: Ed25519PrivateKey) -> str:
    return key.public_key().public_bytes(serialization.Encoding.PEM,
                                         serialization.PublicFormat.SubjectPublicKeyInfo).decode()


def _keyid(key: Ed25519PrivateKey) -> str:
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return attestation.keyid_of(raw)


def _statement(sha: str = SHA, **predicate: Any) -> dict[str, Any]:
    p = {"kind": "request", "ticket": {"id": "t-1"}, "workflow": {"name": "review", "nodes": []},
         "head": {"sha": sha, "pushed_by": "afe"}, "usage": {"total_tokens": 12}, **predicate}
    return {"_type": attestation.STATEMENT_TYPE, "predicateType": attestation.PREDICATE_TYPE,
            "subject": [{"name": "git+afe-workspace/ws@afe/t-1", "digest": {"gitCommit": sha}}], "predicate": p}


def _envelope(statement: dict[str, Any] | bytes, key: Ed25519PrivateKey = KEY) -> dict[str, Any]:
    payload = statement if isinstance(statement, bytes) else attestation.canonical(statement)
    sig = key.sign(attestation.pae(attestation.PAYLOAD_TYPE, payload))
    return {"payload": base64.b64encode(payload).decode(), "payloadType": attestation.PAYLOAD_TYPE,
            "signatures": [{"keyid": _keyid(key), "sig": base64.b64encode(sig).decode()}]}


PASSED = {"passed": True, "sha": SHA, "base_sha": "c" * 40, "merge_sha": "d" * 40, "base_branch": "main",
          "tests": {"ran": 5, "passed": 5, "failed": 0, "errors": 0, "skipped": 0, "deselected": 0},
          "commands": [{"command": "python3 -m pytest", "exit_code": 0, "timed_out": False, "duration_ms": 9,
                        "counts": {"ran": 5, "passed": 5, "failed": 0, "errors": 0, "skipped": 0,
                                   "deselected": 0}}],
          "reasons": [], "harness_changes": [], "binary_files": [], "shadowing": []}
FAILED = {**PASSED, "passed": False, "reasons": ["ran no test"],
          "tests": {"ran": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "deselected": 5}}


@pytest.fixture
def files(tmp_path):
    pub = tmp_path / "afe.pub"
    pub.write_text(_pem(KEY))

    def write(name: str, content: dict[str, Any] | str) -> str:
        path = tmp_path / name
        path.write_text(content if isinstance(content, str) else json.dumps(content))
        return str(path)

    return str(pub), write


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["verify", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


# -- exit codes and --json ---------------------------------------------------------------

def test_r42_verify_exit_codes_tell_a_genuine_passed_record_from_a_failed_verification(capsys, files):
    pub, write = files
    passed = write("passed.json", _envelope(_statement(verification=PASSED)))
    failed = write("failed.json", _envelope(_statement(verification=FAILED)))
    none = write("none.json", _envelope(_statement(verification=None)))
    forged = _envelope(_statement(verification=FAILED))
    forged["payload"] = base64.b64encode(attestation.canonical(_statement(verification=PASSED))).decode()
    forged_file = write("forged.json", forged)

    code, out, err = _run(capsys, passed, "--key", pub, "--sha", SHA)
    assert code == 0, err                                          # positive control
    assert "verification: passed (5 ran, 5 passed" in out and "merged onto \"main\" at " + "c" * 40 in out
    code, out, err = _run(capsys, none, "--key", pub, "--sha", SHA)
    assert code == 0, err                                          # no verify: declared: not a failure
    code, out, err = _run(capsys, failed, "--key", pub, "--sha", SHA)
    assert code == cli_verify.EXIT_VERIFICATION_FAILED == 7
    assert "verification: FAILED" in out and "genuine, but the verification it records FAILED" in err
    assert '"ran no test"' in err
    code, out, err = _run(capsys, forged_file, "--key", pub, "--sha", SHA)
    assert code == 1 and "bad signature" in err                     # a failed record made to look passed

    code, out, err = _run(capsys, failed, "--key", pub, "--sha", SHA, "--json")
    line = json.loads(out)
    assert code == 7 and line["verified"] is True and line["verification_passed"] is False
    assert line["verification"]["reasons"] == ["ran no test"] and line["verification"]["tests"]["deselected"] == 5
    assert line["pushed_by"] == "afe" and line["current_head"] == "" and line["is_current_head"] is None
    code, out, err = _run(capsys, forged_file, "--key", pub, "--sha", SHA, "--json")
    assert code == 1 and json.loads(out) == {"verified": False, "error": json.loads(out)["error"]}
    assert "bad signature" in json.loads(out)["error"]


class _Afe:
    """Stands in for the gateway's JSON-RPC (`keys.get`, `tickets.records`, `pulls.get`,
    `workspaces.list`) with the shapes gateway/backend.py answers."""

    def __init__(self, records: list[tuple[str, str, dict]], head: str, forge_head: str = "",
                 forge_error: str = "", old_afe: bool = False) -> None:
        self.answer = {"ticket_id": "t-1", "head_sha": head,
                       "records": [{"sha": sha, "kind": kind, "envelope": json.dumps(env), "at_ms": i}
                                   for i, (sha, kind, env) in enumerate(records)]}
        if not old_afe:
            self.answer.update(forge_head_sha=forge_head, forge_error=forge_error)
        self.calls: list[str] = []

    async def call(self, method: str, params: dict[str, Any]) -> Any:
        self.calls.append(method)
        if method == "keys.get":
            return {"public_key_pem": _pem(KEY), "keyid": _keyid(KEY)}
        if method == "tickets.records":
            assert params == {"id": "t-1"}
            return self.answer
        if method == "workspaces.list":
            return {"workspaces": [{"name": "ws", "forge_repo": "o/r"}]}
        if method == "pulls.get":
            return {"id": "t-1"}
        raise AssertionError(method)


async def _verify(capsys, afe: _Afe, *argv: str) -> tuple[int, str, str]:
    """`afe verify ARGV` as services/cli/verify.py runs it, with `afe` answering the RPCs."""
    args = build_parser().parse_args(["verify", *argv])
    try:
        code = await cli_verify._verify_with(afe, args)
    except CliError as exc:                   # as verify._run prints it
        print(f"afe: {exc}", file=sys.stderr)
        code = exc.exit_code
    out = capsys.readouterr()
    return code, out.out, out.err


async def test_r42_verify_a_pr_checks_the_forges_current_head_and_says_when_the_record_is_older(capsys):
    request = _envelope(_statement(verification=PASSED))
    # the forge's head is the recorded one: genuine and current (the positive control)
    code, out, err = await _verify(capsys, _Afe([(SHA, "request", request)], SHA, forge_head=SHA),
                                   "https://github.com/o/r/pull/7", "--json")
    assert code == 0, err
    line = json.loads(out)
    assert line["is_current_head"] is True and line["current_head"] == SHA and line["verification_passed"] is True

    # a person pushed: afe still knows SHA, the forge has NEWER
    afe = _Afe([(SHA, "request", request)], SHA, forge_head=NEWER)
    code, out, err = await _verify(capsys, afe, "https://github.com/o/r/pull/7")
    assert code == cli_verify.EXIT_OLDER_HEAD == 8
    assert f"verified: request record of commit {SHA}" in out                  # the record itself is genuine
    assert f"OLDER HEAD: the record is of {SHA}, but the pull request's head is now {NEWER} (as the forge has it)" \
        in err and "has no signed record" in err
    code, out, err = await _verify(capsys, afe, "7", "--workspace", "ws", "--json")
    assert code == 8 and json.loads(out)["is_current_head"] is False and json.loads(out)["current_head"] == NEWER
    # --sha SHA on a PR whose head moved: the record is checked, and still said to be older
    code, out, err = await _verify(capsys, afe, "t-1", "--sha", SHA)
    assert code == 8 and "OLDER HEAD" in err
    # the newer head has its own record: verify without --sha checks that one
    newer = _envelope(_statement(NEWER, verification=PASSED, head={"sha": NEWER, "pushed_by": "person"},
                                 afe_run={"head": SHA}))
    afe = _Afe([(SHA, "request", request), (NEWER, "request", newer)], SHA, forge_head=NEWER)
    code, out, err = await _verify(capsys, afe, "t-1")
    assert code == 0, err
    assert f"record of commit {NEWER}" in out and "pushed by a person, NOT by afe's run" in out and SHA in out
    code, out, err = await _verify(capsys, afe, "t-1", "--sha", SHA)
    assert code == 8 and "that head has a record of its own" in err

    # the forge could not be asked: the head afe knows, and a note saying so
    afe = _Afe([(SHA, "request", request)], SHA, forge_error="GitHub answered 502\x1b[2J")
    code, out, err = await _verify(capsys, afe, "t-1")
    assert code == 0 and "the forge was not asked" in err and "\x1b" not in err and "\\u001b[2J" in err
    # an afe older than forge_head_sha: the head afe knows, said so
    code, out, err = await _verify(capsys, _Afe([(SHA, "request", request)], SHA, old_afe=True), "t-1")
    assert code == 0 and "does not say the forge's current head" in err


async def test_r42_verify_a_file_against_the_current_head(capsys, tmp_path):
    path = tmp_path / "record.json"
    path.write_text(json.dumps(_envelope(_statement(verification=PASSED))))
    code, _, err = await _verify(capsys, _Afe([], SHA, forge_head=SHA), str(path))
    assert code == 0, err
    code, _, err = await _verify(capsys, _Afe([], SHA, forge_head=NEWER), str(path))
    assert code == 8 and f"head is now {NEWER}" in err
    # an explicit --sha that is not the record's commit stays "wrong subject" (1)
    code, _, err = await _verify(capsys, _Afe([], SHA, forge_head=SHA), str(path), "--sha", NEWER)
    assert code == 1 and "wrong subject" in err
    # an unverified ticket id that is not one afe makes is not sent to afe (nor printed)
    hostile = tmp_path / "hostile.json"
    hostile.write_text(json.dumps(_envelope(_statement(ticket={"id": "t-1\x1b]0;x\x07"}))))
    afe = _Afe([], SHA, forge_head=SHA)
    code, _, err = await _verify(capsys, afe, str(hostile))
    assert code == 1 and "no ticket id afe makes" in err and "tickets.records" not in afe.calls
    assert "\x1b" not in err


# -- malformed envelopes ----------------------------------------------------------------------

def _good() -> dict[str, Any]:
    return _envelope(_statement(verification=PASSED))


MALFORMED: list[tuple[str, Any, str]] = [
    ("signatures a string", {**_good(), "signatures": "abc"}, "`signatures` must be a list"),
    ("signatures a number", {**_good(), "signatures": 5}, "`signatures` must be a list"),
    ("signatures an object", {**_good(), "signatures": {"keyid": "x", "sig": "y"}}, "`signatures` must be a list"),
    ("signatures null", {**_good(), "signatures": None}, "`signatures` must be a list"),
    ("signatures empty", {**_good(), "signatures": []}, "has no signature"),
    ("a signature a string", {**_good(), "signatures": ["sig"]}, "signatures[0] must be an object"),
    ("sig a list", {**_good(), "signatures": [{"keyid": "k", "sig": [1]}]}, "signatures[0].sig must be"),
    ("sig missing", {**_good(), "signatures": [{"keyid": "k"}]}, "signatures[0].sig must be"),
    ("keyid a number", {**_good(), "signatures": [{"keyid": 7, "sig": "AA=="}]}, "signatures[0].keyid must be"),
    ("payload not base64", {**_good(), "payload": "%%%not base64%%%"}, "payload is not base64"),
    ("payload a number", {**_good(), "payload": 12}, "`payload` must be a string"),
    ("payload an object", {**_good(), "payload": {"a": 1}}, "`payload` must be a string"),
    ("payloadType missing", {k: v for k, v in _good().items() if k != "payloadType"}, "`payloadType` must be"),
    ("payloadType other", {**_good(), "payloadType": "text/plain"}, "payloadType is not"),
    ("the envelope a list", [_good()], "not a JSON object"),
    ("the envelope a string", "\"just text\"", "not a JSON object"),
    ("not JSON", "{this is not json", "no DSSE envelope found"),
    ("deeply nested", "[" * 100_000 + "]" * 100_000, "no DSSE envelope found"),
    ("a comment with a broken block", f"x\n{attestation.FENCE}\n{{\"signatures\": 5}}\n```\n",
     "`payloadType` must be a string"),
]


@pytest.mark.parametrize("name,envelope,why", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_r42_verify_a_malformed_envelope_gets_one_clear_line_never_a_traceback(capsys, files, name, envelope,
                                                                                 why):
    pub, write = files
    path = write("env.json", envelope if isinstance(envelope, str) else json.dumps(envelope))
    code, out, err = _run(capsys, path, "--key", pub, "--sha", SHA)
    assert code == 1, (name, err)
    assert why in err and len(err.strip().splitlines()) == 1, (name, err)
    assert "Traceback" not in err + out


def test_r42_verify_malformed_envelopes_other_shapes_signed_and_the_control(capsys, files):
    pub, write = files
    # signed with the right key, but not a Statement of the expected shape: clear refusals too
    shapes = [b"[]", b"\"text\"", b"{\"_type\": 1}", b"\xff\xfe",
              attestation.canonical({**_statement(), "subject": [{"digest": {"gitCommit": SHA + "\n"}}]}),
              attestation.canonical({**_statement(), "predicate": ["a list"]}),
              attestation.canonical({**_statement(), "subject": "not a list"})]
    for payload in shapes:
        code, out, err = _run(capsys, write("s.json", _envelope(payload)), "--key", pub, "--sha", SHA)
        assert code == 1 and "not a Statement" in err and len(err.strip().splitlines()) == 1, (payload, err)
    # predicate fields of unexpected types in a genuine record: printed, not a traceback
    odd = _statement(ticket="a string", workflow=[1], usage={"total_tokens": "\x1b[31m"}, head=[],
                     verification={"passed": True, "tests": "x", "commands": ["y", {"exit_code": [1]}],
                               "reasons": "not a list"}, decision={"granted": "yes", "principal": {"a": 1}})
    code, out, err = _run(capsys, write("odd.json", _envelope(odd)), "--key", pub, "--sha", SHA)
    assert code == 0 and "Traceback" not in err and "\x1b" not in out, err
    assert "decision: rejected" in out                     # "yes" is not the boolean true

    # The control: without the shape check, the checker itself fails with a Python error.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attestation, "envelope_problem", lambda env: "")
        with pytest.raises(TypeError):
            attestation.verify({**_good(), "signatures": 5}, attestation.public_key(_pem(KEY)))


# -- escaping -------------------------------------------------------------------------------------

HOSTILE = ["\x1b]0;owned\x07", "\x1b[2J\x1b[H", "\x9b31m", "line\r\nbreak", "\u202egnp.exe", "del\x7f", "\x00nul"]


def _printable(text: str) -> bool:
    return all(ch.isprintable() for line in text.splitlines() for ch in line) and "\r" not in text


def test_r42_verify_escapes_every_field_it_prints_from_a_record(capsys, files, monkeypatch):
    pub, write = files
    bad = " ".join(HOSTILE)
    record = _statement(
        kind=bad, ticket={"id": bad}, workflow={"name": bad, "nodes": []}, usage={"total_tokens": bad},
        head={"sha": SHA, "pushed_by": "person"}, afe_run={"head": bad},
        verification={**FAILED, "base_branch": bad, "base_sha": bad, "merge_sha": bad, "reasons": [bad],
                      "harness_changes": [bad], "binary_files": [bad], "shadowing": [bad], "error": bad,
                      "commands": [{"command": bad, "exit_code": bad, "counts": {"ran": bad}}],
                      "tests": {"ran": bad}, "base_tests": {"ran": bad}},
        decision={"principal": bad, "granted": True, "sha": bad, "accepted_harness_change": [bad]})
    path = write("hostile.json", _envelope(record))
    code, out, err = _run(capsys, path, "--key", pub, "--sha", SHA)
    assert code == 7, err
    assert _printable(out) and _printable(err), (out, err)
    assert "\\u001b]0;owned\\u0007" in out and "\\u202egnp.exe" in out and "del\\u007f" in out
    for label in ("ticket", "workflow", "head: pushed by a person", "merged onto", "why it failed",
                  "changes how tests run", "binary files", "shadows a standard module", "error:",
                  "decision: approved by", "acknowledged harness changes"):
        assert label in out, label
    code, out, err = _run(capsys, path, "--key", pub, "--sha", SHA, "--json")
    assert code == 7 and out.isascii() and _printable(out) and json.loads(out)["verification"]["error"] == bad

    # Another key's keyid, named in the refusal, escaped as well.
    other = _envelope(record, Ed25519PrivateKey.generate())
    other["signatures"][0]["keyid"] = "\x1b[2Jevil"
    code, out, err = _run(capsys, write("other.json", other), "--key", pub, "--sha", SHA)
    assert code == 1 and "another key" in err and _printable(err), err

    # The control: the same record printed without escaping puts the terminal escapes out.
    monkeypatch.setattr(attestation, "shown", str)
    code, out, err = _run(capsys, path, "--key", pub, "--sha", SHA)
    assert not _printable(out) and "\x1b]0;owned\x07" in out


# -- linear search for envelopes in comment text ---------------------------------------------------

class _Counting(str):
    """A str that counts the characters its searches look at (str.find/startswith/index)."""

    scanned = 0

    def find(self, sub, start=None, end=None):          # type: ignore[override]
        start = 0 if start is None else max(start, 0)
        at = str.find(self, sub, start, len(self) if end is None else end)
        _Counting.scanned += (at + len(sub) if at >= 0 else len(self)) - start
        return at

    def startswith(self, prefix, start=None, end=None):  # type: ignore[override]
        _Counting.scanned += max(len(p) for p in prefix) if isinstance(prefix, tuple) else len(prefix)
        return str.startswith(self, prefix, start, end)


def _per_fence_scan(text: str) -> list[str]:
    """What the old regex (```json afe-run-record\\n(\\{.*?\\})\\n``` with DOTALL) did: from each
    fence, look for the end of the block — to the end of the text when there is none."""
    out, pos = [], 0
    while (start := text.find(attestation.FENCE + "\n{", pos)) >= 0:
        body = start + len(attestation.FENCE) + 1
        end = text.find("}\n```", body)
        if end >= 0:
            out.append(text[body:end + 1])
        pos = body
    return out


@pytest.mark.slow
def test_r42_finding_envelopes_in_a_comment_is_linear_in_its_size():
    env = json.dumps(_envelope(_statement(verification=PASSED)), separators=(",", ":"))
    real = f"\n{attestation.FENCE}\n{env}\n```\n"
    adversarial = (attestation.FENCE + "\n{\n") * 4_000 + "x```json afe-run-record\n" * 1000 + real

    _Counting.scanned = 0
    found = attestation.fenced_blocks(_Counting(adversarial))
    assert found == [env]
    assert _Counting.scanned <= 3 * len(adversarial), (_Counting.scanned, len(adversarial))

    # The control: the per-fence scan on the same text looks at the text once per fence.
    _Counting.scanned = 0
    _per_fence_scan(_Counting(adversarial))
    assert _Counting.scanned > 500 * len(adversarial)

    # A large comment (several MB, 200,000 unclosed fences) still yields the real envelope.
    big = (attestation.FENCE + "\n{\n") * 200_000 + real
    assert attestation.extract_envelope(big) == json.loads(env)
    # CRLF line ends (a comment saved from a browser), two blocks: the last one counts
    two = real.replace("\n", "\r\n") + real.replace(SHA, "e" * 40)
    assert len(attestation.fenced_blocks(two)) == 2


# -- end to end: a person's push to the ticket's branch -----------------------------------------

def _git(live, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", str(live.bare_repo), *args], check=True, capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin", "HOME": str(live.root)}).stdout.strip()


@pytest.mark.docker
@pytest.mark.timeout(600)
def test_r42_a_persons_push_is_an_older_head_then_a_record_of_its_own_without_the_agents_work(live_afe):
    from .test_cli import afe, as_json

    def verify(*args: str):
        return afe(live_afe, "verify", *args, "--data", str(live_afe.layout.data_dir))

    live_afe.reset_demo_repo()
    tid = as_json(afe(live_afe, "ticket", "create", "--demo", "--json"))["id"]
    afe(live_afe, "ticket", "watch", tid, "--until-waiting")
    shown = as_json(afe(live_afe, "ticket", "show", tid, "--json"))
    old, pr = shown["awaiting_sha"], shown["pr"]["url"]
    try:
        first = verify(pr, "--json")
        assert first.returncode == 0, first.stderr                          # the positive control
        line = json.loads(first.stdout.splitlines()[0])
        assert line["pushed_by"] == "afe" and line["is_current_head"] is True

        # a person pushes to the ticket's branch (not through afe)
        tree = _git(live_afe, "rev-parse", f"{old}^{{tree}}")
        moved = _git(live_afe, "-c", "user.name=p", "-c", "user.email=p@example.org", "commit-tree", tree, "-p",
                     old, "-m", "a person's commit")
        _git(live_afe, "update-ref", f"refs/heads/afe/{tid}", moved, old)
        stale = verify(pr)
        assert stale.returncode == 8, (stale.stdout, stale.stderr)
        assert f"record is of {old}" in stale.stderr and f"head is now {moved}" in stale.stderr

        # approving what the person saw (old) asks again, for the person's head; its record says so
        assert afe(live_afe, "approve", tid, "--sha", old).returncode == 0
        for _ in range(120):
            if as_json(afe(live_afe, "ticket", "show", tid, "--json")).get("awaiting_sha") == moved:
                break
            time.sleep(1)
        now = verify(pr, "--json")
        assert now.returncode == 0, (now.stdout, now.stderr)
        line = json.loads(now.stdout.splitlines()[0])
        assert line["sha"] == moved and line["pushed_by"] == "person" and line["afe_head"] == old
        from services.scheduler.store.store import Store
        store = Store.sqlite(live_afe.layout.data_dir / "afe.db")
        try:
            env = json.loads(store.run_records.run_record(tid, moved, "request").envelope)
        finally:
            store.close()
        p = attestation.unverified_statement(env)["predicate"]
        assert p["commands"] == [] and p["models"] == [] and p["prompts"] == []
        assert p["afe_run"]["head"] == old and p["afe_run"]["models"][0]["name"] == "demo-model"
        assert "pushed by a person, NOT by afe's run" in verify(tid).stdout
    finally:
        afe(live_afe, "ticket", "cancel", tid)
