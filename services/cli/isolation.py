"""`afe doctor`'s checks of one sandbox without egress (R4-R9, R34), run
through a real sandbox broker over its gRPC contract (probebroker.py): on a
runc sandbox and, when the engine has gVisor, again on a gVisor one.

Each check reads what the sandbox itself sees (its kernel, its interfaces,
its capabilities, its user, what it can write, its environment) next to what
the engine says about the container, so a setting the engine ignores shows
up. Under gVisor the live fork and memory probes are left out: there the
engine's pids and memory limits also count gVisor's own threads and memory,
and reaching them ends the whole sandbox instead of failing one call (the
limits still hold, but the sandbox is gone for the checks after them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.common.layout import SANDBOX_UID

from .probescripts import FORK, INTERFACES, NO_NEW_PRIVS

if TYPE_CHECKING:
    from docker import DockerClient

    from .doctor_report import Report
    from .probebroker import ProbeBroker


@dataclass(frozen=True)
class Seen:
    """What one sandbox showed: its kernel release and container id."""
    kernel: str
    container_id: str


async def run_exec(broker: ProbeBroker, ticket: str, argv: list[str], timeout_ms: int = 30000) -> tuple[int, str]:
    return await broker.run_exec(ticket, argv, timeout_ms)


async def run_py(broker: ProbeBroker, ticket: str, script: str, *args: str) -> str:
    return (await run_exec(broker, ticket, ["python3", "-c", script, *args]))[1]


async def isolation_checks(report: Report, client: DockerClient, broker: ProbeBroker,
                           ticket: str, container_id: str, probe_value: str, tag: str = "",
                           live_limits: bool = True) -> Seen:
    """R4-R9 and R34 on the sandbox of `ticket` (made with the probe's
    settings: pids 64, memory 64 MiB and disk 32 MiB for `live_limits`,
    `AFE_DOCTOR_PROBE` declared). `tag` marks each line's rule, e.g. " [gVisor]"."""
    attrs = client.api.inspect_container(container_id)
    hc = attrs["HostConfig"]

    # R4: commands run inside the container, not on the host.
    _, hostname = await run_exec(broker, ticket, ["hostname"])
    _, kernel = await run_exec(broker, ticket, ["uname", "-r"])
    report.add(f"R4 commands run in the sandbox{tag}", hostname == "sandbox",
               f"exec ran in container {container_id[:12]} (hostname={hostname}, runtime={hc.get('Runtime')}, "
               f"kernel={kernel})")

    ifaces = (await run_py(broker, ticket, INTERFACES)).split()
    report.add(f"R5 no network by default{tag}", hc["NetworkMode"] == "none" and ifaces == ["lo"],
               f"NetworkMode={hc['NetworkMode']}, interfaces={ifaces}")

    _, status = await run_exec(broker, ticket, ["grep", "-E", "^CapEff", "/proc/self/status"])
    nnp = await run_py(broker, ticket, NO_NEW_PRIVS)
    ok6 = (hc["CapDrop"] == ["ALL"] and not hc.get("CapAdd") and "no-new-privileges" in hc["SecurityOpt"]
           and not hc["Privileged"] and "CapEff:\t0000000000000000" in status and nnp == "1"
           and hc["NanoCpus"] > 0 and hc["Memory"] > 0 and hc["PidsLimit"] > 0)
    limits = ("live fork and memory probes on runc only: under gVisor these limits count gVisor's own threads "
              "and memory too, and reaching them ends the whole sandbox")
    if live_limits:
        fork = await run_py(broker, ticket, FORK)
        memcode, _ = await run_exec(broker, ticket,
                                    ["python3", "-c", "b = bytearray(256 * 1024 * 1024); print(len(b))"])
        ok6 = ok6 and fork.endswith("EAGAIN") and memcode == 137
        limits = f"fork probe: {fork} ; 256 MiB allocation exit={memcode}"
    # The host tasks the engine counts against the pids limit between commands: a few on runc (init,
    # sleep, the broker's command supervisor), dozens on gVisor (its kernel's own threads and helpers).
    tasks = (client.api.stats(container_id, stream=False, one_shot=True).get("pids_stats") or {}).get("current")
    report.add(f"R6 caps dropped, no-new-privileges, limits{tag}", ok6,
               f"CapDrop={hc['CapDrop']}, {status.replace(chr(9), ' ')}, no_new_privs={nnp}, "
               f"cpus={hc['NanoCpus'] / 1e9}, memory={hc['Memory']}, pids={hc['PidsLimit']} "
               f"({tasks if tasks is not None else '?'} in use between commands); {limits}")

    _, uid = await run_exec(broker, ticket, ["id", "-u"])
    report.add(f"R7 non-root user{tag}", uid == str(SANDBOX_UID) and attrs["Config"]["User"].split(":")[0] != "0",
               f"User={attrs['Config']['User']}, id -u={uid}")

    rootw, _ = await run_exec(broker, ticket, ["touch", "/doctor-probe"])
    wsw, _ = await run_exec(broker, ticket, ["touch", "/workspace/.doctor-probe"])
    find_socket = ("find / -xdev -name 'docker.sock' 2>/dev/null; "
                   "ls /var/run/docker.sock /run/docker.sock 2>/dev/null")
    _, socks = await run_exec(broker, ticket, ["bash", "-c", find_socket])
    binds = [m["Destination"] for m in attrs["Mounts"] if m["Type"] == "bind"]
    ok8 = hc["ReadonlyRootfs"] and rootw != 0 and wsw == 0 and binds == ["/workspace"] and not socks
    report.add(f"R8 /workspace the only writable mount, no Docker socket{tag}", ok8,
               f"ReadonlyRootfs={hc['ReadonlyRootfs']}, write / exit={rootw}, write /workspace exit={wsw}, "
               f"binds={binds}, docker.sock found: {socks or 'none'}")

    # R34: which disk cap holds; with a loop-mounted image, writing past 32m gives ENOSPC.
    disk = await broker.identify()     # the broker's disk cap mode (R34)
    if disk.disk_cap_mode == "mount":
        fill, fout = await run_exec(broker, ticket, [
            "bash", "-c", ("dd if=/dev/zero of=/workspace/.doctor-fill bs=1M count=48 2>&1; "
                           "r=$?; rm -f /workspace/.doctor-fill; exit $r")])
        report.add(f"R34 workspace disk cap{tag}", fill != 0 and "No space left" in fout,
                   f"mount mode ({disk.disk_cap_why}); writing 48 MiB under a 32m cap -> exit {fill}, "
                   f"{'ENOSPC' if 'No space left' in fout else 'no ENOSPC'}")
    else:
        report.add(f"R34 workspace disk cap{tag}", True,
                   f"watchdog mode ({disk.disk_cap_why}): usage measured every second, the sandbox is "
                   "stopped past the cap (overshoot: about one second of writes)")

    env = [e.split("=", 1)[0] for e in attrs["Config"]["Env"]]
    _, seen_exec = await run_exec(broker, ticket, ["printenv", "AFE_DOCTOR_PROBE"])
    seen_proc = await broker.run_process(ticket, ["printenv", "AFE_DOCTOR_PROBE"], env_names=["AFE_DOCTOR_PROBE"])
    ok9 = (set(env) <= {"PATH", "LANG", "HOME", "PYTHONDONTWRITEBYTECODE"} and probe_value not in repr(attrs)
           and seen_exec == "" and seen_proc == probe_value)
    report.add(f"R9 no environment but declared names, passed by name{tag}", ok9,
               f"container env names={sorted(env)}; declared value absent from inspect; plain exec sees "
               f"{'it' if seen_exec else 'nothing'}; a process given the name sees "
               f"{'it' if seen_proc == probe_value else 'nothing'}")
    return Seen(kernel=kernel, container_id=container_id)
