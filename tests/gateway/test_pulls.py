"""The local forge's pull-request page: `local:demo/pulls/N` becomes the
gateway's URL `/pulls/demo/N` in every ticket JSON (UI, CLI), `pulls.get`
finds the pull request's ticket through the scheduler, and the page's route
answers only to the gateway's Host (R38) with the UI's security headers; its
data comes only through /rpc (cookie with our Origin, or the bearer token)."""

from __future__ import annotations

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb

from .rpcutil import call, cookie_of, login, open_rpc, result


async def _ticket_with_pr(ws, scheduler, number: str, url: str) -> str:
    t = await result(ws, "tickets.create", {"workflow": "demo-fix", "title": "with a pull request"})

    def add_pr() -> None:
        scheduler.fake.tickets[t["id"]].pr.CopyFrom(pb.PullRequest(
            number=number, url=url, head_branch=f"afe/{t['id']}", base_branch="main", state="open"))

    scheduler.run(add_pr)
    return t["id"]


async def test_local_pr_reference_is_the_gateways_page_url_and_github_stays_a_link(http, gateway, scheduler):
    status, ws = await open_rpc(http, gateway, bearer=gateway.token)
    assert status == 101
    try:
        local = await _ticket_with_pr(ws, scheduler, "731", "local:demo/pulls/731")
        got = await result(ws, "tickets.get", {"id": local})
        assert got["pr"]["url"] == f"{gateway.origin}/pulls/demo/731"
        assert got["pr"]["ref"] == "local:demo/pulls/731"
        assert "usage" in got
        listed = await result(ws, "tickets.list", {})
        assert {t["pr"]["url"] for t in listed["tickets"] if t["id"] == local} == {f"{gateway.origin}/pulls/demo/731"}

        gh = await _ticket_with_pr(ws, scheduler, "732", "https://github.com/acme/app/pull/732")
        assert (await result(ws, "tickets.get", {"id": gh}))["pr"]["url"] == "https://github.com/acme/app/pull/732"

        assert (await result(ws, "pulls.get", {"workspace": "demo", "number": "731"}))["id"] == local
        missing = await call(ws, "pulls.get", {"workspace": "demo", "number": "99999"})
        assert missing["error"]["data"]["code"] == "not_found"
        assert "has no pull request '99999'" in missing["error"]["message"]
        bad = await call(ws, "pulls.get", {"workspace": "demo", "number": "1/../2"})
        assert bad["error"]["data"]["code"] == "invalid_params"
        assert "must be a pull request number" in bad["error"]["message"]
    finally:
        await ws.close()


async def test_the_pull_request_page_is_the_ui_and_its_data_needs_the_session(http, gateway, scheduler):
    page = await http.get(gateway.url + "/pulls/demo/731")
    assert page.status == 200 and "/static/app.js" in await page.text()
    assert "frame-ancestors 'none'" in page.headers["Content-Security-Policy"]
    assert (await http.get(gateway.url + "/pulls/demo/notanumber")).status == 404
    # R38: a foreign Host (DNS rebinding) gets nothing; control: our own Host above got the page.
    foreign = await http.get(gateway.url + "/pulls/demo/731", headers={"Host": "evil.example:80"})
    assert foreign.status == 421

    # The page's data: /rpc refuses a socket without credentials, and a cookie from another Origin (R22).
    status, _ = await open_rpc(http, gateway)
    assert status == 401
    cookie = cookie_of(await login(http, gateway, gateway.token))
    status, _ = await open_rpc(http, gateway, cookie=cookie, origin="http://evil.example")
    assert status == 403
    status, ws = await open_rpc(http, gateway, cookie=cookie, origin=gateway.origin)
    assert status == 101
    try:
        doc = await call(ws, "pulls.get", {"workspace": "demo", "number": "731"})
        assert doc["result"]["pr"]["number"] == "731", doc
    finally:
        await ws.close()
