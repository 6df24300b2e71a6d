"""Process ids across the sandbox's pid namespace, read from the host's /proc.

A sandbox has its own pid namespace: the supervisor reports its commands' pids
as the sandbox sees them, while the broker kills from the host. These two
functions translate, and answer 0 when a process is gone or not visible from
here (another pid namespace, e.g. a remote engine)."""

from __future__ import annotations

import os


def namespace_pid(host_pid: int) -> int:
    """The pid in its own (innermost) pid namespace of a host process, 0 when unknown."""
    try:
        with open(f"/proc/{host_pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return 0


def host_pid_of(supervisor_host_pid: int, ns_pid: int) -> int:
    """The host pid of the supervisor's child whose pid in the sandbox is
    `ns_pid` (0 when not visible from here, e.g. another pid namespace)."""
    try:
        tasks = os.listdir(f"/proc/{supervisor_host_pid}/task")
    except OSError:
        return 0
    for tid in tasks:
        try:
            with open(f"/proc/{supervisor_host_pid}/task/{tid}/children") as f:
                children = [int(p) for p in f.read().split()]
        except (OSError, ValueError):
            continue
        for p in children:
            try:
                with open(f"/proc/{p}/status") as f:
                    for line in f:
                        if line.startswith("NSpid:"):
                            if int(line.split()[-1]) == ns_pid:
                                return p
                            break
            except (OSError, ValueError):
                continue
    return 0
