"""The container settings of a sandbox and of its egress proxy (R5-R9).

Pure functions returning keyword arguments for the Docker SDK's
`containers.create`, so the policy can be read (and tested) in one place.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from docker.types import Mount, Ulimit

from services.common.config.egress_rules import EgressRule
from services.common.config.model import DEFAULT_PROXY_IMAGE, DEFAULT_SANDBOX_IMAGE, Limits
from services.common.errors import InvalidArgument
from services.common.layout import SANDBOX_GID, SANDBOX_UID
from services.common.relayenv import RELAY_MOUNT
from services.sandbox.egress import allowlist as egress
from services.sandbox.egress import bump as egress_bump
from services.sandbox.egress.over_socket import EGRESS_MOUNT, proxy_command

WORKSPACE = "/workspace"
PROXY_ALIAS = "afe-proxy"   # the proxy's name on a ticket's internal network
NO_DNS = "192.0.2.53"   # TEST-NET-1: never routable
TMPFS_TMP = "size=256m,noexec,nosuid,nodev,mode=1777"

DEFAULT_LIMITS = Limits()
MAX_CPUS = 64.0
MAX_MEMORY = 256 * 1024 ** 3
MAX_PIDS = 32768
MIN_MEMORY = 16 * 1024 ** 2

LABEL_TICKET = "afe.ticket"
LABEL_ROLE = "afe.role"
LABEL_INSTANCE = "afe.instance"
LABEL_ENV = "afe.env"          # comma-separated NAMES (never values) a Process may receive
LABEL_DISK = "afe.disk"        # the workspace's disk cap in bytes (R34), for a restarted broker
LABEL_RELAY = "afe.relay"      # "1": the ticket's model relay folder is mounted (R32)
LABEL_RUNTIME = "afe.runtime"  # runc | gvisor
LABEL_EGRESS = "afe.egress"    # "socket": egress through the ticket's proxy socket, no interface (egress/over_socket.py)
LABEL_EGRESS_RULES = "afe.egress.rules"   # "1": hosts with rules, judged decrypted; the sandbox trusts its CA (R44)
RUNTIMES = ("runc", "gvisor")


@dataclass(frozen=True)
class SandboxSettings:
    ticket_id: str
    image: str = DEFAULT_SANDBOX_IMAGE
    cpus: float = DEFAULT_LIMITS.cpus
    memory_bytes: int = DEFAULT_LIMITS.memory_bytes
    pids: int = DEFAULT_LIMITS.pids
    disk_bytes: int = DEFAULT_LIMITS.disk_bytes   # the workspace's disk cap (R34, diskcap.py)
    egress: tuple[str, ...] = ()
    egress_private: tuple[str, ...] = ()   # operator-allowed private names/CIDRs (egress.check_private)
    egress_rules: tuple[EgressRule, ...] = ()   # methods and paths on hosts with rules (R44, egress/bump.py)
    env_names: tuple[str, ...] = ()
    relay: bool = False                           # mount the ticket's model relay folder (R32)
    runtime: str = "runc"                         # runc | gvisor (the engine's runsc)


def resolve_limits(cpus: float, memory_bytes: int, pids: int) -> tuple[float, int, int]:
    """0 means the default; negative or absurd values are refused."""
    if cpus < 0 or memory_bytes < 0 or pids < 0:
        raise InvalidArgument("sandbox limits must be positive (0 means the default)")
    cpus = cpus or DEFAULT_LIMITS.cpus
    memory_bytes = memory_bytes or DEFAULT_LIMITS.memory_bytes
    pids = pids or DEFAULT_LIMITS.pids
    if cpus > MAX_CPUS or memory_bytes > MAX_MEMORY or pids > MAX_PIDS:
        raise InvalidArgument(f"sandbox limits too large (at most {MAX_CPUS} cpus, "
                              f"{MAX_MEMORY // 1024 ** 3} GiB memory, {MAX_PIDS} pids)")
    if memory_bytes < MIN_MEMORY:
        raise InvalidArgument("sandbox memory limit must be at least 16 MiB")
    return float(cpus), int(memory_bytes), int(pids)


# gVisor's kernel runs inside the sandbox's cgroup and spends several host tasks
# on each process it runs (measured with Debian's runsc 20221219: 39 tasks idle,
# about 5 more per sleeping process, more for a busy Node agent), so the engine's
# limit of a gVisor sandbox is this many times the Workspace's pids. The host
# stays bounded; at the limit the whole sandbox stops (docs/SECURITY.md).
GVISOR_PIDS_FACTOR = 8


def pids_limit(pids: int, gvisor: bool) -> int:
    return min(pids * GVISOR_PIDS_FACTOR, MAX_PIDS) if gvisor else pids


def labels(instance: str, ticket_id: str, role: str) -> dict[str, str]:
    return {LABEL_TICKET: ticket_id, LABEL_ROLE: role, LABEL_INSTANCE: instance}


def proxy_env(proxy_host: str) -> dict[str, str]:
    return egress.proxy_env(proxy_host)


# R31: a ticket's network is a bridge with no host address (inhibit_ipv4), so
# the sandbox's default gateway is an address nobody answers; with no
# capabilities the sandbox cannot change its routes or neighbour table, and
# with IPv6 off it has no link-local path to the bridge either. The proxy,
# on the same bridge, is the one thing it can reach.
INHIBIT_IPV4 = "com.docker.network.bridge.inhibit_ipv4"
BRIDGE_NAME = "com.docker.network.bridge.name"
NO_IPV6_SYSCTLS = {"net.ipv6.conf.all.disable_ipv6": "1", "net.ipv6.conf.default.disable_ipv6": "1"}


def bridge_name(network: str) -> str:
    """The host interface name of a ticket network's bridge: 15 characters
    (the kernel's limit), derived from the network name so it is stable."""
    return "afe" + hashlib.sha256(network.encode()).hexdigest()[:12]


def ticket_network_kwargs(*, name: str, instance: str, ticket_id: str) -> dict[str, Any]:
    """Keyword arguments for `networks.create` of a ticket's network (R11,
    R31): internal (Docker adds no route out), and a bridge without a host
    address, so nothing of the host answers on it."""
    return dict(  # noqa: C408 - reads like the docker network create flags it mirrors
        name=name,
        driver="bridge",
        internal=True,
        labels=labels(instance, ticket_id, "network"),
        options={"com.docker.network.bridge.enable_icc": "true", INHIBIT_IPV4: "true",
                 BRIDGE_NAME: bridge_name(name)},
    )


def sandbox_create_kwargs(s: SandboxSettings, *, name: str, instance: str, workspace: str,
                          network: str | None, env: dict[str, str], ipv6: bool = True,
                          relay_dir: str | None = None, egress_dir: str | None = None,
                          runtime_name: str | None = None, ca_mounts: list[Mount] | None = None
                          ) -> dict[str, Any]:
    """R5 network none unless egress; R6 caps/no-new-privileges/limits; R7
    non-root; R8 read-only root, /workspace the only writable bind, no
    socket; R9 no environment but what the caller passes (non-secret proxy
    variables); R31 IPv6 off in an egress sandbox (`ipv6`: the kernel has
    IPv6 at all, else there is nothing to turn off and the sysctl does not
    exist); R32 the ticket's relay folder (`relay_dir`) read-only at
    /run/afe-relay. Egress without an interface (`egress_dir`, the ticket's
    proxy socket folder) is mounted read-only at /run/afe-egress, and the
    sandbox stays on no network. `runtime_name`: the engine's runtime for
    gVisor (runc when None). `ca_mounts`: the ticket's CA folder and bundle
    (egress/ca.py) when its egress has rules (R44)."""
    lab = labels(instance, s.ticket_id, "sandbox")
    lab[LABEL_ENV] = ",".join(s.env_names)
    lab[LABEL_DISK] = str(s.disk_bytes)
    lab[LABEL_RUNTIME] = s.runtime
    mounts = []
    if relay_dir:
        lab[LABEL_RELAY] = "1"
        mounts.append(Mount(target=RELAY_MOUNT, source=relay_dir, type="bind", read_only=True))
    if egress_dir:
        lab[LABEL_EGRESS] = "socket"
        mounts.append(Mount(target=EGRESS_MOUNT, source=egress_dir, type="bind", read_only=True))
    if ca_mounts:
        lab[LABEL_EGRESS_RULES] = "1"
        mounts.extend(ca_mounts)
    return dict(
        image=s.image,
        command=["sleep", "infinity"],
        entrypoint=[],
        name=name,
        user=f"{SANDBOX_UID}:{SANDBOX_GID}",
        working_dir=WORKSPACE,
        environment=dict(env),
        labels=lab,
        network_mode=network or "none",
        cap_drop=["ALL"],
        security_opt=["no-new-privileges"],
        privileged=False,
        read_only=True,
        tmpfs={"/tmp": TMPFS_TMP},
        mounts=mounts,
        volumes={workspace: {"bind": WORKSPACE, "mode": "rw"}},
        nano_cpus=int(s.cpus * 1e9),
        mem_limit=s.memory_bytes,
        memswap_limit=s.memory_bytes,
        pids_limit=pids_limit(s.pids, gvisor=bool(runtime_name)),
        ulimits=[Ulimit(name="nofile", soft=4096, hard=4096), Ulimit(name="core", soft=0, hard=0)],
        init=True,
        ipc_mode="private",
        hostname="sandbox",
        # With egress the sandbox sits on a user-defined network whose embedded
        # DNS would forward unknown names upstream from the host: point it at
        # an unroutable resolver so no lookup leaves (the proxy resolves).
        **({"dns": [NO_DNS], "dns_opt": ["timeout:1", "attempts:1"], "dns_search": ["."]} if network else {}),
        **({"sysctls": dict(NO_IPV6_SYSCTLS)} if network and ipv6 else {}),
        stdin_open=False,
        tty=False,
        detach=True,
        **({"runtime": runtime_name} if runtime_name else {}),
    )


def proxy_create_kwargs(*, ticket_id: str, name: str, instance: str, outside_network: str,
                        conf: str, image: str = DEFAULT_PROXY_IMAGE, egress_dir: str | None = None,
                        bump_dir: str | None = None) -> dict[str, Any]:
    """The squid proxy is hardened too: no capabilities, read-only root, its
    config passed in the environment (it is not secret: only host names) and
    written to a tmpfs by the entrypoint, so no host path is mounted but, for
    egress without an interface, the ticket's socket folder (`egress_dir`,
    egress/over_socket.py), where its main process serves squid's socket, and,
    for egress with rules (R44), the judge's folder (`bump_dir`,
    egress/bump.py) read-only: the command then first makes the ticket's CA
    in the proxy's tmpfs."""
    command = proxy_command() if egress_dir else [
        "sh", "-c", 'printf "%s" "$AFE_SQUID_CONF" > /tmp/squid.conf && exec squid -N -f /tmp/squid.conf']
    environment = {"AFE_SQUID_CONF": conf}
    mounts = [Mount(target=EGRESS_MOUNT, source=egress_dir, type="bind")] if egress_dir else []
    if bump_dir:
        command = egress_bump.proxy_command(command)
        environment["AFE_TICKET"] = ticket_id
        mounts.append(Mount(target=egress_bump.BUMP_MOUNT, source=bump_dir, type="bind", read_only=True))
    return dict(  # noqa: C408 - reads like the docker run flags it mirrors
        image=image,
        command=command,
        entrypoint=[],
        name=name,
        user="proxy",
        environment=environment,
        labels=labels(instance, ticket_id, "proxy"),
        network=outside_network,
        cap_drop=["ALL"],
        security_opt=["no-new-privileges"],
        privileged=False,
        read_only=True,
        tmpfs={"/tmp": "size=16m,noexec,nosuid,nodev,mode=1777",
               "/var/run/squid": "size=1m,nosuid,nodev,uid=13,gid=13",
               "/var/spool/squid": "size=1m,nosuid,nodev,uid=13,gid=13",
               "/var/log/squid": "size=16m,nosuid,nodev,uid=13,gid=13"},
        mounts=mounts,
        nano_cpus=int(0.5 * 1e9),
        mem_limit=256 * 1024 ** 2,
        pids_limit=128,
        hostname="proxy",
        detach=True,
    )
