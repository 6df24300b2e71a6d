"""R34: the workspace has a disk cap.

Through the real broker (gRPC, real Docker): a sandbox created with
`disk: 64m` that writes 200 MiB gets ENOSPC, at most ~64 MiB land on the
host, and another ticket's sandbox (the positive control: the default 10g
cap, larger than the write) writes the same 200 MiB; the broker keeps
answering. Destroy leaves no mount, loop device or image; a broker that
restarts reconciles the mounts of dead tickets away. The watchdog mode (a
broker that cannot mount) stops a sandbox that writes past its cap and
says why; with a cap above the write the same writer finishes.
"""

from __future__ import annotations

import os
import re
import subprocess

import docker
import pytest

from services._gen.afe.sandbox.v1 import sandbox_pb2 as pb
from services.common.errors import FailedPrecondition
from services.common.host import mountinfo
from services.common.layout import Layout
from services.sandbox.commands.execs import Exit, Runner
from services.sandbox.containers.hardening import SandboxSettings
from services.sandbox.files import diskcap
from services.sandbox.sandboxes import SandboxManager
from tests.sandbox.conftest import run, spec_runtime
from tests.support.sandbox_broker import new_instance

pytestmark = [pytest.mark.docker, pytest.mark.timeout(240)]

MIB = 1024 ** 2
WRITE_200M = "dd if=/dev/zero of=/workspace/big bs=1M count=200 conv=fsync 2>&1"

needs_mount = pytest.mark.skipif(diskcap.detect_mode()[0] != diskcap.MODE_MOUNT,
                                 reason="the broker cannot loop-mount here: " + diskcap.detect_mode()[1])


def _mounted(path) -> bool:
    return any(m.target == str(path) for m in mountinfo.mounts())


def _losetup() -> str:
    return subprocess.run(["losetup", "-a"], capture_output=True, text=True, check=False).stdout


def _host_bytes(path) -> int:
    st = os.stat(path, follow_symlinks=False)
    return st.st_blocks * 512


def _spec(disk: int = 0, runtime: str = "runc") -> pb.SandboxSpec:
    return pb.SandboxSpec(limits=pb.Limits(disk_bytes=disk), runtime=spec_runtime(runtime))


@needs_mount
def test_r34_write_past_the_disk_cap_gets_enospc_and_other_tickets_keep_working(stub, broker, runtime):
    layout = broker.layout
    capped, other = "cap-" + new_instance("c"), "free-" + new_instance("f")
    try:
        stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=capped, spec=_spec(64 * MIB, runtime)))
        stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=other, spec=_spec(0, runtime)))   # default: 10g
        ws = layout.workspace(capped)
        assert _mounted(ws) and diskcap.DiskCaps(layout.workspaces_dir, diskcap.MODE_MOUNT).image_path(
            capped).exists()

        r = run(stub, capped, WRITE_200M)
        assert r.code != 0, r
        assert b"No space left on device" in r.stdout + r.stderr, r
        landed = _host_bytes(ws / "big")
        assert landed <= 64 * MIB, landed
        image = layout.workspaces_dir / f".{capped}.img"
        assert _host_bytes(image) <= 66 * MIB     # the image's blocks on the host: the cap plus metadata

        # Positive control: the same write in a sandbox whose cap is above it lands in full.
        r2 = run(stub, other, WRITE_200M)
        assert r2.code == 0, r2
        assert _host_bytes(layout.workspace(other) / "big") >= 200 * MIB
        assert run(stub, other, "rm /workspace/big").code == 0

        # The full sandbox recovers once it deletes, and the broker answers for everyone.
        assert run(stub, capped, "rm /workspace/big && echo fine > /workspace/after && cat /workspace/after"
                   ).stdout == b"fine\n"
        live = {s.ticket_id for s in stub.ListSandboxes(pb.ListSandboxesRequest()).sandboxes}
        assert {capped, other} <= live
    finally:
        stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=capped))
        stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=other))
    # Destroy leaves no mount, no loop device, no image and no folder (the
    # credential broker released the workspace first: teardown's order).
    for t in (capped, other):
        assert not _mounted(layout.workspace(t))
        assert not (layout.workspaces_dir / f".{t}.img").exists()
        assert f".{t}.img" not in _losetup()
    assert not layout.workspace(capped).exists()


@needs_mount
def test_r34_the_checkout_moves_into_the_capped_workspace_intact(stub, broker):
    """What the credential broker checked out is in /workspace (modes, links,
    dot files), runs (no noexec), and the hidden original no longer takes disk."""
    layout = broker.layout
    ticket = "copy-" + new_instance("k")
    ws = layout.workspace(ticket)
    (ws / "pkg" / "deep" / "er").mkdir(parents=True)
    (ws / "pkg" / "deep" / "er" / "leaf.txt").write_text("leaf\n")
    (ws / "run.py").write_text("print('ran', 6 * 7)\n")
    (ws / "tool.sh").write_text("#!/bin/sh\necho tool\n")
    os.chmod(ws / "tool.sh", 0o755)
    (ws / ".hidden").write_bytes(os.urandom(3 * MIB))
    os.symlink("pkg/deep/er/leaf.txt", ws / "link")
    os.symlink("/etc/passwd", ws / "outside")          # copied as a link, never followed
    try:
        stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket, spec=_spec(32 * MIB)))
        assert _mounted(ws)
        r = run(stub, ticket, "cd /workspace && python3 run.py && ./tool.sh && cat link && readlink outside "
                "&& stat -c %a tool.sh && wc -c < .hidden && id -u && touch new && echo ok")
        assert r.code == 0, r
        assert r.stdout.decode().split("\n")[:-1] == ["ran 42", "tool", "leaf", "/etc/passwd", "755",
                                                      str(3 * MIB), "10001", "ok"]
        assert os.readlink(ws / "outside") == "/etc/passwd"
    finally:
        stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))
    # the originals were deleted from under the mount, so the folder under it
    # was empty and went with the image
    assert not _mounted(ws) and not ws.exists()


@needs_mount
def test_r34_a_checkout_larger_than_the_cap_is_refused_naming_the_limit(stub, broker):
    import grpc
    ticket = "big-" + new_instance("b")
    ws = broker.layout.workspace(ticket)
    ws.mkdir(parents=True)
    (ws / "blob").write_bytes(b"x" * (24 * MIB))
    try:
        with pytest.raises(grpc.RpcError) as err:
            stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket, spec=_spec(16 * MIB)))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "sandbox.limits.disk (16m)" in err.value.details()
        # nothing was lost or left mounted
        assert not _mounted(ws) and (ws / "blob").stat().st_size == 24 * MIB
    finally:
        stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))


@needs_mount
async def test_r34_reconcile_after_a_broker_restart_removes_mounts_of_dead_tickets(tmp_path):
    layout = Layout(tmp_path / "data", tmp_path / "run")
    layout.ensure()
    instance = new_instance("rc")
    client = docker.from_env()
    dead, live = "dead-" + new_instance("d"), "live-" + new_instance("l")
    first = SandboxManager(layout, instance=instance, client=client)
    try:
        for t in (dead, live):
            await first.create(SandboxSettings(ticket_id=t, disk_bytes=32 * MIB))
        image = {t: first.diskcap.image_path(t) for t in (dead, live)}
        # The broker goes away without any cleanup; a new one of the same instance starts.
        del first
        again = SandboxManager(layout, instance=instance, client=client)
        assert _mounted(layout.workspace(dead)) and image[dead].exists()   # left behind until reconciled
        res = await again.reconcile([live])
        assert dead in res.removed_tickets and live not in res.removed_tickets
        assert not _mounted(layout.workspace(dead)) and not image[dead].exists()
        assert str(image[dead]) not in _losetup()
        # the live ticket keeps its capped workspace and its sandbox
        assert _mounted(layout.workspace(live)) and image[live].exists()
        runner = Runner(again)
        out = [ev async for ev in runner.run_exec(live, ["bash", "-c", "df -m /workspace | tail -1"])]
        assert out[-1].code == 0
        await again.destroy(live)
        assert not _mounted(layout.workspace(live)) and not image[live].exists()
    finally:
        last = SandboxManager(layout, instance=instance, client=client)
        await last.reconcile([])
        client.close()


async def _fill(runner: Runner, ticket: str) -> tuple[int, str]:
    # 24 steps of 4 MiB, a pause between them: 96 MiB over a few seconds
    script = ("for i in $(seq 1 24); do dd if=/dev/zero of=/workspace/f$i bs=1M count=4 2>/dev/null || exit 3; "
              "sleep 0.25; done; echo done")
    code, text = -1, []
    async for ev in runner.run_exec(ticket, ["bash", "-c", script], timeout_ms=120_000):
        if isinstance(ev, Exit):
            code = ev.code
        else:
            text.append(ev.data.decode())
    return code, "".join(text)


async def test_r34_watchdog_stops_a_sandbox_that_writes_past_its_cap(tmp_path):
    """The mode of a broker that cannot mount (e.g. the systemd deployment)."""
    layout = Layout(tmp_path / "data", tmp_path / "run")
    layout.ensure()
    instance = new_instance("wd")
    client = docker.from_env()
    mgr = SandboxManager(layout, instance=instance, client=client, disk_mode=diskcap.MODE_WATCHDOG)
    runner = Runner(mgr)
    try:
        await mgr.create(SandboxSettings(ticket_id="wd-capped", disk_bytes=16 * MIB))
        await mgr.create(SandboxSettings(ticket_id="wd-free", disk_bytes=1024 * MIB))
        assert not _mounted(layout.workspace("wd-capped"))          # no image: the watchdog's mode
        code, text = await _fill(runner, "wd-capped")
        assert code != 0 and "done" not in text
        assert "disk cap of 16m (sandbox.limits.disk)" in text, text
        used, _ = diskcap.usage(layout.workspace("wd-capped"), 1 << 40)
        assert used < 96 * MIB
        with pytest.raises(FailedPrecondition, match=re.escape("sandbox.limits.disk")):
            [ev async for ev in runner.run_exec("wd-capped", ["true"])]
        with pytest.raises(FailedPrecondition, match=re.escape("sandbox.limits.disk")):
            await mgr.create(SandboxSettings(ticket_id="wd-capped", disk_bytes=16 * MIB))
        # Positive control: the same writer under a cap above what it writes finishes.
        code, text = await _fill(runner, "wd-free")
        assert code == 0 and "done" in text, text
        assert diskcap.usage(layout.workspace("wd-free"), 1 << 40)[0] >= 96 * MIB
    finally:
        await mgr.reconcile([])
        client.close()


def test_r34_disk_bounds_of_the_contract():
    assert diskcap.resolve_disk(0) == 10 * 1024 ** 3
    assert diskcap.resolve_disk(64 * MIB) == 64 * MIB
    for bad in (-1, 1, 15 * MIB, 17 * 1024 ** 4):
        with pytest.raises(Exception, match=re.escape("sandbox.limits.disk")):
            diskcap.resolve_disk(bad)
    assert diskcap.format_size(64 * MIB) == "64m" and diskcap.format_size(10 * 1024 ** 3) == "10g"


@needs_mount
def test_r34_a_deleted_data_folder_leaks_its_disk_caps_until_released_under_that_folder_only():
    """The tests' safety net (tests/conftest.py): a data folder deleted without
    reconciling the broker leaves the loop mount and device behind (shown
    first: the leak is real); `release_disk_caps` removes those under the
    folders it is given and leaves another folder's cap alone."""
    from tests.support.temp_roots import disk_caps_left, release_disk_caps, remove_temp_root, temp_root

    leaky, other = temp_root("afe-leak-"), temp_root("afe-keep-")
    try:
        for root in (leaky, other):
            caps = diskcap.DiskCaps(root / "workspaces", diskcap.MODE_MOUNT)
            (root / "workspaces" / "t1").mkdir(parents=True)
            assert caps.ensure_mounted("t1", root / "workspaces" / "t1", 16 * MIB)
        subprocess.run(["rm", "-rf", str(leaky / "workspaces")], check=False)   # what a test's clean-up did
        left = disk_caps_left([leaky])
        assert f"mount {leaky}/workspaces/t1 (image {leaky}/workspaces/.t1.img (deleted))" in left, left
        assert any(line.startswith("loop device /dev/loop") for line in left), left
        assert str(leaky / "workspaces/.t1.img") in _losetup()

        assert release_disk_caps([leaky]) == left
        assert disk_caps_left([leaky]) == [] and str(leaky / "workspaces/.t1.img") not in _losetup()
        assert _mounted(other / "workspaces" / "t1") and len(disk_caps_left([other])) == 2
    finally:
        remove_temp_root(leaky)
        remove_temp_root(other)
    assert disk_caps_left([leaky, other]) == [] and not other.exists()
