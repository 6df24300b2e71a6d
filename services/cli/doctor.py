"""`afe doctor`: prove on this machine that sandbox isolation really holds.

Checks the Docker engine and the images, then starts a probe sandbox (no
network), a probe egress sandbox with its squid proxy, and a local target
HTTP server container on a probe network of its own (never a public host),
and proves each of R5-R12 and R31 live. The probe sandboxes are made by a
real sandbox broker process, started as `afe up` starts it and driven over
its gRPC contract (probebroker.py). It lists the engine's OCI runtimes
and, when gVisor's is one, runs the checks of a sandbox without egress again
on gVisor (doctor_gvisor.py). With manifests (--config or ./afe.d), it lists
each remote MCP server's reachable tools, asked from this host with the
token from this shell, never from a sandbox (mcpcheck.py). One PASS/FAIL line per rule with the evidence;
exit status 1 on any FAIL; everything it created is removed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.layout import SANDBOX_UID, Layout

from .doctor_gvisor import engine_runtimes, gvisor_checks, gvisor_egress_checks
from .doctor_report import Report
from .egresschecks import egress_checks
from .hostprobe import HostListener, host_addresses, reached
from .isolation import isolation_checks, run_py
from .probebroker import PROBE_ENV, ProbeBroker
from .probescripts import CONNECT, DIRECT, FETCH, FORK, LISTENER, PROBE, TARGET_SERVER

if TYPE_CHECKING:
    from docker import DockerClient

    from services._gen.afe.sandbox.v1.sandbox_pb2 import Sandbox
    from services.common.config.model import Config

# Older imports name these here; they live in probescripts.py and hostprobe.py.
__all__ = ["CONNECT", "DIRECT", "FETCH", "FORK", "LISTENER", "PROBE", "TARGET_SERVER", "HostListener",
           "Report", "add_parser", "doctor", "host_addresses", "reached", "run"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("doctor", help="prove the sandbox isolation rules live on this machine",
                       description="Check the Docker engine and images, then start probe containers and prove "
                       "R5-R12 and R31 (one PASS/FAIL line per rule), on gVisor too when the engine has it, and "
                       "list each remote MCP server's reachable tools (from this host, with the token in this "
                       "shell). "
                       "Exit status 1 on any FAIL.")
    p.add_argument("--no-build", action="store_true", help="do not build missing images")
    p.add_argument("--egress-network", default="bridge", metavar="NAME",
                   help="the network `afe up --egress-network` gives the egress proxies (default: bridge)")
    p.add_argument("--config", default=None, metavar="DIR",
                   help="manifest folder whose private egress entries to show (default: ./afe.d when it exists)")
    p.add_argument("--gvisor-runtime", default="runsc", metavar="NAME",
                   help="the engine's runtime name for gVisor, as given to the sandbox broker (default: runsc)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(doctor(build=not args.no_build, egress_network=args.egress_network, config_dir=args.config,
                              gvisor_runtime=args.gvisor_runtime))


def _egress_settings(report: Report, client: DockerClient, network: str, config_dir: str | None) -> Config | None:
    """The egress network exists, and which private destinations the manifests
    allow. Returns the manifests' Config (None when there is none to read)."""
    from services.common.config.manifests import load_config
    from services.common.errors import ConfigError
    from services.launcher.launch import egress_lines

    try:
        driver = client.api.inspect_network(network).get("Driver", "?")
        report.add("egress network", True, f"{network} exists (driver {driver}); the egress proxies join it")
    except Exception:  # noqa: BLE001 - docker.errors.NotFound or an engine error: either way unusable
        report.add("egress network", False, f"no Docker network named {network}; create it or pass "
                   "--egress-network NAME to `afe up` and `afe doctor`")
    directory = config_dir or ("afe.d" if Path("afe.d").is_dir() else None)
    if directory is None:
        print("info private egress: no --config and no ./afe.d; none configured (every private address is "
              "refused)")
        return None
    try:
        config = load_config(directory)
    except ConfigError as exc:
        report.add("private egress", False, str(exc).splitlines()[0] + "; run `afe check`")
        return None
    print("info " + egress_lines(config, network)[1].strip(), flush=True)
    return config


async def _mcp_servers(report: Report, config: Config | None) -> None:
    """Each remote MCP server's reachable tools (R43: asked from the host, never a sandbox); a server
    whose tokenEnv is not set in this shell is not contacted."""
    from .mcpcheck import list_servers, tools_line

    if config is None:
        return
    for r in await list_servers(config, os.environ):
        if r.unset:
            print(f"info MCP server {r.server.name}: not contacted: {r.problem}", flush=True)
        elif r.ok:
            report.add(f"MCP server {r.server.name}", True, tools_line(r))
        else:
            report.add(f"MCP server {r.server.name}", False, r.problem)


async def doctor(build: bool = True, egress_network: str = "bridge", config_dir: str | None = None,
                 gvisor_runtime: str = "runsc", broker_command: list[str] | None = None) -> int:
    """`broker_command`: how to start the sandbox broker the probes drive (default: as `afe up`
    starts it, probebroker.broker_argv); the doctor's own controls start a weakened one."""
    import docker

    from services.common.errors import AfeError
    from services.common.host import images

    report = Report()
    try:
        images.check_engine()
        client = docker.from_env()
        v = client.version()
        report.add("engine", True, f"Docker {v.get('Version')} (API {v.get('ApiVersion')})")
    except Exception as exc:  # noqa: BLE001 - any failure here means "no engine"
        report.add("engine", False, f"Docker engine not reachable ({type(exc).__name__}); start it or set DOCKER_HOST")
        return 1
    try:
        if build:
            images.ensure_images(progress=lambda m: print("  " + m, flush=True))
        missing = [i for i in (images.SANDBOX_IMAGE, images.PROXY_IMAGE) if not images._present(i)]
        report.add("images", not missing, "missing: " + ", ".join(missing) if missing else
                   f"{images.SANDBOX_IMAGE} and {images.PROXY_IMAGE} present")
        if missing:
            return 1
    except AfeError as exc:
        report.add("images", False, str(exc).splitlines()[0])
        return 1
    config = _egress_settings(report, client, egress_network, config_dir)
    await _mcp_servers(report, config)
    gvisor = engine_runtimes(report, client, gvisor_runtime, config)

    instance = "doctor-" + secrets.token_hex(4)
    tmp = Path(tempfile.mkdtemp(prefix="afe-doctor-", dir="/tmp"))
    net = target = None
    broker: ProbeBroker | None = None
    try:
        net = client.networks.create(f"afe-{instance}-probe", labels={"afe.instance": instance})
        net.reload()
        subnet = net.attrs["IPAM"]["Config"][0]["Subnet"]
        tname = f"target-{instance}"
        target = client.containers.run(images.SANDBOX_IMAGE, ["python3", "-c", TARGET_SERVER], user="0",
                                       detach=True, name=tname, network=net.name,
                                       labels={"afe.instance": instance})
        for _ in range(100):
            if b"ready" in target.logs():
                break
            await asyncio.sleep(0.1)
        target.reload()
        tip = target.attrs["NetworkSettings"]["Networks"][net.name]["IPAddress"]
        probe_value = "doctor-probe-" + secrets.token_hex(8)
        broker = _start_broker(tmp, instance, net.name, subnet, gvisor_runtime, probe_value, broker_command)
        await _probe(report, client, broker, instance, net.name, tname, tip, bool(gvisor), probe_value)
    except Exception as exc:  # noqa: BLE001 - the probe itself broke: a FAIL, with what broke
        report.add("probe", False, f"could not run the probes: {type(exc).__name__}: {str(exc)[:300]}")
    finally:
        if broker is not None:
            with contextlib.suppress(Exception):
                await broker.reconcile()        # everything of this instance: no ticket is live
            with contextlib.suppress(Exception):
                await broker.stop()
        for obj in (target, net):
            with contextlib.suppress(Exception):
                if obj is target and obj is not None:
                    obj.remove(force=True)
                elif obj is not None:
                    obj.remove()
        shutil.rmtree(tmp, ignore_errors=True)
        left = client.containers.list(all=True, filters={"label": f"afe.instance={instance}"})
        left_n = client.networks.list(filters={"label": f"afe.instance={instance}"})
        if left or left_n:
            report.add("teardown", False, f"{len(left)} containers and {len(left_n)} networks left behind")
        else:
            print("teardown: every probe object removed")
    print("afe doctor: " + ("FAIL" if report.failed else "all rules PASS"))
    return 1 if report.failed else 0


def _start_broker(tmp: Path, instance: str, network: str, subnet: str, gvisor_runtime: str, probe_value: str,
                  command: list[str] | None) -> ProbeBroker:
    """A real sandbox broker for the probes (probebroker.py), on `tmp`'s data and runtime folders."""
    layout = Layout(tmp / "data", tmp / "run")
    layout.ensure()
    if os.geteuid() != 0:
        # Without root the broker cannot give the probe workspaces to the
        # sandbox uid; open them up instead (they are throwaway).
        for t in ("doctor-plain", "doctor-egress", "doctor-gvisor", "doctor-gvisor-egress"):
            layout.workspace(t).mkdir(parents=True, exist_ok=True)
            os.chmod(layout.workspace(t), 0o777)
    broker = ProbeBroker(layout, instance, egress_network=network, allow_private=[subnet],
                         gvisor_runtime=gvisor_runtime, probe_value=probe_value, command=command)
    broker.start()
    return broker


async def _probe(report: Report, client: DockerClient, broker: ProbeBroker, instance: str, network: str,
                 tname: str, tip: str, gvisor: bool, probe_value: str) -> None:
    """`gvisor`: the engine has gVisor's runtime (else runc is checked only)."""
    t0 = time.monotonic()

    async def create_plain() -> Sandbox:
        return await broker.create("doctor-plain", pids=64, memory_bytes=64 * 1024 ** 2,
                                   disk_bytes=32 * 1024 ** 2, env_names=(PROBE_ENV,))
    # A warm sandbox (services/scheduler/sandboxes/pool.py): made ahead for a reserved id, as the pool fills;
    # claimed by the ticket given that id, whose own create finds it. Every probe below runs on it.
    pooled = await create_plain()
    plain = await create_plain()
    label = client.api.inspect_container(plain.container_id)["Config"]["Labels"].get("afe.ticket")
    report.add("pool: the probes below run on a claimed warm sandbox",
               plain.container_id == pooled.container_id and label == "doctor-plain",
               f"made ahead as container {pooled.container_id[:12]}, claimed {plain.container_id[:12]}; "
               f"afe.ticket={label} (R12: the label of the ticket it serves, from birth)")

    runc = await isolation_checks(report, client, broker, "doctor-plain", plain.container_id, probe_value)
    if gvisor:
        await gvisor_checks(report, client, broker, probe_value, runc)

    eg = await broker.create("doctor-egress", egress=(tname, "localhost"))
    plain_mode = client.api.inspect_container(plain.container_id)["HostConfig"]["NetworkMode"]
    await egress_checks(report, client, broker, eg, instance, tname, tip, plain_mode)
    if gvisor:
        await gvisor_egress_checks(report, client, broker, instance, tname, tip, plain_mode)

    await _probe_r31(report, client, broker, eg, instance, network, tip)

    flt = {"label": ["afe.ticket=doctor-egress", f"afe.instance={instance}"]}
    before = (len(client.containers.list(all=True, filters=flt)), len(client.networks.list(filters=flt)))
    removed = await broker.destroy("doctor-egress")
    after = (len(client.containers.list(all=True, filters=flt)), len(client.networks.list(filters=flt)))
    report.add("R12 labelled with afe.ticket, gone with the ticket", before == (2, 1) and after == (0, 0),
               f"labelled (containers, networks) before destroy={before}, after={after}, removed={removed}")
    await broker.destroy("doctor-plain")
    print(f"(probes took {time.monotonic() - t0:.1f}s)")


async def _probe_r31(report: Report, client: DockerClient, broker: ProbeBroker, eg: Sandbox, instance: str,
                     network: str, tip: str) -> None:
    """R31 live: from the egress sandbox, TCP, UDP and ICMP to every address
    of this host, to the ticket network's gateway and to the other probe
    containers; a host listener records what arrives. The same probe from a
    plain container on the probe network shows the host does answer."""
    import json

    from services.common.host import images
    from services.common.layout import SANDBOX_GID

    gw = (client.api.inspect_network(eg.network)["IPAM"]["Config"] or [{}])[0].get("Gateway", "")
    proxy_nets = client.api.inspect_container(eg.proxy_container_id)["NetworkSettings"]["Networks"]
    others = [tip, *(n["IPAddress"] for name, n in proxy_nets.items() if name != eg.network and n.get("IPAddress"))]
    sbx, ctl = "sbx-" + secrets.token_hex(6), "ctl-" + secrets.token_hex(6)
    with HostListener() as listener:
        hosts = host_addresses()
        targets = list(dict.fromkeys([*hosts, *([gw] if gw else []), *others]))
        port = str(listener.port)
        raw = await run_py(broker, eg.ticket_id, PROBE, sbx, port, *targets)
        out = await asyncio.to_thread(
            client.containers.run, images.SANDBOX_IMAGE, ["python3", "-c", PROBE, ctl, port, *targets],
            network=network, user=f"{SANDBOX_UID}:{SANDBOX_GID}", cap_drop=["ALL"], remove=True,
            labels={"afe.instance": instance})
        try:
            res, cres = json.loads(raw), json.loads(out)
        except ValueError:
            report.add("R31 egress sandbox reaches only its proxy", False,
                       f"the probe printed no result: {raw[-300:]!r}")
            return
        connected = sum(r["tcp"] == "CONNECTED" for r in cres.values())
        control = reached(cres, await asyncio.to_thread(listener.wait_for, ctl, 2 * connected))
        got = reached(res, listener.received(sbx))
    icmp = "" if not any(r["icmp"].startswith("NOSOCK") for r in res.values()) else \
        " (no ICMP socket in the sandbox: ICMP not tested)"
    report.add("R31 egress sandbox reaches only its proxy", set(res) == set(targets) and not got,
               f"TCP, UDP and ICMP from the egress sandbox to {len(hosts)} host addresses ({', '.join(hosts)}), "
               f"its network's gateway {gw or '(none)'} and other containers ({', '.join(others)}) -> "
               f"{'reached ' + ', '.join(got) if got else 'nothing reached'}{icmp}; control from a plain "
               f"container: {len(control)} reached" + ("" if control else " (a host firewall already blocks "
                                                       "containers)"))


if __name__ == "__main__":
    sys.exit(run(argparse.Namespace(no_build=False, egress_network="bridge", config=None, gvisor_runtime="runsc")))
