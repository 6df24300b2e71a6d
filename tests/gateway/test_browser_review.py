"""The reviewer's view (R41, R42) and a newcomer's first steps in Debian's
Chromium (headless, via Playwright) against the real gateway and the fake
scheduler on a Unix socket:

- the approval panel shows the head's clean-room verification from its signed
  request record: per-command results and test counts, the base it was merged
  onto, why it failed, harness changes, binary files and shadowing names;
- a head whose verification failed gets no Approve (why, a follow-up, reject);
  a harness change gets "Accept harness change and approve" instead of Approve
  (accept_harness_change reaches the scheduler); a passing head plain Approve;
- the decision waits for the diff: a slow diff never leaves Approve next to
  "(no changes yet)" (issue 35);
- the signed run records decoded and readable; record text is never markup;
- every event type the scheduler emits has a readable line, never JSON;
- "Run the demo" only with the demo configured, an empty board says what to
  do, and test output sits in a box of its size.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services.common.provenance import attestation

from .test_browser import ARGS, CHROMIUM

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
KEY = Ed25519PrivateKey.generate()
KEYID = attestation.keyid_of(KEY.public_key().public_bytes(serialization.Encoding.Raw,
                                                           serialization.PublicFormat.Raw))
BASE = "b" * 40
HOSTILE = "tests/<img src=x onerror=alert(1)>.py"      # a path the agent chose: text, never markup


def envelope(sha: str, predicate: dict) -> str:
    """A DSSE envelope as the credential broker signs it (checked with attestation.verify below)."""
    stmt = {"_type": attestation.STATEMENT_TYPE,
            "subject": [{"name": "git+afe-workspace/demo@afe/t", "digest": {"gitCommit": sha}}],
            "predicateType": attestation.PREDICATE_TYPE, "predicate": predicate}
    payload = attestation.canonical(stmt)
    sig = KEY.sign(attestation.pae(attestation.PAYLOAD_TYPE, payload))
    env = {"payloadType": attestation.PAYLOAD_TYPE, "payload": base64.b64encode(payload).decode(),
           "signatures": [{"keyid": KEYID, "sig": base64.b64encode(sig).decode()}]}
    assert attestation.verify(env, KEY.public_key(), sha).sha == sha      # a real record's shape
    return json.dumps(env)


def counts(ran: int, passed: int, failed: int = 0, skipped: int = 0) -> dict:
    return {"ran": ran, "passed": passed, "failed": failed, "errors": 0, "skipped": skipped, "deselected": 0}


def verification(sha: str, *, passed: bool, ran: int, reasons=(), harness=(), binary=(), shadowing=()) -> dict:
    """A verification summary with the keys of the R41 contract (approval.requested's `verification`)."""
    return {"passed": passed, "sha": sha, "base_sha": BASE, "base_branch": "main", "merge_sha": "c" * 40,
            "base_paths": ["tests/"], "error": "",
            "commands": [{"command": "python3 -m unittest", "exit_code": 0, "timed_out": False, "duration_ms": 1234,
                          "counts": {**counts(ran, ran), "runner": "unittest"}}],
            "tests": counts(ran, ran), "base_tests": counts(5, 5), "reasons": list(reasons),
            "harness_changes": list(harness), "binary_files": list(binary), "shadowing": list(shadowing)}


def predicate(sha: str, v: dict | None, decision: dict | None = None) -> dict:
    p = {"kind": "decision" if decision else "request",
         "ticket": {"id": "t", "workspace": "demo", "principal": "ui", "title_sha256": "0" * 64,
                    "body_sha256": "1" * 64, "followups_sha256": [], "created_at_ms": 1_700_000_000_000},
         "repository": {"forge": "local", "repo": "", "base_branch": "main", "branch": "afe/t",
                        "pull_request": "1", "pull_request_url": "local:demo/pulls/1"},
         "head": {"sha": sha, "pushed_by": "afe", "afe_head": sha, "afe_pushed": [sha]},
         "workflow": {"name": "demo-fix", "max_tokens": 0, "nodes": [
             {"id": "fix", "kind": "model", "needs": [], "state": "succeeded", "attempts": 1, "rounds": 0,
              "model": "demo-model"},
             {"id": "test", "kind": "run", "needs": ["fix"], "state": "succeeded", "attempts": 2, "rounds": 1},
             {"id": "merge", "kind": "builtin", "uses": "builtin:merge", "needs": ["test"], "state": "waiting",
              "attempts": 1, "rounds": 0}]},
         "agents": [], "models": [{"name": "demo-model", "provider": "replay", "model": "script"}],
         "prompts": [{"node": "fix", "sha256": "2" * 64, "bytes": 321}],
         "egress": {"allowed": ["pypi.org"], "allowed_private": [], "allowed_truncated": False,
                    "allowed_counts": [{"host": "pypi.org", "count": 7}],
                    "denied": [{"host": "evil.example", "count": 3}], "denied_truncated": False},
         "usage": {"models": [{"model": "demo-model", "input_tokens": 900, "output_tokens": 100, "cost_usd": 0.0,
                               "calls": 2}], "total_tokens": 1000, "cost_usd": 0.0},
         "commands": [{"node": "test", "command": "python3 -m unittest -v", "command_sha256": "3" * 64,
                       "exit_codes": [1, 0]}],
         "agent_commands": [], "verification": v}
    if decision:
        p["decision"] = decision
    return p


def waiting_ticket(fake, title: str, sha: str, v: dict | None) -> str:
    """A ticket of the fake scheduler waiting for the approval of `sha`, with its signed request record."""
    fake._n += 1
    tid = f"r{fake._n}"
    fake.tickets[tid] = pb.Ticket(
        id=tid, workspace="demo", workflow="demo-fix", title=title, state=pb.TICKET_STATE_WAITING_APPROVAL,
        awaiting_sha=sha, pr=pb.PullRequest(number="1", url="local:demo/pulls/1", head_branch=f"afe/{tid}",
                                            base_branch="main", head_sha=sha, state="open"),
        nodes=[pb.NodeRun(id="fix", kind="model", state=pb.NODE_STATE_SUCCEEDED),
               pb.NodeRun(id="merge", kind="builtin:merge", state=pb.NODE_STATE_WAITING, needs=["fix"])])
    fake._event(tid, "ticket.created", {"principal": "ui"})
    fake.records[tid] = [pb.RunRecord(sha=sha, kind="request", envelope=envelope(sha, predicate(sha, v)),
                                      at_ms=1_700_000_100_000)]
    fake._event(tid, "record.signed", {"node": "merge", "kind": "request", "sha": sha, "keyid": KEYID,
                                       "digest": "d" * 64})
    fake._event(tid, "approval.requested", {"node": "merge", "sha": sha, "pr": "1", **({"verification": v} if v else {})})
    return tid


async def login(browser, gateway, problems):
    page = await browser.new_page(viewport={"width": 1400, "height": 1100})
    page.on("pageerror", lambda e: problems.append(str(e)))
    await page.goto(gateway.url + "/")
    await page.fill("#token", gateway.token)
    await page.click("#login-form button[type=submit]")
    await page.wait_for_selector("#nav:not([hidden])")
    return page


def approvals(fake) -> list:
    return [c for n, c in fake.calls if n == "ApproveTicket"]


async def test_r41_approval_panel_offers_only_what_the_verification_allows(gateway, scheduler, artifacts_dir):
    from playwright.async_api import async_playwright

    fake = scheduler.fake
    failed_sha, harness_sha, passed_sha = "1" * 40, "2" * 40, "3" * 40
    failed = verification(failed_sha, passed=False, ran=0, harness=["conftest.py"],
                          reasons=["ran no test", "ran 0 tests, fewer than the base's own run (5)"],
                          binary=["__pycache__/calc.cpython-311.pyc"], shadowing=["unittest/"])
    ids = {
        "failed": scheduler.run(waiting_ticket, fake, "cheats", failed_sha, failed),
        "harness": scheduler.run(waiting_ticket, fake, "changes the harness", harness_sha,
                                 verification(harness_sha, passed=True, ran=5, harness=["pytest.ini", HOSTILE])),
        "passed": scheduler.run(waiting_ticket, fake, "honest", passed_sha, verification(passed_sha, passed=True, ran=6)),
    }
    problems: list[str] = []
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = await login(browser, gateway, problems)

            # A failed verification: why, and follow-up / reject, never a green Approve.
            await page.goto(f"{gateway.url}/#/t/{ids['failed']}")
            await page.wait_for_selector("#approve-blocked")
            assert await page.locator("#approve, #approve-harness").count() == 0
            assert "verification failed" in await page.text_content("#approve-blocked")
            badge = page.locator("#approval-panel #verification")
            assert await badge.get_attribute("data-passed") == "false"
            text = await page.text_content("#verification-text")
            assert "verification failed: ran no test" in text, text
            assert re.search(r"merged onto main at b{12}\b", await page.text_content("#verify-base"))
            row = await page.text_content("#verify-commands tbody tr")
            assert "python3 -m unittest" in row and "exit 0" in row and "1.2 s" in row and "0 tests" in row, row
            assert "The base's own run: 5 tests" in await page.text_content("#verify-tests")
            assert "ran no test" in await page.text_content("#verify-reasons")
            assert await page.text_content("#harness-files") == "conftest.py"
            assert await page.text_content("#binary-list") == "__pycache__/calc.cpython-311.pyc"
            assert await page.text_content("#shadowing-list") == "unittest/"
            await page.screenshot(path=str(artifacts_dir / "ui-r41-approval-failed.png"), full_page=True)
            await page.fill("#followup-text", "fix add(), not the tests")
            await page.click("#followup")
            await page.wait_for_selector('#ticket-state[data-state="running"]')
            sent = [c for n, c in fake.calls if n == "FollowUpTicket"][-1]
            assert (sent.id, sent.instruction) == (ids["failed"], "fix add(), not the tests")
            assert not approvals(fake)

            # A harness change: a separate, clearly worded action listing the files (text, never markup).
            await page.goto(f"{gateway.url}/#/t/{ids['harness']}")
            await page.wait_for_selector("#approve-harness")
            assert await page.locator("#approve").count() == 0
            assert await page.text_content("#approve-harness") == "Accept harness change and approve"
            files = await page.locator("#harness-files li").all_text_contents()
            assert files == ["pytest.ini", HOSTILE]
            assert await page.locator("#approval-panel img").count() == 0
            await page.screenshot(path=str(artifacts_dir / "ui-r41-approval-harness.png"), full_page=True)
            await page.click("#approve-harness")
            await page.wait_for_selector('#ticket-state[data-state="succeeded"]')
            call = approvals(fake)[-1]
            assert (call.id, call.sha, call.accept_harness_change) == (ids["harness"], harness_sha, True)

            # Positive control: a head that passed without harness changes gets the plain Approve.
            await page.goto(f"{gateway.url}/#/t/{ids['passed']}")
            await page.wait_for_selector("#approve")
            assert await page.locator("#approve-harness, #approve-blocked").count() == 0
            assert "6 tests: 6 passed" in await page.text_content("#verification-text")
            await page.click("#approve")
            await page.wait_for_selector('#ticket-state[data-state="succeeded"]')
            call = approvals(fake)[-1]
            assert (call.id, call.sha, call.accept_harness_change) == (ids["passed"], passed_sha, False)

            # The local forge's pull request page offers the same (its records, its diff).
            pr_sha = "4" * 40
            tid = scheduler.run(waiting_ticket, fake, "pull page", pr_sha,
                                verification(pr_sha, passed=False, ran=0, reasons=["ran no test"]))
            def own_pr():
                fake.tickets[tid].pr.number = "77"
            scheduler.run(own_pr)
            await page.goto(f"{gateway.url}/pulls/demo/77")
            await page.wait_for_selector("#approve-blocked")
            assert await page.locator("#approve, #approve-harness").count() == 0
            # A reviewer's typing survives the page's refreshes (every 2 s: the control counts them).
            await page.evaluate("""() => { window.__renders = 0; new MutationObserver(() => window.__renders++)
                .observe(document.getElementById('pull-meta'), { childList: true }); }""")
            await page.click("#followup-text")
            await page.keyboard.type("half a thought")
            await page.wait_for_function("() => window.__renders >= 2", timeout=10_000)
            assert await page.input_value("#followup-text") == "half a thought"
            assert await page.evaluate("() => document.activeElement.id") == "followup-text"
            assert not problems, problems
        finally:
            await browser.close()


async def test_approval_waits_for_the_diff_it_is_about(gateway, scheduler, artifacts_dir):
    """Issue 35: the first view asked for approval while the diff still said "(no changes yet)"
    (the diff arrives after the state; a slow or failed fetch left the placeholder for good)."""
    from playwright.async_api import async_playwright

    fake = scheduler.fake
    sha = "5" * 40
    gate = scheduler.call(_event())
    fake.diff_gate = gate
    problems: list[str] = []
    try:
        tid = scheduler.run(waiting_ticket, fake, "slow diff", sha, None)
        before = fake.diff_calls
        async with async_playwright() as p:
            browser = await p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
            try:
                page = await login(browser, gateway, problems)
                await page.goto(f"{gateway.url}/#/t/{tid}")
                await page.wait_for_selector("#approve-wait")
                # Control: the page is where the defect showed: waiting for approval, the diff asked and
                # not answered yet.
                assert await page.get_attribute("#ticket-state", "data-state") == "waiting_approval"
                assert fake.diff_calls > before
                await asyncio.sleep(1.0)
                assert await page.locator("#approve").count() == 0
                assert await page.text_content("#diff") == "(loading the diff…)"
                assert "Loading the diff" in await page.text_content("#approve-wait")
                scheduler.run(gate.set)
                await page.wait_for_selector("#approve")
                assert "return a + b" in await page.text_content("#diff")
                assert "no verify" in await page.text_content("#no-verify")
                assert not problems, problems
            finally:
                await browser.close()
    finally:
        fake.diff_gate = None
        scheduler.run(gate.set)


async def _event() -> asyncio.Event:
    return asyncio.Event()


async def test_r42_signed_run_records_are_decoded_readably(gateway, scheduler, artifacts_dir):
    from playwright.async_api import async_playwright

    fake = scheduler.fake
    sha = "6" * 40
    v = {**verification(sha, passed=True, ran=5, harness=[HOSTILE]), "omitted": {"harness_changes": 3}}
    tid = scheduler.run(waiting_ticket, fake, "records", sha, v)
    decision = {"principal": "ui", "granted": True, "sha": sha, "at_ms": 1_700_000_200_000, "reason_sha256": "",
                "accepted_harness_change": [HOSTILE]}

    decided_predicate = predicate(sha, v, decision)
    decided_predicate["agents"] = [{"name": "coder", "preset": "claude-code", "version": "2.0.1", "package": "pkg",
                                    "image": "afe/agent-claude", "model": "claude", "env_names": ["NPM_CONFIG_X"]}]

    def decided():
        fake.records[tid].append(pb.RunRecord(sha=sha, kind="decision",
                                              envelope=envelope(sha, decided_predicate),
                                              at_ms=1_700_000_200_000))
        fake.records[tid].append(pb.RunRecord(sha=sha, kind="decision-2", envelope='{"payload": "not base64!"}',
                                              at_ms=1_700_000_300_000))
        fake.set_state(tid, pb.TICKET_STATE_SUCCEEDED)
    scheduler.run(decided)
    problems: list[str] = []
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = await login(browser, gateway, problems)
            await page.goto(f"{gateway.url}/#/t/{tid}")
            await page.wait_for_selector("#records details.record[data-kind='decision']")
            assert await page.locator("#records details.record").count() == 3
            for d in await page.locator("#records details.record summary").all():
                await d.click()
            rec = page.locator("#records details.record[data-kind='decision']")
            text = await rec.text_content()
            assert f"signed by key {KEYID}" in text
            assert "afe verify t" in text
            nodes = await rec.locator("[data-part='rec-nodes'] tbody tr").all_text_contents()
            assert nodes[1] == "testrun—succeeded21", nodes
            assert await rec.locator("[data-part='rec-egress-allowed'] tbody tr").all_text_contents() == ["pypi.org7"]
            assert await rec.locator("[data-part='rec-egress-denied'] tbody tr").all_text_contents() == ["evil.example3"]
            assert "python3 -m unittest -v1, 0" in await rec.locator("[data-part='rec-commands']").text_content()
            usage = await rec.locator("[data-part='rec-usage'] tbody tr").all_text_contents()
            assert usage[-1] == "total2900100$0.0000", usage
            assert "Approved by ui on 666666666666" in text
            assert f"Acknowledged harness changes: {HOSTILE}" in text
            assert "Left out (lists are bounded): 3 more harness changes." in text
            assert "claude-code2.0.1afe/agent-claudeclaudeNPM_CONFIG_X" in text
            assert "verification passed: 1 command, 5 tests: 5 passed (tests/ from main)" in text
            # Readable, never the JSON; record text never becomes markup.
            assert '"predicate"' not in text and "{" not in text
            assert await page.locator("#records img").count() == 0
            bad = await page.text_content("#records details.record[data-kind='decision-2']")
            assert "cannot be read: its payload is not base64-encoded JSON" in bad
            await page.screenshot(path=str(artifacts_dir / "ui-r42-run-record.png"), full_page=True)
            assert not problems, problems
        finally:
            await browser.close()


# Where the scheduler writes events: ctx.emit("x.y", …), events.append(tid, "x.y", …), _note/_event(…),
# ("x.y", {…}) tuples given to transitions, `return "x.y", {…}` (ACP updates) and EVENT constants.
EMITS = [re.compile(r'(?:emit|record|chunk|append|make|_note|_event|_record)\(\s*(?:[\w.]+,\s*)?"([a-z_]+\.[a-z_]+)"'),
         re.compile(r'(?:\(|return)\s*"([a-z_]+\.[a-z_]+)",\s*\{'),
         re.compile(r'^\w*EVENT\s*=\s*"([a-z_]+\.[a-z_]+)"', re.MULTILINE)]


def scheduler_event_types() -> set[str]:
    found: set[str] = set()
    for path in (ROOT / "services" / "scheduler").rglob("*.py"):
        text = path.read_text()
        for rx in EMITS:
            found.update(rx.findall(text))
    return found


SAMPLES = {
    "node.prompt_digest": ({"node": "fix", "sha256": "ab" * 32, "bytes": 1200}, "SHA-256 abababababab… of 1200 bytes"),
    "record.signed": ({"node": "merge", "kind": "request", "sha": "7" * 40, "keyid": "k1", "digest": "d"},
                      "run record signed (request) for 777777777777, key k1"),
    "record.unattached": ({"node": "merge", "sha": "7" * 40, "message": "GitHub said no"}, "GitHub said no"),
    "egress.denied": ({"node": "pr", "hosts": [{"host": "evil.example", "count": 2}], "truncated": True},
                      "evil.example (2 times) and more hosts"),
    "verification.error": ({"node": "merge", "sha": "7" * 40, "message": "the sandbox died"},
                           "could not run: the sandbox died (not a verdict; Retry runs it again)"),
    "verification.finished": ({"node": "merge", **verification("7" * 40, passed=True, ran=5)},
                              ("verification passed: 1 command, 5 tests: 5 passed (tests/ from main) on 777777777777, "
                               "merged onto main at bbbbbbbbbbbb")),
    "approval.granted": ({"principal": "ui", "sha": "7" * 40, "accepted_harness_change": ["conftest.py"]},
                         "approved 777777777777 by ui and accepted the harness change (conftest.py)"),
    "events.lost": ({"count": 3, "types": {"node.output": 3}, "reason": "the store did not answer"},
                    "3 events not stored (3 node.output): the store did not answer"),
    "ci.rounds_exhausted": ({"sha": "7" * 40, "rounds": 2, "max": 2, "checks": [{"name": "lint"}]},
                            "CI still fails on 777777777777 (lint) after 2 of 2 rounds"),
    "ticket.takeover": ({"scheduler": "s2", "state": "waiting_approval"}, "taken over by scheduler s2"),
    "node.attempt": ({"node": "edit", "attempt": 2, "previous": 1, "reason": "taken over",
                      "previous_scheduler": "s1", "scheduler": "s2"}, "attempt 2 starts (attempt 1 was interrupted"),
    "workspace.checkpoint": ({"after": "edit", "sha": "0123456789abcdef"}, "workspace kept after edit"),
    "workspace.restored": ({"after": "", "attempt": 2, "restored": True, "sha": "0123456789abcdef"},
                           "workspace back to its state after the branch head"),
}


async def test_every_scheduler_event_has_a_readable_line(gateway, scheduler):
    from playwright.async_api import async_playwright

    types = scheduler_event_types()
    # the source scan finds the emitters of each kind (a scan that found nothing would check nothing)
    assert {"node.prompt_digest", "record.signed", "approval.requested", "ci.failed", "egress.denied",
            "agent.tool_call", "ticket.takeover", "verification.error"} <= types, types
    problems: list[str] = []
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = await login(browser, gateway, problems)
            result = await page.evaluate("""async ([types, samples]) => {
              const m = await import("/static/events.js");
              const lines = {};
              for (const [t, [payload]] of Object.entries(samples)) lines[t] = m.eventLine({ type: t, payload }).text;
              const unknown = m.eventLine({ type: "x.unknown", payload: { node: "n", a: { b: 1 }, list: [1, 2], s: "word" } }).text;
              return { missing: types.filter((t) => !m.DESCRIBED.has(t)), lines, unknown };
            }""", [sorted(types), SAMPLES])
            assert result["missing"] == [], f"no readable line in gateway/static/events.js for {result['missing']}"
            for t, (_, expected) in SAMPLES.items():
                assert expected in result["lines"][t], (t, result["lines"][t])
                assert "{" not in result["lines"][t], (t, result["lines"][t])
            # An event type the page does not know yet: its fields in words (positive control of the check above:
            # such a type is not DESCRIBED).
            assert result["unknown"] == "[n] x.unknown — a: 1 field; list: 1, 2; s: word", result["unknown"]
            assert not problems, problems
        finally:
            await browser.close()


async def test_newcomer_board_demo_button_and_test_output(gateway, scheduler, artifacts_dir):
    from playwright.async_api import async_playwright

    fake = scheduler.fake
    kept = scheduler.run(lambda: dict(fake.tickets))
    scheduler.run(fake.tickets.clear)
    fake.workflows = [pb.Workflow(name="fix-it", workspace="mine", nodes=[pb.WorkflowNode(id="fix", kind="model")]),
                      pb.Workflow(name="review", workspace="mine")]
    problems: list[str] = []
    try:
        async with async_playwright() as p:
            browser = await p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
            try:
                # One's own config: no "Run the demo"; the empty board says what to do.
                page = await login(browser, gateway, problems)
                await page.wait_for_selector("#board-empty")
                assert await page.is_hidden("#run-demo")
                assert await page.text_content("#hint-cli") == 'afe ticket create --workflow fix-it --title "what to change"'
                hint = await page.text_content("#board-empty")
                assert "New ticket" in hint and "Run the demo" not in hint and "fix-it, review" in hint
                await page.screenshot(path=str(artifacts_dir / "ui-board-empty.png"), full_page=True)
                await page.close()

                # Positive control: the demo configured: the button is there, and the hint names it.
                fake.workflows = None
                page = await login(browser, gateway, problems)
                await page.wait_for_selector("#board-empty")
                await page.wait_for_selector("#run-demo:not([hidden])")
                assert "Run the demo" in await page.text_content("#board-empty")

                # Test output: a box of its content's size; long output scrolls in a capped one.
                short, long_ = "test_add ... ok\n\nOK", "\n".join(f"line {i}" for i in range(300))

                def ended():
                    fake._n += 1
                    tid = f"o{fake._n}"
                    fake.tickets[tid] = pb.Ticket(id=tid, workspace="demo", workflow="demo-fix", title="output",
                                                  state=pb.TICKET_STATE_SUCCEEDED, nodes=[
                        pb.NodeRun(id="short", kind="run", state=pb.NODE_STATE_SUCCEEDED, output=short),
                        pb.NodeRun(id="long", kind="run", state=pb.NODE_STATE_SUCCEEDED, output=long_)])
                    fake._event(tid, "ticket.finished", {"state": "succeeded"})
                    return tid
                tid = scheduler.run(ended)
                await page.goto(f"{gateway.url}/#/t/{tid}")
                await page.wait_for_selector('#test-output pre[data-node="long"]')
                size = await page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('#test-output pre')]
                    .map((e) => [e.dataset.node, [e.clientHeight, e.scrollHeight, parseFloat(getComputedStyle(e).lineHeight) || 16]]))""")
                h_short, sh_short, _ = size["short"]
                h_long, sh_long, _ = size["long"]
                assert sh_short <= h_short + 1 and h_short < 120, size       # fits, no empty space
                assert sh_long > h_long and 300 < h_long < 400, size          # capped at 22rem, scrolls
                assert not problems, problems
            finally:
                await browser.close()
    finally:
        fake.workflows = None
        scheduler.run(lambda: fake.tickets.update(kept))
