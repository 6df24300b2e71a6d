"""The web UI in Debian's Chromium (headless, via Playwright; never a
downloaded browser) against the running system: log in, run the demo, watch
the graph and the log update live, approve, see it merged."""

from __future__ import annotations

import re

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.docker, pytest.mark.timeout(300)]

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--no-first-run"]

# Records, in the page, every node state the graph has shown.
RECORDER = """() => {
  window.__seen = new Set(); window.__logLines = [];
  const snap = () => {
    for (const g of document.querySelectorAll('#graph g.node')) window.__seen.add(g.dataset.node + ':' + g.dataset.state);
    const logs = document.getElementById('logs');
    if (logs) window.__logLines.push(logs.childElementCount);
  };
  new MutationObserver(snap).observe(document.getElementById('app'), {subtree: true, childList: true, attributes: true});
  snap();
}"""


async def test_ui_login_demo_live_graph_approve_merged(live_afe, artifacts_dir):
    from playwright.async_api import async_playwright

    gw = live_afe.gateway
    live_afe.reset_demo_repo()
    problems: list[str] = []
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = await browser.new_page(viewport={"width": 1400, "height": 1100})
            page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(str(e)))

            await page.goto(gw.url + "/")
            await page.wait_for_selector("#login-form")
            await page.fill("#token", "wrong-token-for-the-test")
            await page.click("#login-form button[type=submit]")
            await page.wait_for_selector("#login-note.error")
            problems.clear()  # the 401 of the wrong login is logged by the browser on purpose
            await page.fill("#token", gw.token)
            await page.click("#login-form button[type=submit]")
            await page.wait_for_selector("#board")
            cookies = await page.context.cookies()
            session = [c for c in cookies if c["name"] == "afe_session"]
            assert session and session[0]["httpOnly"] and session[0]["sameSite"] == "Strict"
            assert await page.evaluate("document.cookie") == ""  # HttpOnly: not visible to scripts

            await page.evaluate("window.__marker = 'same page'")
            await page.evaluate(RECORDER)  # before the click: #app outlives hash navigation
            await page.click("#run-demo")
            await page.wait_for_url(re.compile(r".*#/t/[a-z0-9-]+$"))
            await page.wait_for_selector("#graph g.node")
            ticket_id = page.url.rsplit("/", 1)[1]

            await page.wait_for_selector("#approve", timeout=180_000)
            await page.wait_for_selector('#graph g.node[data-node="merge"][data-state="waiting"]')
            await page.wait_for_function("() => document.querySelectorAll('#tools li').length >= 4")
            await page.wait_for_function("() => document.getElementById('diff').textContent.includes('return a + b')")
            seen = set(await page.evaluate("[...window.__seen]"))
            log_counts = await page.evaluate("window.__logLines")
            # Live: the graph changed state under our eyes, and the log grew, on the same page.
            assert {"test:succeeded", "pr:succeeded", "merge:waiting"} <= seen, seen
            assert seen & {"fix:pending", "fix:running", "test:pending", "test:running", "pr:running"}, seen
            assert max(log_counts) > min(log_counts) and max(log_counts) >= 10, log_counts
            assert await page.text_content("#ticket-state") == "waiting approval"
            # Other tests on the same live system open PRs too: the number is
            # whatever the forge gave, shown consistently in the text and the link.
            # The local forge's pull request is a link to its page on this gateway.
            pr_text = await page.text_content("#pr-link")
            pr_href = await page.get_attribute("#pr-link", "href")
            m = re.fullmatch(r"#(\d+)", pr_text.strip())
            assert m and pr_href == f"{gw.url}/pulls/demo/{m.group(1)}", (pr_text, pr_href)
            await page.screenshot(path=str(artifacts_dir / "ui-ticket-waiting.png"), full_page=True)

            await page.click("#approve")
            await page.wait_for_selector('#ticket-state[data-state="succeeded"]', timeout=120_000)
            await page.wait_for_selector('#graph g.node[data-node="merge"][data-state="succeeded"]')
            await page.wait_for_function("() => document.getElementById('pr').textContent.includes('merged')")
            assert "approved by ui" in (await page.text_content("#approval"))
            assert await page.evaluate("window.__marker") == "same page"
            await page.screenshot(path=str(artifacts_dir / "ui-ticket-merged.png"), full_page=True)

            await page.goto(gw.url + "/#/")
            await page.wait_for_selector(f'.col-succeeded [data-ticket="{ticket_id}"]')
            await page.screenshot(path=str(artifacts_dir / "ui-board.png"), full_page=True)
            # The create form: a ticket with a title and body, then cancelled from its page.
            await page.click("nav a[href='#/new']")
            await page.wait_for_selector("#new-form")
            await page.select_option("#f-workflow", "demo-fix")
            await page.select_option("#f-workspace", "demo")
            await page.fill("#f-title", "made with the form")
            await page.fill("#f-body", "body text <b>not html</b>")
            await page.click("#new-form button[type=submit]")
            await page.wait_for_url(re.compile(r".*#/t/[a-z0-9-]+$"))
            await page.wait_for_selector("#cancel")
            assert await page.text_content("#ticket-body") == "body text <b>not html</b>"  # text, never markup
            await page.click("#cancel")
            await page.wait_for_selector('#ticket-state[data-state="cancelled"]', timeout=60_000)

            # Rotating the token ends this browser session at once: the open socket
            # is closed (4401) and the page asks for a login again.
            from services.common.secrecy.tokenfile import write_token_file

            write_token_file(gw.token_file)
            await page.wait_for_selector("#login-form", timeout=30_000)
            assert "session ended" in (await page.text_content("#login-note"))

            # R21: neither the session cookie nor the token reached the gateway's log.
            logs = gw.logs()
            assert "login from" in logs  # control: the log was captured
            assert session[0]["value"] not in logs and gw.token not in logs
            csp = [m for m in problems if "Content Security Policy" in m]
            assert not csp, csp
            assert not problems, problems
        finally:
            await browser.close()


async def test_ui_retry_reruns_a_failed_ticket_and_the_local_pr_page_approves_and_merges(live_afe, artifacts_dir):
    """A rejected demo ticket (failed, its pull request open) is run again with
    the Retry button; its pull request's page on the gateway shows the diff,
    the state and the approval; approving there merges."""
    from playwright.async_api import async_playwright

    gw = live_afe.gateway
    live_afe.reset_demo_repo()
    problems: list[str] = []
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = await browser.new_page(viewport={"width": 1400, "height": 1100})
            page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(str(e)))
            await page.goto(gw.url + "/")
            await page.fill("#token", gw.token)
            await page.click("#login-form button[type=submit]")
            await page.wait_for_selector("#board")
            problems.clear()  # the 401 of the session check before the login is logged by the browser on purpose

            await page.click("#run-demo")
            await page.wait_for_url(re.compile(r".*#/t/[a-z0-9-]+$"))
            await page.wait_for_selector("#approve", timeout=180_000)
            await page.fill("#reject-reason", "try again")
            await page.click("#reject")
            await page.wait_for_selector('#ticket-state[data-state="failed"]', timeout=60_000)
            # The records of the ended ticket: the test output, the usage and the stored diff.
            await page.wait_for_function("() => document.getElementById('diff').textContent.includes('stored when')")
            assert "OK" in await page.text_content('#test-output pre[data-node="test"]')
            assert re.fullmatch(r"usage: [1-9][0-9]* model tokens", await page.text_content("#usage"))

            await page.click("#retry")
            await page.wait_for_selector('#ticket-state[data-state="waiting_approval"]', timeout=180_000)
            await page.wait_for_selector('#graph g.node[data-node="merge"][data-state="waiting"]')
            assert "ticket re-opened (retry)" in await page.text_content("#logs")
            await page.screenshot(path=str(artifacts_dir / "ui-ticket-retried.png"), full_page=True)

            await page.click("#pr-link")
            await page.wait_for_url(re.compile(r".*/pulls/demo/[0-9]+$"))
            await page.wait_for_selector('#pull-state[data-state="open"]')
            await page.wait_for_function("() => document.getElementById('diff').textContent.includes('return a + b')")
            assert "Fix add()" in await page.text_content("#pull-title")
            await page.screenshot(path=str(artifacts_dir / "ui-pull-request.png"), full_page=True)
            await page.click("#approve")
            await page.wait_for_selector('#pull-state[data-state="merged"]', timeout=120_000)
            assert "approved by ui" in await page.text_content("#approval")
            await page.click("#pull-ticket")
            await page.wait_for_selector('#ticket-state[data-state="succeeded"]', timeout=60_000)
            assert not problems, problems
        finally:
            await browser.close()
