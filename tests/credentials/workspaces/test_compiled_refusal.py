"""builtin:commit refuses files a runtime loads in place of source (issue 31,
"no executable bytes a reviewer cannot read"), through the REAL credential
broker and real git: a committed `__pycache__/*.pyc` is what Python imports
instead of the source beside it, and the diff shows only "Binary files differ".

The control: with the path allowed (allowCompiledPaths) the same workspace
commits and the .pyc is in the commit -- what every change got before. The
refusal does not rely on the repository's `.gitignore`: the sandbox can
rewrite it, and the refusal holds all the same."""

from __future__ import annotations

import importlib.util
import marshal
from pathlib import Path

import grpc
import pytest

from services._gen.afe.credentials.v1 import credentials_pb2 as pb
from tests.credentials.conftest import broker_stub, git_plain, local_workspace, make_config, tree_listing
from tests.support.fakes.git_http import make_bare_repo

pytestmark = pytest.mark.timeout(120)

FILES = {"calc.py": "def add(a, b):\n    return a - b\n", "vendor/libold.so": "ELF old\n",
         ".gitignore": "*.pyc\n__pycache__/\n"}
PYC = "__pycache__/calc.cpython-311.pyc"


def unchecked_pyc(source: str) -> bytes:
    """A .pyc with an unchecked hash (PEP 552 flags=0b01): Python loads it whatever the .py says."""
    code = compile(source, "calc.py", "exec")
    return importlib.util.MAGIC_NUMBER + (1).to_bytes(4, "little") + b"\0" * 8 + marshal.dumps(code)


@pytest.fixture
def origin(short_tmp) -> Path:
    root = short_tmp / "repos"
    root.mkdir()
    return make_bare_repo(root, "origin.git", FILES)


async def _commit(layout, origin, ticket: str, files: dict[str, bytes], allow: tuple[str, ...] = (),
                  remove: tuple[str, ...] = ()):
    """Prepare `ticket`, write `files` (and delete `remove`) in its workspace, commit: (response or error, head)."""
    config = make_config(layout.data_dir.parent, local_workspace(origin, allow_compiled_paths=allow))
    async with broker_stub(config, layout) as (s, _):
        prep = await s.PrepareWorkspace(pb.PrepareWorkspaceRequest(ticket_id=ticket, workspace="local"))
        work = layout.workspace(ticket)
        for rel, data in files.items():
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            (work / rel).write_bytes(data)
        for rel in remove:
            (work / rel).unlink()
        try:
            out: object = await s.Commit(pb.CommitRequest(ticket_id=ticket, workspace="local", message="fix"))
        except grpc.aio.AioRpcError as exc:
            out = exc
    head = git_plain("--git-dir", str(layout.gitdir(ticket)), "rev-parse", f"refs/heads/afe/{ticket}")
    return out, prep.base_sha, head.stdout.decode().strip()


# The cheat of issue 31: the source still broken, a hand-made .pyc of the fixed one, and the
# .gitignore that would have dropped it rewritten by the sandbox.
CHEAT = {"calc.py": b"def add(a, b):\n    return a - b  # still broken\n",
         PYC: unchecked_pyc("def add(a, b):\n    return a + b\n"), ".gitignore": b"build/\n"}


async def test_committed_pyc_is_refused_even_when_the_sandbox_rewrote_gitignore(layout, origin):
    out, base, head = await _commit(layout, origin, "pyc1", CHEAT)
    assert isinstance(out, grpc.aio.AioRpcError), out
    assert out.code() == grpc.StatusCode.FAILED_PRECONDITION
    text = out.details()
    assert f"`{PYC}`" in text and "in place of source" in text and "allowCompiledPaths: [__pycache__/]" in text
    assert head == base               # nothing committed


async def test_control_allowed_path_lets_the_pyc_into_the_commit(layout, origin):
    """Without the refusal (the path allowed) the .pyc lands in the commit, next to the broken source."""
    out, base, head = await _commit(layout, origin, "pyc0", CHEAT, allow=("__pycache__/",))
    assert isinstance(out, pb.CommitResponse) and out.changed and out.sha == head != base
    tree = tree_listing(layout.gitdir("pyc0"), head)
    assert PYC in tree and "calc.py" in tree


async def test_gitignored_pycache_is_dropped_before_the_check(layout, origin):
    """The repository's own .gitignore (intact) already keeps a run's caches out: nothing to refuse."""
    files = {"calc.py": b"def add(a, b):\n    return a + b\n", PYC: unchecked_pyc("x = 1\n"),
             "pkg/__pycache__/m.cpython-311.pyc": b"\x00" * 16}
    out, _base, head = await _commit(layout, origin, "pyc2", files)
    assert isinstance(out, pb.CommitResponse) and out.changed, out
    tree = tree_listing(layout.gitdir("pyc2"), head)
    assert "calc.py" in tree and not any("__pycache__" in p for p in tree)


@pytest.mark.parametrize("path,allow,refused", [
    ("lib/_speedups.cpython-311-x86_64-linux-gnu.so", (), True),
    ("build/Main.class", (), True),
    ("addon/build/Release/addon.node", (), True),
    ("web/app.wasm", (), True),
    ("libz.so.1", (), True),
    ("vendor/libold.so", (), True),                         # modifying a compiled file the base has
    ("web/app.wasm", ("web/*.wasm",), False),
    ("vendor/libnew.so", ("vendor/",), False),
    ("vendor/libnew.so", ("vendor/libnew.so",), False),
    ("vendorx/libnew.so", ("vendor/",), True),
    ("docs/guide.md", (), False),
])
async def test_compiled_files_table(layout, origin, path, allow, refused):
    out, base, head = await _commit(layout, origin, "tbl", {path: b"\x7fELF new\n"}, allow=allow)
    if refused:
        assert isinstance(out, grpc.aio.AioRpcError) and f"`{path}`" in out.details(), out
        assert head == base
    else:
        assert isinstance(out, pb.CommitResponse) and out.changed and path in tree_listing(layout.gitdir("tbl"), head)


async def test_deleting_a_compiled_file_is_allowed(layout, origin):
    out, _base, head = await _commit(layout, origin, "del", {}, remove=("vendor/libold.so",))
    assert isinstance(out, pb.CommitResponse) and out.changed, out
    assert "vendor/libold.so" not in tree_listing(layout.gitdir("del"), head)
