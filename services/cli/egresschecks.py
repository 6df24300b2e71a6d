"""`afe doctor`'s checks of an egress sandbox (R10, R11), from inside it,
against the probe's target server: on runc (the ticket's internal network,
or the proxy's socket with `--egress-transport socket`) and on gVisor (always
the socket: no interface at all). The allowlist and the refusals are the
proxy's, so they must read the same whichever way the sandbox reaches it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .isolation import run_exec, run_py
from .probescripts import CONNECT, DIRECT, FETCH

if TYPE_CHECKING:
    from docker import DockerClient

    from services._gen.afe.sandbox.v1.sandbox_pb2 import Sandbox

    from .doctor_report import Report
    from .probebroker import ProbeBroker


async def egress_checks(report: Report, client: DockerClient, broker: ProbeBroker, eg: Sandbox, instance: str,
                        tname: str, tip: str, plain_mode: str, tag: str = "") -> None:
    """`eg`: the egress sandbox (the broker's Sandbox), allowed `tname` and localhost;
    `tip`: the target's address; `plain_mode`: the NetworkMode of the
    sandbox without egress (R10: it has none)."""
    ticket = eg.ticket_id
    allowed = await run_py(broker, ticket, FETCH, f"http://{tname}/")
    other = await run_py(broker, ticket, FETCH, f"http://other-{instance}.invalid/")
    report.add(f"R10 egress is an allowlist{tag}", allowed == "TARGET-OK" and other.startswith("HTTP 403")
               and plain_mode == "none",
               f"no-egress sandbox NetworkMode={plain_mode}; allowed name -> {allowed}; unlisted name -> {other}")

    literal = await run_py(broker, ticket, FETCH, f"http://{tip}/")
    # asked of the proxy (the sandbox's own loopback is not proxied, NO_PROXY): it must refuse
    _, loop = await run_exec(broker, ticket, ["env", "NO_PROXY=", "no_proxy=", "python3", "-c", FETCH,
                                              "http://localhost/"])
    port = await run_py(broker, ticket, CONNECT, f"{tname}:8080")
    tls = await run_py(broker, ticket, CONNECT, f"{tname}:443")
    direct = await run_py(broker, ticket, DIRECT, tip, "80")
    _, dns = await run_exec(broker, ticket, ["bash", "-c", f"getent hosts {tname} || echo FAILED"])
    attrs = client.api.inspect_container(eg.container_id)
    mode = attrs["HostConfig"]["NetworkMode"]
    # label afe.egress=socket: egress through the proxy's socket, no interface (the broker's mark)
    if (attrs["Config"]["Labels"] or {}).get("afe.egress") == "socket":
        wired = mode == "none" and not eg.network
        wiring = f"no interface (NetworkMode={mode}), the proxy through its socket"
    else:
        wired = mode == eg.network and client.api.inspect_network(eg.network)["Internal"]
        wiring = f"internal network {eg.network}"
    ok11 = (literal == "HTTP 403" and loop == "HTTP 403" and "403" in port and "200" in tls
            and direct.startswith("ERR") and dns == "FAILED" and wired)
    report.add(f"R11 only listed hosts via the proxy, no bypass{tag}", ok11,
               f"{wiring}; IP literal -> {literal}; name resolving to loopback -> {loop}; "
               f"CONNECT :8080 -> {port}; CONNECT :443 -> {tls}; direct TCP -> {direct}; DNS -> {dns}")
