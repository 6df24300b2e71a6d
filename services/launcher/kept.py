"""What a stopped `afe up` leaves on purpose, said once its processes are gone.

A ticket still running when `afe up` stops keeps its sandbox container, its
egress proxy and network, and (disk cap in mount mode, R34) its workspace's
loop-mounted disk: the workspace holds the ticket's work so far, and the
next `afe up` on the same data folder and instance resumes the ticket in
them (a ticket that had ended by then has them removed by that start's
reconcile, R12). Nothing is removed here; the launcher lists what is left
per ticket and how to remove it instead (`afe ticket cancel`).

Found the way the sandbox broker finds its own: Docker objects by the
`afe.instance` and `afe.ticket` labels, mounts on `<data>/workspaces/<id>`.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from services.common.layout import Layout, verify_owner
from services.common.secrecy.childenv import docker_cli_env

ROLES = {"sandbox": "sandbox", "proxy": "egress proxy"}
DOCKER_TIMEOUT_S = 15.0


@dataclass
class Kept:
    ticket: str
    containers: list[str] = field(default_factory=list)   # "sandbox NAME", "egress proxy NAME"
    networks: list[str] = field(default_factory=list)
    mounts: list[str] = field(default_factory=list)

    def parts(self) -> list[str]:
        return ([*self.containers, *(f"network {n}" for n in self.networks),
                 *(f"workspace disk mounted on {m}" for m in self.mounts)])


def _docker_lines(argv: list[str], environ: Mapping[str, str]) -> list[list[str]]:
    r = subprocess.run(["docker", *argv], capture_output=True, text=True, check=False,
                       timeout=DOCKER_TIMEOUT_S, env=docker_cli_env(environ))
    if r.returncode != 0:
        raise OSError(r.stderr.strip() or f"docker exited with {r.returncode}")
    return [line.split("\t") for line in r.stdout.splitlines() if line.strip()]


def _mount_points(under: Path) -> list[Path]:
    from services.common.host.mountinfo import mounts

    prefix = str(under) + "/"
    return [Path(m.target) for m in mounts() if m.target.startswith(prefix)]


def find_kept(layout: Layout, instance: str, environ: Mapping[str, str]) -> dict[str, Kept]:
    """Per ticket id: this instance's containers and networks, and the workspace mounts, still there."""
    found: dict[str, Kept] = {}

    def of(ticket_id: str) -> Kept:
        owner = verify_owner(ticket_id) or ticket_id      # a clean-room verification is its ticket's (R41)
        return found.setdefault(owner, Kept(owner))

    filters = ["--filter", f"label=afe.instance={instance}", "--filter", "label=afe.ticket"]
    for ticket, role, name in _docker_lines(
            ["ps", "-a", *filters, "--format", '{{.Label "afe.ticket"}}\t{{.Label "afe.role"}}\t{{.Names}}'],
            environ):
        of(ticket).containers.append(f"{ROLES.get(role, role)} {name}")
    for ticket, name in _docker_lines(
            ["network", "ls", *filters, "--format", '{{.Label "afe.ticket"}}\t{{.Name}}'], environ):
        of(ticket).networks.append(name)
    for point in _mount_points(layout.workspaces_dir):
        of(point.name).mounts.append(str(point))
    return found


def report(layout: Layout, instance: str, environ: Mapping[str, str], out: Callable[[str], None]) -> None:
    """Print what is kept and why, and how to remove it; nothing when nothing is kept."""
    try:
        kept = find_kept(layout, instance, environ)
    except (OSError, subprocess.SubprocessError) as exc:
        out(f"afe up: could not list the sandboxes left behind ({exc}); `docker ps -a --filter "
            f"label=afe.instance={instance}` shows them")
        return
    if not kept:
        return
    warm_marks = layout.data_dir / "pool"        # the scheduler's reserved ids (warm sandboxes)
    warm = sorted(t for t in kept if (warm_marks / t).exists())
    tickets = sorted(t for t in kept if t not in warm)
    if tickets:
        out("afe up: kept on purpose for the tickets still running, so the next `afe up` (same --data and "
            "--instance) resumes each where it stopped, its workspace as it was:")
        for t in tickets:
            out(f"  {t}: " + ", ".join(kept[t].parts()))
        out("  to remove them instead: start `afe up` again and run `afe ticket cancel ID` for each ticket "
            "above")
    if warm:
        out(f"afe up: {len(warm)} warm sandbox(es) not given to any ticket yet "
            f"({', '.join(warm)}): the next `afe up` removes them")
