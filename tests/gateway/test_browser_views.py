"""The ticket page's views in Debian's Chromium (headless, via Playwright)
against the real gateway and a fake scheduler on a Unix socket: the
new-ticket form's workflow inputs, tokens and estimated cost per node, the
prompt a model node received, readable event lines, the graph's click filter,
multi-line errors preformatted, and the banner when the connection drops
and comes back."""

from __future__ import annotations

import re

import pytest

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb

from . import conftest as gwconf
from .test_browser import ARGS, CHROMIUM

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]

EVENTS = [
    ("node.started", {"node": "fix", "kind": "model", "attempt": 2}),
    ("node.prompt", {"node": "fix", "model": "claude", "system": "You are a coding assistant.",
                     "prompt": "Fix add() <b>now</b>\nsecond line", "truncated": False}),
    ("model.usage", {"node": "fix", "model": "claude", "input_tokens": 1000, "output_tokens": 200,
                     "cost_usd": 0.0123}),
    ("model.usage", {"node": "merge", "model": "free", "input_tokens": 7, "output_tokens": 3}),
    ("agent.permission", {"node": "fix", "kind": "edit", "title": "edit calc.py", "decision": "allow"}),
    ("node.feedback", {"node": "fix", "round": 1, "max": 2, "to": "fix"}),
    ("node.output", {"node": "merge", "stream": "stdout", "text": "merging"}),
    ("node.finished", {"node": "fix", "state": "failed", "attempt": 2, "error": "exit 1:\nFAILED test_add"}),
]


async def test_ticket_page_views_and_connection_banner(gw_layout, link_secret, scheduler, artifacts_dir):
    from playwright.async_api import async_playwright

    gw = gwconf.start_gateway(gw_layout, link_secret, extra=["--max-failed-logins", "1000"])
    problems: list[str] = []
    try:
        async with async_playwright() as p:
            browser = await p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
            try:
                page = await browser.new_page(viewport={"width": 1400, "height": 1100})
                page.on("pageerror", lambda e: problems.append(str(e)))
                await page.goto(gw.url + "/")
                await page.fill("#token", gw.token)
                await page.click("#login-form button[type=submit]")
                await page.wait_for_selector("#board")

                # The form shows the workflow's inputs: required marked, defaults pre-filled; they are sent.
                await page.click("nav a[href='#/new']")
                await page.wait_for_selector("#f-inputs input[data-input='issue']")
                assert await page.get_attribute("#f-inputs input[data-input='issue']", "required") is not None
                assert await page.get_attribute("#f-inputs input[data-input='level']", "required") is None
                assert await page.input_value("#f-inputs input[data-input='level']") == "high"
                await page.fill("#f-title", "with inputs")
                await page.fill("#f-inputs input[data-input='issue']", "42")
                await page.click("#new-form button[type=submit]")
                await page.wait_for_url(re.compile(r".*#/t/[a-z0-9-]+$"))
                tid = page.url.rsplit("/", 1)[1]
                created = [c for n, c in scheduler.fake.calls if n == "CreateTicket"][-1]
                assert dict(created.inputs) == {"issue": "42", "level": "high"}

                for typ, payload in EVENTS:
                    scheduler.run(scheduler.fake._event, tid, typ, payload)

                # Tokens and cost per node and for the ticket; an unpriced model is said to be so.
                await page.wait_for_selector("#cost tr[data-node='merge']")
                fix_row = await page.text_content("#cost tr[data-node='fix']")
                assert "1000" in fix_row and "200" in fix_row and "$0.0123" in fix_row, fix_row
                assert "unknown" in await page.text_content("#cost tr[data-node='merge']")
                total = await page.text_content("#cost tr[data-node='total']")
                assert "1007" in total and "$0.0123" in total and "unpriced" in total, total

                # The prompt block: collapsed, opens, text (never markup).
                await page.wait_for_selector("#prompts details.prompt[data-node='fix']")
                assert not await page.is_visible("#prompts .prompt-text")
                await page.click("#prompts details.prompt summary")
                assert await page.text_content("#prompts .prompt-system") == "You are a coding assistant."
                assert await page.text_content("#prompts .prompt-text") == "Fix add() <b>now</b>\nsecond line"

                # Every line readable (no JSON), attempt numbers included.
                await page.wait_for_function("() => document.querySelectorAll('#logs span[data-node]').length >= 8")
                log = await page.text_content("#logs")
                assert "started (model, attempt 2)" in log and "(attempt 2)" in log
                assert "agent asked permission for edit calc.py: allow" in log
                assert "round 1 of 2" in log and "~$0.0123" in log
                assert "{" not in log, log

                # Clicking a graph node filters the log to it; again clears the filter.
                await page.click('#graph g.node[data-node="fix"]')
                await page.wait_for_selector("#log-filter:not([hidden])")
                assert not await page.is_visible('#logs span[data-type="node.output"]')
                assert await page.is_visible('#logs span[data-type="node.prompt"]')
                await page.click('#graph g.node[data-node="fix"]')
                await page.wait_for_selector("#log-filter", state="hidden")
                assert await page.is_visible('#logs span[data-type="node.output"]')

                # A multi-line error is preformatted.
                def fail():
                    t = scheduler.fake.tickets[tid]
                    t.error = "the command exited with code 1:\nFAILED test_add\nassert -1 == 5"
                    scheduler.fake.set_state(tid, pb.TICKET_STATE_FAILED)
                scheduler.run(fail)
                await page.wait_for_selector("#ticket-error:not([hidden])")
                assert await page.evaluate("document.getElementById('ticket-error').tagName") == "PRE"
                assert (await page.inner_text("#ticket-error")).splitlines()[1:] == ["FAILED test_add",
                                                                                      "assert -1 == 5"]
                await page.screenshot(path=str(artifacts_dir / "ui-ticket-views.png"), full_page=True)

                # The connection drops: a clear banner; it comes back: said so, and the page is live again.
                assert not await page.is_visible("#conn-banner")
                port = gw.port
                gw.stop()
                await page.wait_for_selector('#conn-banner[data-kind="lost"]', timeout=30_000)
                assert "Connection to afe lost" in await page.text_content("#conn-banner")
                gw = gwconf.start_gateway(gw_layout, link_secret, extra=["--max-failed-logins", "1000"], port=port)
                await page.wait_for_selector('#conn-banner[data-kind="back"]', timeout=30_000)
                assert "Reconnected" in await page.text_content("#conn-banner")
                await page.wait_for_selector('#ticket-state[data-state="failed"]')
                assert not await page.is_visible("#login-form")   # a lost connection is not a lost session
                assert not problems, problems
            finally:
                await browser.close()
    finally:
        gw.stop()
