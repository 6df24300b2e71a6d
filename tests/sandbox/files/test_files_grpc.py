"""The file tools over gRPC on a real sandbox's workspace, with links and a
FIFO made by the sandbox itself: every RPC maps each refusal to its status."""

from __future__ import annotations

import os

import grpc
import pytest

from services._gen.afe.sandbox.v1 import sandbox_pb2 as pb
from services.common.layout import SANDBOX_GID, SANDBOX_UID
from tests.sandbox.conftest import run

pytestmark = [pytest.mark.docker, pytest.mark.timeout(120)]

C = grpc.StatusCode


@pytest.fixture(scope="module")
def files_ws(stub, plain_sandbox, runtime, broker):
    run(stub, plain_sandbox, "rm -rf ft && mkdir -p ft/dir && echo -n content-xyz > ft/dir/f.txt && "
                             "ln -s /etc ft/etc && ln -s dir ft/dirlink" + (" && mkfifo ft/fifo" if runtime == "runc" else ""))
    if runtime == "gvisor":
        # gVisor keeps a FIFO made inside in its own kernel (the host folder gets none), so the host-side
        # file tools meet one only if it is made on the host: made there, they must refuse it the same way.
        fifo = broker.layout.workspace(plain_sandbox) / "ft" / "fifo"
        os.mkfifo(fifo)
        os.chown(fifo, SANDBOX_UID, SANDBOX_GID)
    return plain_sandbox


def calls(t: str, path: str):
    return {
        "ReadFile": lambda s: s.ReadFile(pb.ReadFileRequest(ticket_id=t, path=path)),
        "WriteFile": lambda s: s.WriteFile(pb.WriteFileRequest(ticket_id=t, path=path, content=b"x")),
        "ListDir": lambda s: s.ListDir(pb.ListDirRequest(ticket_id=t, path=path)),
        "Stat": lambda s: s.Stat(pb.StatRequest(ticket_id=t, path=path)),
        "Remove": lambda s: s.Remove(pb.RemoveRequest(ticket_id=t, path=path)),
        "MakeDir": lambda s: s.MakeDir(pb.MakeDirRequest(ticket_id=t, path=path)),
        "Search": lambda s: s.Search(pb.SearchRequest(ticket_id=t, pattern="content", path=path)),
    }


CASES = {
    "ft/../../etc/passwd": dict.fromkeys(calls("", ""), C.INVALID_ARGUMENT),
    "/etc/passwd": dict.fromkeys(calls("", ""), C.INVALID_ARGUMENT),
    "ft/etc/passwd": dict.fromkeys(calls("", ""), C.PERMISSION_DENIED),
    "ft/dirlink/f.txt": dict.fromkeys(calls("", ""), C.PERMISSION_DENIED),
    "ft/fifo": {"ReadFile": C.FAILED_PRECONDITION, "WriteFile": C.FAILED_PRECONDITION,
                "ListDir": C.FAILED_PRECONDITION, "Search": C.FAILED_PRECONDITION, "MakeDir": C.ALREADY_EXISTS},
    "ft/none/x": dict.fromkeys(calls("", ""), C.NOT_FOUND),
}


@pytest.mark.parametrize("path", sorted(CASES))
def test_r17_r19_refusals_map_to_statuses(stub, files_ws, path):
    for rpc, fn in calls(files_ws, path).items():
        want = CASES[path].get(rpc)
        if want is None:
            continue
        with pytest.raises(grpc.RpcError) as ei:
            fn(stub)
        assert ei.value.code() == want, (rpc, ei.value.code())
        assert "content-xyz" not in (ei.value.details() or "")


def test_file_tools_round_trip(stub, files_ws):
    t = files_ws
    assert stub.ReadFile(pb.ReadFileRequest(ticket_id=t, path="ft/dir/f.txt")).content == b"content-xyz"
    stub.WriteFile(pb.WriteFileRequest(ticket_id=t, path="ft/new/a.txt", content=b"abc", create_parents=True))
    assert run(stub, t, "cat ft/new/a.txt").stdout == b"abc"
    names = {e.name: e.type for e in stub.ListDir(pb.ListDirRequest(ticket_id=t, path="ft")).entries}
    assert names["etc"] == pb.SYMLINK and names["dir"] == pb.DIRECTORY and names["fifo"] == pb.OTHER
    assert stub.Stat(pb.StatRequest(ticket_id=t, path="ft/new/a.txt")).size == 3
    found = stub.Search(pb.SearchRequest(ticket_id=t, pattern="cont.nt", regex=True, path="ft")).matches
    assert [(m.path, m.line) for m in found] == [("ft/dir/f.txt", 1)]
    stub.MakeDir(pb.MakeDirRequest(ticket_id=t, path="ft/m/n", parents=True))
    stub.Remove(pb.RemoveRequest(ticket_id=t, path="ft/new", recursive=True))
    # (python's listing: this gVisor release refuses statx with AT_NO_AUTOMOUNT, which coreutils' ls uses)
    listing = run(stub, t, "python3 -c 'import os; print(*sorted(os.listdir(\"ft\")))'").stdout.split()
    assert listing == [b"dir", b"dirlink", b"etc", b"fifo", b"m"]
    r = stub.ReadFile(pb.ReadFileRequest(ticket_id=t, path="ft/dir/f.txt", max_bytes=4))
    assert (r.content, r.size, r.truncated) == (b"cont", 11, True)
