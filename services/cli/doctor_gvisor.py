"""`afe doctor` and gVisor: the OCI runtimes the engine has, whether gVisor's
`runsc` is one of them (with the steps to add it when it is not), and, when
it is, the isolation checks of isolation.py and egresschecks.py again on
gVisor sandboxes.

The gVisor sandbox is made by a real sandbox broker (probebroker.py), with
the settings a `sandbox.runtime: gvisor` Workspace gives, so the doctor checks
what a ticket would get. It has no network (this runsc runs only so; a
gVisor ticket's egress goes through a Unix socket). What proves it runs on
gVisor is the kernel it sees: gVisor's own release (4.4.0 for the releases
Debian ships), while the runc sandbox, the positive control, sees the
engine's kernel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .egresschecks import egress_checks
from .isolation import Seen, isolation_checks

if TYPE_CHECKING:
    from docker import DockerClient

    from services.common.config.model import Config

    from .doctor_report import Report
    from .probebroker import ProbeBroker

RUNSC = "/usr/bin/runsc"
RUNTIME_ARGS = ("--network=none", "--host-uds=open")
GVISOR_TICKET = "doctor-gvisor"
GVISOR_EGRESS_TICKET = "doctor-gvisor-egress"


def install_steps(runtime: str) -> list[str]:
    """How to give the engine gVisor, step by step (what scripts/ensure_runsc.sh does)."""
    args = ", ".join(f'"{a}"' for a in RUNTIME_ARGS)
    return [
        f"apt-get install runsc    (Debian/Ubuntu; installs {RUNSC})",
        (f'merge into /etc/docker/daemon.json, keeping its other keys: "runtimes": {{"{runtime}": '
         f'{{"path": "{RUNSC}", "runtimeArgs": [{args}]}}}}'),
        ("kill -HUP $(cat /var/run/docker.pid)    (dockerd reloads its config, containers keep running; "
         "with systemd: systemctl reload docker)"),
        "docker info --format '{{json .Runtimes}}'    (now lists " + runtime + "); then run `afe doctor` again",
        "(from afe's source tree, scripts/ensure_runsc.sh does the first three, only what is missing)",
    ]


def engine_runtimes(report: Report, client: DockerClient, runtime: str, config: Config | None) -> bool:
    """List the engine's runtimes; True when gVisor's (`runtime`) is among
    them. Its absence is a FAIL only when a Workspace asks for gVisor:
    otherwise gVisor is an option not taken, and the steps are shown."""
    have = client.info().get("Runtimes") or {}
    print(f"info runtimes: {', '.join(sorted(have)) or 'none'} (the engine's OCI runtimes; "
          f"sandbox.runtime gvisor runs on {runtime})", flush=True)
    if runtime in have:
        entry = have[runtime] or {}
        report.add("gVisor runtime", True, f"the engine has {runtime}: {entry.get('path', '?')} "
                   f"{' '.join(entry.get('runtimeArgs') or [])}".rstrip())
        return True
    wanted = sorted(w.name for w in config.workspaces.values() if w.sandbox.runtime == "gvisor") if config else []
    if wanted:
        report.add("gVisor runtime", False, f"the engine has no runtime {runtime}, and Workspace "
                   f"{', '.join(wanted)} ask(s) for sandbox.runtime gvisor; to add it:")
    else:
        print(f"info gVisor: the engine has no runtime {runtime} (no Workspace asks for sandbox.runtime "
              "gvisor); to add it:", flush=True)
    for step in install_steps(runtime):
        print("  " + step, flush=True)
    return False


async def gvisor_checks(report: Report, client: DockerClient, broker: ProbeBroker,
                        probe_value: str, runc: Seen) -> None:
    """R4-R9 and R34 on a gVisor sandbox, then its kernel against the
    engine's and against what the runc sandbox saw."""
    info = await broker.create(GVISOR_TICKET, runtime="gvisor", memory_bytes=512 * 1024 ** 2,
                               disk_bytes=32 * 1024 ** 2, env_names=("AFE_DOCTOR_PROBE",))
    try:
        seen = await isolation_checks(report, client, broker, GVISOR_TICKET, info.container_id, probe_value,
                                      tag=" [gVisor]", live_limits=False)
        host = str(client.info().get("KernelVersion", ""))
        ok = bool(seen.kernel) and seen.kernel != host and runc.kernel == host
        report.add("gVisor kernel", ok,
                   f"the gVisor sandbox sees kernel {seen.kernel or '(none)'}, the engine's host runs {host}; "
                   f"the runc sandbox sees {runc.kernel}"
                   + (" (the host's, as runc shares it)" if runc.kernel == host else
                      " (not the host's: the control did not hold)"))
    finally:
        await broker.destroy(GVISOR_TICKET)


async def gvisor_egress_checks(report: Report, client: DockerClient, broker: ProbeBroker,
                               instance: str, tname: str, tip: str, plain_mode: str) -> None:
    """R10 and R11 on a gVisor egress sandbox: no interface, its ticket's
    proxy through the socket, the same allowlist and refusals as on runc."""
    eg = await broker.create(GVISOR_EGRESS_TICKET, runtime="gvisor", egress=(tname, "localhost"))
    try:
        await egress_checks(report, client, broker, eg, instance, tname, tip, plain_mode, tag=" [gVisor]")
    finally:
        await broker.destroy(GVISOR_EGRESS_TICKET)
