"""R40 at the UI/CLI surface, through the real gateway process: failed
bearer tokens and logins from an address are counted (past the budget a
wrong token gets 429 with Retry-After, R38), but the RIGHT token from the
same address still opens /rpc and logs in, so nobody can lock the owner out
by failing on purpose (another local process, or anyone behind the same
reverse proxy, shares the address).

The positive control runs the gateway with the old order put back
(tests/gateway/old_lockout.py: the limiter asked before the token is
checked) and shows the lockout: the right token refused 429."""

from __future__ import annotations

import pytest

from services.cli.rpc_client import EXIT_CONNECT, CliError, RpcClient

from .conftest import start_gateway
from .rpcutil import login, open_rpc

pytestmark = pytest.mark.timeout(120)

BUDGET = 3


def _gateway(gw_layout, link_secret, module: str = "gateway.main"):
    return start_gateway(gw_layout, link_secret, extra=["--max-failed-logins", str(BUDGET)], module=module)


@pytest.fixture
def gateway_r40(gw_layout, link_secret, scheduler):
    g = _gateway(gw_layout, link_secret)
    yield g
    g.stop()


@pytest.fixture
def old_gateway(gw_layout, link_secret, scheduler):
    g = _gateway(gw_layout, link_secret, module="tests.gateway.old_lockout")
    yield g
    g.stop()


async def _use_up_the_budget(http, gw) -> None:
    for i in range(BUDGET):
        status, _ = await open_rpc(http, gw, bearer=f"wrong-token-{i}")
        assert status == 401, i
    status, ws = await open_rpc(http, gw, bearer="wrong-again")
    assert status == 429 and ws is None                      # the address is past its budget


async def test_r40_the_right_token_passes_after_failures_from_its_address(http, gateway_r40):
    gw = gateway_r40
    await _use_up_the_budget(http, gw)
    status, ws = await open_rpc(http, gw, bearer=gw.token)
    assert status == 101
    await ws.close()
    assert (await login(http, gw, gw.token)).status == 200
    # Wrong tokens are still limited, and each one keeps the address over its budget.
    limited = await login(http, gw, "still-wrong")
    assert limited.status == 429 and 1 <= int(limited.headers["Retry-After"]) <= 61
    assert "check the token" in (await limited.json())["error"]
    assert (await open_rpc(http, gw, bearer="wrong-once-more"))[0] == 429
    status, ws = await open_rpc(http, gw, bearer=gw.token)
    assert status == 101
    await ws.close()


async def test_r40_positive_control_the_old_order_locks_the_right_token_out(http, old_gateway):
    gw = old_gateway
    await _use_up_the_budget(http, gw)
    status, ws = await open_rpc(http, gw, bearer=gw.token)
    assert status == 429 and ws is None
    assert (await login(http, gw, gw.token)).status == 429


async def test_r40_failures_beyond_the_budget_are_not_logged_one_by_one(http, gateway_r40):
    gw = gateway_r40
    await _use_up_the_budget(http, gw)
    for i in range(20):
        assert (await open_rpc(http, gw, bearer=f"flood-{i}"))[0] == 429
    assert gw.logs().count("failed bearer token from") == BUDGET


async def test_r40_the_cli_says_its_token_is_wrong_when_the_address_is_over_its_budget(http, gateway_r40):
    gw = gateway_r40
    await _use_up_the_budget(http, gw)
    with pytest.raises(CliError) as refused:
        async with RpcClient(gw.url, "wrong-token-from-the-cli"):
            pass
    assert "refused the token, and many wrong tokens came from this address" in str(refused.value)
    assert refused.value.exit_code == EXIT_CONNECT
    async with RpcClient(gw.url, gw.token) as client:           # the right token still gets in
        assert client is not None
