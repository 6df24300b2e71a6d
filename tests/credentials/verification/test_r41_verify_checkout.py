"""R41: the clean-room checkout of a head for its verification, made by the
real credential broker (over its gRPC contract) with real git: the head
merged onto the base branch's tip, except the `base_paths`, which are the
base branch's (the head's edits under them replaced, files it added there
removed). The harness beyond base_paths: test_r41_harness_checkout.py."""

from __future__ import annotations

import grpc
import pytest

from services._gen.afe.credentials.v1 import credentials_pb2 as pb
from tests.credentials.conftest import broker_stub, git_plain, local_workspace, make_config

pytestmark = pytest.mark.timeout(60)

TID = "t-0123456789ab"
BASE_TEST = "def test_sum():\n    assert 1 + 1 == 3\n"
WEAKENED = "def test_sum():\n    assert True\n"


def _origin_with_tests(origin):
    """The base branch: src/app.py and a failing tests/test_sum.py."""
    work = origin.parent / "seed"
    git_plain("clone", "-q", str(origin), str(work))
    (work / "tests").mkdir()
    (work / "tests" / "test_sum.py").write_text(BASE_TEST)
    git_plain("add", "-A", cwd=work)
    git_plain("commit", "-qm", "tests", cwd=work)
    git_plain("push", "-q", "origin", "HEAD:main", cwd=work)
    return git_plain("rev-parse", "HEAD", cwd=work).stdout.decode().strip()


async def _head_that_weakens_the_test(stub, layout):
    await stub.PrepareWorkspace(pb.PrepareWorkspaceRequest(ticket_id=TID, workspace="local"))
    work = layout.workspace(TID)
    (work / "tests" / "test_sum.py").write_text(WEAKENED)
    (work / "tests" / "conftest.py").write_text("import pytest\n")
    (work / "src" / "app.py").write_text("print('fixed')\n")
    r = await stub.Commit(pb.CommitRequest(ticket_id=TID, workspace="local", message="fix"))
    return r.sha


async def test_r41_base_paths_replace_the_heads_tests_and_keep_the_rest(local_origin, layout):
    base = _origin_with_tests(local_origin)
    config = make_config(layout.data_dir.parent, local_workspace(local_origin))
    async with broker_stub(config, layout) as (stub, _):
        head = await _head_that_weakens_the_test(stub, layout)
        verify = layout.workspace(TID + "-verify")

        # Positive control: without base paths the head's weakened test is what runs.
        r = await stub.PrepareVerification(pb.PrepareVerificationRequest(
            ticket_id=TID, workspace="local", sha=head))
        assert (r.sha, r.base_sha, r.workspace_ticket) == (head, base, TID + "-verify")
        assert (verify / "tests" / "test_sum.py").read_text() == WEAKENED
        # a conftest.py is harness, taken from the base (where there is none) and reported
        assert not (verify / "tests" / "conftest.py").exists() and list(r.harness_changes) == ["tests/conftest.py"]

        (verify / "leftover").write_text("from an earlier run")
        r = await stub.PrepareVerification(pb.PrepareVerificationRequest(
            ticket_id=TID, workspace="local", sha=head, base_paths=["tests/"]))
        assert r.sha == head and r.base_sha == base and r.commit != head
        assert (verify / "tests" / "test_sum.py").read_text() == BASE_TEST      # the edit replaced
        assert not (verify / "tests" / "conftest.py").exists()                  # the added file removed
        assert (verify / "src" / "app.py").read_text() == "print('fixed')\n"    # the rest of the head kept
        assert not (verify / "leftover").exists()                               # a fresh folder
        assert (layout.workspace(TID) / "tests" / "test_sum.py").read_text() == WEAKENED  # the ticket's untouched
        # The checked-out commit merges the head onto the base; its tree is the base's tests plus the head's rest.
        parents = git_plain("--git-dir", str(layout.gitdir(TID)), "rev-parse", r.commit + "^1", r.commit + "^2")
        assert parents.stdout.decode().split() == [base, head]

        await stub.ReleaseVerification(pb.ReleaseWorkspaceRequest(ticket_id=TID, workspace="local"))
        assert not verify.exists()
        await stub.PrepareVerification(pb.PrepareVerificationRequest(
            ticket_id=TID, workspace="local", sha=head, base_paths=["tests"]))
        await stub.ReleaseWorkspace(pb.ReleaseWorkspaceRequest(ticket_id=TID, workspace="local"))
        assert not verify.exists() and not layout.workspace(TID).exists()


async def test_r41_a_head_pushed_by_a_person_is_fetched(local_origin, layout):
    _origin_with_tests(local_origin)
    config = make_config(layout.data_dir.parent, local_workspace(local_origin))
    async with broker_stub(config, layout) as (stub, _):
        await stub.PrepareWorkspace(pb.PrepareWorkspaceRequest(ticket_id=TID, workspace="local"))
        work = local_origin.parent / "person"
        git_plain("clone", "-q", str(local_origin), str(work))
        (work / "tests" / "test_sum.py").write_text(WEAKENED)
        git_plain("commit", "-qam", "by hand", cwd=work)
        git_plain("push", "-q", "origin", f"HEAD:afe/{TID}", cwd=work)
        pushed = git_plain("rev-parse", "HEAD", cwd=work).stdout.decode().strip()
        r = await stub.PrepareVerification(pb.PrepareVerificationRequest(
            ticket_id=TID, workspace="local", sha=pushed, base_paths=["tests/"]))
        assert r.sha == pushed
        assert (layout.workspace(TID + "-verify") / "tests" / "test_sum.py").read_text() == BASE_TEST
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.PrepareVerification(pb.PrepareVerificationRequest(
                ticket_id=TID, workspace="local", sha="ab" * 20))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("path, why", [
    ("/etc", "absolute"), ("../outside", "'..'"), ("tests/../../x", "'..'"), ("", "empty"),
    ("  ", "empty"), (".", "whole repository"), (".git/config", "git's own"), ("tests\n", "control"),
])
async def test_r41_bad_base_paths_are_refused(local_origin, layout, path, why):
    config = make_config(layout.data_dir.parent, local_workspace(local_origin))
    async with broker_stub(config, layout) as (stub, _):
        await stub.PrepareWorkspace(pb.PrepareWorkspaceRequest(ticket_id=TID, workspace="local"))
        head = git_plain("--git-dir", str(local_origin), "rev-parse", "main").stdout.decode().strip()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.PrepareVerification(pb.PrepareVerificationRequest(
                ticket_id=TID, workspace="local", sha=head, base_paths=["tests/", path]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert why in e.value.details()
        assert not layout.workspace(TID + "-verify").exists()
