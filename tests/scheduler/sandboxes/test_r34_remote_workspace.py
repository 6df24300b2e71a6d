"""The workspace of a sandbox on another host crosses the network through the
contracts (services/scheduler/sandboxes/remoteworkspace.py), never through a shared
path: a REAL sandbox broker process on the second Docker engine
(tests/support/second_docker.py), reached over TCP with mutual TLS, with a
`--data` folder of its own, and the REAL credential broker (in process, on a
Unix socket) with another `--data` folder.

- prepare: the checkout is made in the credential broker and written into
  the remote broker's workspace (WriteWorkspace); the credential broker's
  own workspaces folder stays empty;
- the sandbox on the second engine changes the workspace; commit and diff
  read it back (ReadWorkspace -> CommitArchive/DiffArchive) and the commit
  holds exactly the sandbox's change, the link it made as a link;
- release keeps the last state in the credential broker's mirror
  (ReleaseArchive); destroy removes the remote workspace;
- the remote broker refuses a hostile WriteWorkspace over mTLS (R19), with a
  plain archive accepted as the control.
"""

from __future__ import annotations

import asyncio
import io
import subprocess
import tarfile

import pytest

from services._gen.afe.sandbox.v1 import sandbox_pb2 as spb
from services.cli.certs import make_certs
from services.common.config.manifests import load_config
from services.common.errors import AfeError
from services.common.layout import Layout
from services.scheduler.sandboxes.brokers import CredentialsClient
from services.scheduler.sandboxes.remoteworkspace import RemoteWorkspaces
from services.scheduler.store.store import Store
from tests.scheduler.conftest import write_config
from tests.scheduler.sandboxes.test_r39_two_docker_hosts import BrokerProcess, _remove_labelled, _set, engine2  # noqa: F401 - fixture
from tests.support.credential_broker import credential_broker
from tests.support.sandbox_broker import new_instance

pytestmark = [pytest.mark.docker, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def remote(engine2, tmp_path_factory):  # noqa: F811 - the fixture imported above
    """Broker `two` on the second engine (its own data dir) and the PKI; `one` is not started."""
    root = tmp_path_factory.mktemp("remote")
    pki = root / "pki"
    make_certs(pki, [("one", ["127.0.0.1"]), ("two", ["127.0.0.1"]), ("scheduler", [])])
    cfg = write_config(root, "")
    instance = new_instance("rw")
    two = BrokerProcess(root, "two", pki, cfg, instance, engine2.host)
    (two.root / "data").mkdir(parents=True)
    two.start()
    try:
        yield {"root": root, "pki": pki, "cfg": cfg, "two": two, "brokers": {"two": two}}
    finally:
        two.stop()
        _remove_labelled(engine2.host, instance)


def _only_two(remote, store):
    """The scheduler's BrokerSet from its flags, with the one broker on the second engine."""
    brokers = _set({"pki": remote["pki"], "brokers": {"one": remote["two"], "two": remote["two"]}}, store)
    brokers.members.pop("one")
    brokers._pending.pop("one")
    return brokers


def _git(gitdir, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", str(gitdir), *args], capture_output=True, text=True,
                          check=True).stdout


async def test_remote_broker_ticket_commits_diffs_and_keeps_without_a_shared_data_dir(remote, tmp_path):
    config = load_config(remote["cfg"])
    layout = Layout(tmp_path / "cb-data", tmp_path / "cb-run")
    remote_ws = remote["two"].root / "data" / "workspaces"
    assert layout.data_dir != remote["two"].root / "data"
    store = Store.sqlite(tmp_path / "afe.db")
    brokers = _only_two(remote, store)
    async with credential_broker(config, layout) as (sock, secret):
        creds = CredentialsClient(sock, secret)
        rw = RemoteWorkspaces(creds, brokers, config)
        tid = "t-remote1"
        try:
            prepared = await rw.prepare(tid, "ws")
            assert brokers.placed_on(tid) == "two"
            assert not layout.workspace(tid).exists()            # nothing laid on the credential broker's side
            assert (remote_ws / tid / "README.md").exists() or any((remote_ws / tid).iterdir())
            assert (remote_ws / tid / ".git").is_dir()           # the sandbox's scratch repository came along
            again = await rw.prepare(tid, "ws")                  # a second prepare keeps the workspace
            assert again.base_sha == prepared.base_sha

            await brokers.create(tid, spb.SandboxSpec(image="afe/sandbox:latest"))
            out = b""
            async for ev in brokers.exec(tid, ["sh", "-c", ("echo remote-change > NEW.txt && ln -s NEW.txt alias"
                                               " && mkdir -p deep/er && echo x > deep/er/f")], timeout_ms=60000):
                out += ev.stderr if ev.WhichOneof("event") == "stderr" else b""
            assert not out, out

            d = await rw.diff(tid, "ws", 100000)
            assert "+remote-change" in d.diff
            c = await rw.commit(tid, "ws", "remote commit")
            assert c.changed and c.files_changed == 3
            gitdir = layout.gitdir(tid)
            assert _git(gitdir, "show", f"{c.sha}:NEW.txt") == "remote-change\n"
            tree = _git(gitdir, "ls-tree", "-r", c.sha)
            assert "120000 blob" in next(line for line in tree.splitlines() if line.endswith("\talias"))
            assert "deep/er/f" in tree and ".git/" not in tree
            # The private copies are gone. A copy whose call was cancelled (the second
            # prepare: the remote broker already held the workspace and read none of the
            # stream) is removed as that call ends, which may be a moment after this point.
            left = await _left_after(layout.data_dir / "handover", 10.0)
            assert not left, f"private copies left in the credential broker: {left}"

            async for _ev in brokers.exec(tid, ["sh", "-c", "echo after-commit > LATER.txt"], timeout_ms=60000):
                pass
            await rw.release(tid, "ws")
            mirror = next((layout.data_dir / "mirrors").glob("*.git"))
            kept = _git(mirror, "ls-tree", "-r", "--name-only", f"refs/afe/kept/{tid}")
            assert "NEW.txt" in kept and "LATER.txt" in kept     # the last state, read from the remote broker
            assert not layout.gitdir(tid).exists()
        finally:
            await brokers.destroy(tid)
            await creds.close()
            await brokers.close()
    assert not (remote_ws / tid).exists()                        # the broker removed the workspace it received
    assert not (remote_ws / f".{tid}.handed").exists()


async def _left_after(folder, seconds: float) -> list[str]:
    """What is still in `folder` once it is empty or `seconds` have passed."""
    for _ in range(int(seconds / 0.05)):
        if not any(folder.iterdir()):
            return []
        await asyncio.sleep(0.05)
    return sorted(p.name for p in folder.iterdir())


def _tar(*entries) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for name, kind, link, data in entries:
            info = tarfile.TarInfo(name)
            info.type, info.linkname, info.size = kind, link, len(data or b"")
            t.addfile(info, io.BytesIO(data) if data else None)
    return buf.getvalue()


async def _chunks(data: bytes):
    yield data


async def test_r19_remote_broker_refuses_a_hostile_workspace_over_mtls(remote, tmp_path):
    store = Store.sqlite(tmp_path / "afe.db")
    brokers = _only_two(remote, store)
    client = brokers.members["two"].client
    remote_ws = remote["two"].root / "data" / "workspaces"
    outside = tmp_path / "outside"
    try:
        hostile = _tar(("evil", tarfile.SYMTYPE, str(outside), None), ("evil/pwned", tarfile.REGTYPE, "", b"hi"))
        with pytest.raises(AfeError, match="never written through a link"):
            await client.write_workspace("t-hostile1", 0, _chunks(hostile))
        with pytest.raises(AfeError, match=r"'\.\.'"):
            await client.write_workspace("t-hostile1", 0,
                                         _chunks(_tar(("../x", tarfile.REGTYPE, "", b"hi"))))
        assert not (remote_ws / "t-hostile1").exists() and not outside.exists()
        # control: the same broker takes a plain archive
        r = await client.write_workspace("t-hostile2", 0, _chunks(_tar(("ok.txt", tarfile.REGTYPE, "", b"ok"))))
        assert r.entries == 1 and (remote_ws / "t-hostile2" / "ok.txt").read_bytes() == b"ok"
    finally:
        await brokers.destroy("t-hostile2")   # never placed: asked of every broker, which removes what it received
        await brokers.close()
    assert not (remote_ws / "t-hostile2").exists()


async def test_r41_the_verification_checkout_crosses_the_network_to_a_fresh_remote_sandbox(remote, tmp_path):
    """Clean-room verification (R41) with the sandbox broker on another host: the head
    (with base_paths from the base branch) is made in the credential broker as an archive
    and written into the remote broker's workspace of `<ticket>-verify`, never laid on the
    credential broker's side; a fresh sandbox there sees exactly that checkout; destroying
    it removes the remote workspace."""
    config = load_config(remote["cfg"])
    layout = Layout(tmp_path / "cb-data", tmp_path / "cb-run")
    remote_ws = remote["two"].root / "data" / "workspaces"
    store = Store.sqlite(tmp_path / "afe.db")
    brokers = _only_two(remote, store)
    async with credential_broker(config, layout) as (sock, secret):
        creds = CredentialsClient(sock, secret)
        rw = RemoteWorkspaces(creds, brokers, config)
        tid, vid = "t-remote2", "t-remote2-verify"
        try:
            await rw.prepare(tid, "ws")
            await brokers.create(tid, spb.SandboxSpec(image="afe/sandbox:latest"))
            async for _ev in brokers.exec(tid, ["sh", "-c", "echo weakened > test_calc.py && echo new > NEW.txt"],
                                          timeout_ms=60000):
                pass
            head = (await rw.commit(tid, "ws", "weaken the test")).sha

            v = await rw.prepare_verification(tid, "ws", head, ["test_calc.py"], ["python3 -m unittest"])
            assert v.sha == head and v.commit != head                 # the head with the base's test_calc.py
            assert brokers.placed_on(vid) == "two"
            assert not layout.workspace(vid).exists()                 # nothing laid on the credential broker's side
            assert (remote_ws / vid / "NEW.txt").read_text() == "new\n"
            assert "weakened" not in (remote_ws / vid / "test_calc.py").read_text()
            await brokers.create(vid, spb.SandboxSpec(image="afe/sandbox:latest"))
            out = b""
            async for ev in brokers.exec(vid, ["sh", "-c", "cat NEW.txt test_calc.py"], timeout_ms=60000):
                out += ev.stdout if ev.WhichOneof("event") == "stdout" else b""
            assert out.startswith(b"new\n") and b"weakened" not in out and b"def test_add" in out
            # control: the same head without base paths is the weakened one
            await brokers.destroy(vid)
            v = await rw.prepare_verification(tid, "ws", head, [], ["python3 -m unittest"])
            assert v.sha == head and (remote_ws / vid / "test_calc.py").read_text() == "weakened\n"
        finally:
            await brokers.destroy(vid)
            await brokers.destroy(tid)
            await creds.close()
            await brokers.close()
    assert not (remote_ws / vid).exists() and not (remote_ws / tid).exists()
