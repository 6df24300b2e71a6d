"""The sandbox container's settings (R5-R9), checked with `docker inspect`
and from inside. Each defence has a positive control: the same probe in a
container started WITHOUT that defence shows the attack would work."""

from __future__ import annotations

import os
import time

import pytest

from services._gen.afe.sandbox.v1 import sandbox_pb2 as pb
from services.common.host.images import SANDBOX_IMAGE
from services.common.layout import SANDBOX_UID
from services.sandbox.containers.hardening import GVISOR_PIDS_FACTOR
from tests.sandbox.conftest import run, spec_runtime

pytestmark = [pytest.mark.docker, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def inspected(docker_client, stub, plain_sandbox):
    sb = stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=plain_sandbox))
    return docker_client.api.inspect_container(sb.container_id)


@pytest.fixture(scope="module")
def control(docker_client, test_instance):
    """An undefended container (defaults: root, caps, writable root, network)."""
    c = docker_client.containers.run(SANDBOX_IMAGE, ["sleep", "infinity"], user="0", detach=True,
                                      labels={"afe.instance": test_instance})
    try:
        yield c
    finally:
        c.remove(force=True)


def control_sh(c, cmd: str) -> tuple[int, str]:
    code, out = c.exec_run(["bash", "-c", cmd])
    return code, out.decode()


def test_gvisor_sandbox_sees_gvisors_kernel_and_runc_the_hosts(stub, plain_sandbox, runtime, inspected):
    """What gVisor adds, shown from inside: its sandbox talks to gVisor's
    user-space kernel, not the host's (the runc sandbox, the positive control,
    sees the host's)."""
    kernel = run(stub, plain_sandbox, "uname -r").stdout.decode().strip()
    if runtime == "gvisor":
        assert kernel != os.uname().release and inspected["HostConfig"]["Runtime"] == "runsc"
        assert b"gVisor" in run(stub, plain_sandbox, "dmesg 2>&1 | head -3").stdout
    else:
        assert kernel == os.uname().release and inspected["HostConfig"]["Runtime"] == "runc"


def test_r6_inspect_caps_and_privileges(inspected):
    hc = inspected["HostConfig"]
    assert hc["CapDrop"] == ["ALL"]
    assert not hc.get("CapAdd")
    assert "no-new-privileges" in hc["SecurityOpt"]
    assert hc["Privileged"] is False


def test_r6_inspect_limits_are_set(inspected, runtime):
    hc = inspected["HostConfig"]
    assert hc["NanoCpus"] == 1_000_000_000
    assert hc["Memory"] == 1024 ** 3
    # gVisor's own kernel spends host tasks of the same cgroup on each process it runs
    assert hc["PidsLimit"] == (256 if runtime == "runc" else 256 * GVISOR_PIDS_FACTOR)
    assert hc["MemorySwap"] == hc["Memory"]                     # no swap beyond the limit
    assert {u["Name"]: u["Hard"] for u in hc["Ulimits"]} == {"nofile": 4096, "core": 0}


def test_r5_r7_r8_inspect_network_user_rootfs_mounts(inspected):
    hc = inspected["HostConfig"]
    assert hc["NetworkMode"] == "none"
    user = inspected["Config"]["User"]
    assert user == f"{SANDBOX_UID}:{SANDBOX_UID}" and not user.startswith("0")
    assert hc["ReadonlyRootfs"] is True
    binds = [m for m in inspected["Mounts"] if m["Type"] == "bind"]
    assert len(binds) == 1 and binds[0]["Destination"] == "/workspace" and binds[0]["RW"]
    assert not any("docker.sock" in (m.get("Source") or "") for m in inspected["Mounts"])
    assert [m for m in inspected["Mounts"] if m["Type"] != "bind"] == []
    assert set(hc.get("Tmpfs", {})) == {"/tmp"} and "noexec" in hc["Tmpfs"]["/tmp"]


def test_r9_inspect_env_has_no_secret_and_only_image_defaults(inspected):
    env = dict(e.split("=", 1) for e in inspected["Config"]["Env"])
    assert set(env) <= {"PATH", "LANG", "HOME", "PYTHONDONTWRITEBYTECODE"}
    assert "agent-secret-value-123" not in repr(inspected)
    assert inspected["Config"]["Labels"]["afe.env"] == "AGENT_KEY"
    assert inspected["Config"]["Labels"]["afe.role"] == "sandbox"
    assert inspected["Config"]["Labels"]["afe.ticket"]


# prctl(PR_GET_NO_NEW_PRIVS): gVisor's /proc/self/status has no NoNewPrivs line, the call answers on both.
NO_NEW_PRIVS = "python3 -c 'import ctypes; print(\"NoNewPrivs\", ctypes.CDLL(None).prctl(39, 0, 0, 0, 0))'"


def test_r6_inside_no_capabilities_and_no_new_privs(stub, plain_sandbox, control):
    r = run(stub, plain_sandbox, f"grep -E '^CapEff' /proc/self/status; {NO_NEW_PRIVS}")
    assert "CapEff:\t0000000000000000" in r.stdout.decode()
    assert "NoNewPrivs 1" in r.stdout.decode()
    _, out = control_sh(control, f"grep -E '^CapEff' /proc/self/status; {NO_NEW_PRIVS}")
    assert "CapEff:\t0000000000000000" not in out and "NoNewPrivs 0" in out   # positive control


def test_r7_inside_runs_as_non_root(stub, plain_sandbox, control):
    assert run(stub, plain_sandbox, "id -u").stdout.strip() == str(SANDBOX_UID).encode()
    assert control_sh(control, "id -u")[1].strip() == "0"


def test_r8_inside_root_filesystem_is_read_only(stub, plain_sandbox, control):
    r = run(stub, plain_sandbox, "touch /probe-root || echo refused; touch /etc/probe || echo refused2")
    assert b"refused" in r.stdout and b"refused2" in r.stdout
    assert run(stub, plain_sandbox, "touch /workspace/ok && echo wrote").stdout.strip() == b"wrote"
    assert control_sh(control, "touch /probe-root && echo wrote")[1].strip() == "wrote"


def test_r8_tmp_is_writable_but_noexec(stub, plain_sandbox):
    r = run(stub, plain_sandbox, "printf '#!/bin/sh\\necho ran\\n' > /tmp/x && chmod +x /tmp/x && /tmp/x; echo rc=$?")
    assert b"ran" not in r.stdout and b"rc=126" in r.stdout


def test_r8_no_docker_socket_anywhere(stub, plain_sandbox):
    r = run(stub, plain_sandbox, "find / -xdev -type s 2>/dev/null; python3 -c 'import os; "
            "print(\"exists\", [os.path.lexists(p) for p in (\"/var/run/docker.sock\", \"/run/docker.sock\")])'")
    assert b"docker.sock" not in r.stdout
    assert b"exists [False, False]" in r.stdout


# The interfaces a process sees (/proc/net/dev: gVisor has no /sys/class/net).
INTERFACES = "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '"


def test_r5_only_loopback_without_egress(stub, plain_sandbox, control):
    r = run(stub, plain_sandbox, INTERFACES)
    assert r.stdout.split() == [b"lo"]
    assert "eth0" in control_sh(control, INTERFACES)[1]    # positive control


def test_r9_process_gets_only_requested_declared_env(stub, plain_sandbox):
    r = run(stub, plain_sandbox, "echo ${AGENT_KEY:-unset}")
    assert r.stdout.strip() == b"unset"      # Exec never receives agent secrets

    def inputs(names):
        yield pb.ProcessInput(start=pb.ProcessStart(ticket_id=plain_sandbox, argv=["bash", "-c", "echo ${AGENT_KEY:-unset}"],
                                                    env_names=names))
    out = b"".join(o.stdout for o in stub.Process(inputs(["AGENT_KEY"]), timeout=60) if o.WhichOneof("output") == "stdout")
    assert out.strip() == b"agent-secret-value-123"
    with pytest.raises(Exception) as ei:
        list(stub.Process(inputs(["NOT_DECLARED"]), timeout=60))
    assert "not declared" in str(ei.value)


@pytest.fixture(scope="module")
def tight_sandbox(stub, runtime):
    ticket = "tight-" + str(int(time.time() * 1000) % 10**8)
    stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket, spec=pb.SandboxSpec(
        limits=pb.Limits(pids=64, memory_bytes=64 * 1024 * 1024, cpus=0.5), runtime=spec_runtime(runtime))))
    try:
        yield ticket
    finally:
        stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))


FORK_BOMB = """python3 -c '
import os, signal
pids, err = [], "none"
try:
    for i in range(400):
        pid = os.fork()
        if pid == 0:
            signal.pause()
            os._exit(0)
        pids.append(pid)
except OSError as e:
    err = str(e.errno)
print(len(pids), err, flush=True)
for p in pids:
    os.kill(p, 9)
    os.waitpid(p, 0)
'"""


def test_r6_fork_bomb_hits_pids_limit_and_host_stays_responsive(stub, tight_sandbox, runtime, plain_sandbox,
                                                               docker_client):
    r = run(stub, tight_sandbox, FORK_BOMB, timeout_ms=60000)
    if runtime == "runc":
        started, err = r.stdout.split()
        assert int(started) < 64 and err == b"11"          # EAGAIN at the pids limit
        assert run(stub, tight_sandbox, "echo alive").stdout.strip() == b"alive"
    else:
        # gVisor's kernel runs inside the container's limits: its own threads count against the pids
        # limit, so the bomb meets EAGAIN or stops the sandbox whole; it never gets its 400 processes.
        out = r.stdout.split()
        assert (len(out) == 2 and int(out[0]) < 64 and out[1] == b"11") or (r.code != 0 and b"400" not in r.stdout)
    # the broker, the other sandboxes and the host still answer
    assert run(stub, plain_sandbox, "echo alive").stdout.strip() == b"alive"
    assert docker_client.ping()


def test_r6_fork_bomb_control_without_limit(control):
    _code, out = control_sh(control, FORK_BOMB)
    assert out.split() == ["400", "none"]              # positive control: no pids limit


@pytest.fixture
def hog_sandbox(stub, runtime):
    ticket = "hog-" + str(int(time.time() * 1000) % 10**8)
    stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket, spec=pb.SandboxSpec(
        limits=pb.Limits(memory_bytes=64 * 1024 * 1024), runtime=spec_runtime(runtime))))
    try:
        yield ticket
    finally:
        stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))


def test_r6_memory_hog_is_killed(stub, hog_sandbox, control, runtime):
    hog = "python3 -c \"b = bytearray(256 * 1024 * 1024); print('allocated', len(b))\""
    r = run(stub, hog_sandbox, hog, timeout_ms=60000)
    # runc: the kernel's OOM killer ends the process; gVisor: its kernel refuses the memory or the
    # container's limit stops the sandbox whole. Never does the allocation succeed.
    assert (r.code == 137 if runtime == "runc" else r.code != 0) and b"allocated" not in r.stdout
    assert "allocated" in control_sh(control, hog)[1]      # positive control
