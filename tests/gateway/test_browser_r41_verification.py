"""R41 in the web UI (Debian's Chromium, headless, via Playwright) against
the real system: the approval panel of a ticket waiting for approval says
whether the head's clean-room verification passed — failed (with the command,
its exit code and the base paths) for a model that weakened the test, and then
no Approve is offered (why, follow-up, reject); passed, with the Approve
button, for the positive control without base paths."""

from __future__ import annotations

import pytest

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services.common.layout import Layout
from services.common.secrecy.tokenfile import write_token_file
from tests.scheduler.conftest import state_name, wait_for_state
from tests.scheduler.executor.test_r41_clean_room_verification import CONFIG, UNITTEST, setup
from tests.support.system import afe_system

from .conftest import start_gateway
from .test_browser import ARGS, CHROMIUM

pytestmark = [pytest.mark.browser, pytest.mark.docker, pytest.mark.timeout(300)]


async def test_r41_ui_shows_the_verification_badge_next_to_approve(short_tmp, artifacts_dir):
    from playwright.async_api import async_playwright

    cfg = setup(short_tmp, "cheat", "base_paths: [tests/]")
    workflow = CONFIG.split("---\n", 1)[1] % {"name": "trusting", "unittest": UNITTEST, "base_paths": ""}
    (cfg / "trusting.yaml").write_text(workflow)
    layout = Layout(short_tmp / "data", short_tmp / "run")
    layout.ensure()
    write_token_file(layout.token_file)
    async with afe_system(cfg, layout) as sys_:
        gw = start_gateway(layout, sys_.gateway_secret, config_dir=cfg)
        try:
            ids = {}
            for wf in ("cheat", "trusting"):
                t = await sys_.stub.CreateTicket(pb.CreateTicketRequest(workflow=wf, title="fix add"))
                ids[wf] = t.id
            for tid in ids.values():
                t = await wait_for_state(sys_.stub, tid, {"waiting_approval", "failed"})
                assert state_name(t) == "waiting_approval", t.error
            problems: list[str] = []
            async with async_playwright() as p:
                browser = await p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
                try:
                    page = await browser.new_page(viewport={"width": 1400, "height": 1000})
                    page.on("pageerror", lambda e: problems.append(str(e)))
                    await page.goto(gw.url + "/")
                    await page.wait_for_selector("#login-form")
                    await page.fill("#token", gw.token)
                    await page.click("#login-form button[type=submit]")
                    await page.wait_for_selector("#board")

                    await page.goto(f"{gw.url}/#/t/{ids['cheat']}")
                    badge = await page.wait_for_selector("#approval-panel #verification", timeout=60_000)
                    assert await badge.get_attribute("data-passed") == "false"
                    assert "verify-failed" in (await badge.get_attribute("class") or "")
                    text = await page.text_content("#verification-text") or ""
                    assert "verification failed" in text
                    assert f"{UNITTEST} exited 1 (tests/ from main)" in text, text
                    # no Approve for it: why, and the follow-up and reject instead
                    assert await page.locator("#approve, #approve-harness").count() == 0
                    assert "Approving is not offered" in (await page.text_content("#approve-blocked") or "")
                    assert await page.locator("#followup").count() == 1 and await page.locator("#reject").count() == 1
                    await page.wait_for_function(
                        "() => document.getElementById('logs').textContent.includes('AssertionError: -1 != 5')")
                    await page.screenshot(path=str(artifacts_dir / "ui-r41-verification-failed.png"),
                                          full_page=True)

                    await page.goto(f"{gw.url}/#/t/{ids['trusting']}")        # positive control
                    await page.wait_for_selector('#approval-panel #verification[data-passed="true"]', timeout=60_000)
                    assert "verified" in (await page.text_content("#verification") or "")
                    text = await page.text_content("#verification-text") or ""
                    assert "verification passed: 2 commands" in text, text
                    assert await page.locator("#approve").count() == 1
                    assert not problems, problems
                finally:
                    await browser.close()
        finally:
            gw.stop()
